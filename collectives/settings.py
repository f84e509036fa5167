"""The environment variables that change how this library runs, read one way: a value that is not
what the variable takes is a ValueError naming the variable and the value, never ignored.

    size = settings.fr_buffer_size()                           # torch's flight recorder: 0 when unset
    world = settings.whole("WORLD_SIZE", None, least=1)         # a whole number; None: the variable is required

The shm backend's own (COLLECTIVES_SHM_*) are read by collectives/shm/config.py the same way.
The launcher reads every one a run needs before it spawns a rank (launcher.env.check_settings),
so that a typo stops the run at once rather than in every rank's init_process_group.
"""

from __future__ import annotations

import os
from typing import Mapping, Optional


def whole(name: str, default: Optional[int], least: int = 0, environ: Optional[Mapping[str, str]] = None) -> int:
    """The variable as a whole number of at least `least`; `default` when unset or empty (None:
    the variable is required)."""
    raw = (os.environ if environ is None else environ).get(name)
    if (raw is None or raw.strip() == "") and default is not None:
        return default
    try:
        value = int(raw)
    except (TypeError, ValueError):
        value = None
    if value is None or value < least:
        raise ValueError(f"{name}={raw!r}: must be a whole number of at least {least}")
    return value


SHM_FR_ENTRIES = 2000  # the shm backend records by default, as many entries as torch keeps on NCCL
# The shm backend's native record is a ring of about 224 bytes an entry, allocated whole when a
# group starts: 10**8 entries asked for 22 GB per rank and group, and every rank died of
# std::bad_alloc without naming the variable. A million entries is 224 MB.
MAX_FR_ENTRIES = 1_000_000


def fr_buffer_size(environ: Optional[Mapping[str, str]] = None, default: int = 0) -> int:
    """TORCH_FR_BUFFER_SIZE, torch's flight-recorder size: 0 when unset. Read as torch reads it in
    every rank as it starts, where anything but digits (an empty value too) aborts the rank in C++
    (SIGABRT, which would read as a size or dtype mismatch): so refused here, before."""
    value = (os.environ if environ is None else environ).get("TORCH_FR_BUFFER_SIZE")
    if value is None:
        return default
    if not value.strip().isdigit():
        raise ValueError(f"TORCH_FR_BUFFER_SIZE={value!r} is not a whole number of entries (torch's flight recorder: "
                         "0 or unset for off, 2000 to keep each rank's last 2000 calls)")
    if int(value) > MAX_FR_ENTRIES:
        raise ValueError(f"TORCH_FR_BUFFER_SIZE={value!r}: at most {MAX_FR_ENTRIES} entries (each rank's record holds "
                         f"about 224 bytes an entry for every group, allocated as the group starts: "
                         f"{int(value) * 224 / 1e9:.3g} GB here)")
    return int(value)
