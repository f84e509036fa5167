"""The environment variables that change how this library runs, read one way: a value that is not
what the variable takes is a ValueError naming the variable and the value, never ignored.

    size = settings.whole("TORCH_FR_BUFFER_SIZE", default=0)    # 0 when unset or empty

The shm backend's own (COLLECTIVES_SHM_*) are read by collectives/shm/config.py the same way.
The launcher reads every one a run needs before it spawns a rank (launcher.env.check_settings),
so that a typo stops the run at once rather than in every rank's init_process_group.
"""

from __future__ import annotations

import os
from typing import Mapping, Optional


def whole(name: str, default: int, least: int = 0, environ: Optional[Mapping[str, str]] = None) -> int:
    """The variable as a whole number of at least `least`; `default` when unset or empty."""
    raw = (os.environ if environ is None else environ).get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        value = None
    if value is None or value < least:
        raise ValueError(f"{name}={raw!r}: must be a whole number of at least {least}")
    return value
