"""The shm backend's settings, read from the environment once per process group, checked.

    COLLECTIVES_SHM_SLOT_MB=64           data slot per rank, MiB (in half-slot rounds a 25 MiB DDP bucket is one)
    COLLECTIVES_SHM_ROUND_KB=auto        a large collective goes through the slots in rounds of at most this,
                                         KiB; auto: 1024 where every rank has a core of its own (a round's
                                         data stays in cache between its copy and its sum), else half a slot
                                         (where ranks share cores each round's barriers may wait for one)
    COLLECTIVES_SHM_REGIONS=2            a slot is cut into round-sized regions that rounds use in turn: 2 (its
                                         halves), more, or auto (as many as fit, so a region is written again
                                         only after its lines have left the peers' caches: meant for where
                                         handing lines between cores is slow; 1.5x slower elsewhere: the record below)
    COLLECTIVES_SHM_INLINE_BYTES=65536   calls this small run in the calling thread when nothing is queued; on
                                         the native path so does any call its caller waits for at once
                                         (async_op=False), whatever its size
    COLLECTIVES_SHM_MAILBOX_KB=256       point-to-point mailbox per ordered pair of ranks, KiB
    COLLECTIVES_SHM_PIECE_KB=1024        all_reduce's step 3 in pieces this size, KiB (python_path.py)
    COLLECTIVES_SHM_CMA=0                cross-memory attach: 0/off, auto (where ranks have cores), 1/on;
                                         off by default: the segment in 1 MiB rounds is faster there
    COLLECTIVES_SHM_CMA_MIN_KB=16384     all_reduces this large or larger use it, KiB (cma.py)
    COLLECTIVES_SHM_WAIT=futex           how a rank waits at a barrier: futex, spin, yield or sleep (wait.py)
    COLLECTIVES_SHM_WORKER_NICE=19       the nice value of the native engine's worker thread (0-19): the
                                         queued calls it runs yield to computing threads (docs/shm.md)
    COLLECTIVES_SHM_PATH=native          native: the collectives run in C++ (forward.cpp's engine); python:
                                         every call runs in Python (python_path.py, the reference the docs teach)

    config = ShmConfig.from_env()        # ShmBackend does this once, and hands it down

A value that is not a number (or not one of the choices) is a ValueError naming the variable.
Why the defaults are what they are: docs/shm.md; the measurements: benchmarks/RESULTS.md ("Why are the shm backend's defaults what they are?").
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Mapping, Optional

ALIGN = 64  # every slot, half-slot and mailbox half starts 64-byte aligned
AUTO_ROUND_BYTES = 1 << 20  # COLLECTIVES_SHM_ROUND_KB=auto where every rank has a core (docs/shm.md)

WAIT_STRATEGIES = ("futex", "spin", "yield", "sleep")  # how a rank waits at a barrier (wait.py)
PATHS = ("native", "python")  # where a group's calls run (docs/shm.md: the native path)
# The sizes' unit in bytes. Each is at most MAX_BYTES: the native engine holds sizes in a C++
# int64, and 1e30 was taken as a number, then every rank failed in C++ without naming the setting.
UNITS = {"slot_mb": (1 << 20, "MiB"), "inline_bytes": (1, "bytes"), "mailbox_kb": (1 << 10, "KiB"),
         "piece_kb": (1 << 10, "KiB"), "cma_min_kb": (1 << 10, "KiB"), "round_kb": (1 << 10, "KiB")}
MAX_BYTES = 1 << 40  # 1 TiB
MAX_REGIONS = 1 << 16
_CHOICES = {"cma": ("auto", "1", "on", "0", "off"), "wait": WAIT_STRATEGIES, "path": PATHS}


@dataclasses.dataclass(frozen=True)
class ShmConfig:
    slot_mb: float = 64.0
    inline_bytes: int = 64 << 10
    mailbox_kb: float = 256.0
    piece_kb: float = 1024.0
    cma: str = "0"
    cma_min_kb: float = float(16 << 10)
    wait: str = "futex"
    path: str = "native"
    worker_nice: int = 19
    round_kb: str = "auto"  # or a number of KiB, as a string: round_bytes() resolves it
    regions: str = "2"  # a whole number from 2, or auto, as a string: region_count() resolves it

    @property
    def slot_bytes(self) -> int:
        return int(self.slot_mb * (1 << 20))

    @property
    def mailbox_bytes(self) -> int:
        return max(2 * ALIGN, int(self.mailbox_kb * 1024) // (2 * ALIGN) * 2 * ALIGN)

    @property
    def piece_bytes(self) -> int:
        return int(self.piece_kb * 1024)

    @property
    def cma_min_bytes(self) -> int:
        return int(self.cma_min_kb * 1024)

    def round_bytes(self, world_size: int, cores: int) -> int:
        """The most a round of a large collective moves per slot: COLLECTIVES_SHM_ROUND_KB, or for
        auto 1 MiB when `world_size` ranks have `cores` cores between them to run on, else half a
        slot; never more than half a slot, a multiple of 64 bytes (ALIGN), at least 64."""
        half = self.slot_bytes // 2
        if self.round_kb == "auto":
            wanted = AUTO_ROUND_BYTES if world_size <= cores else half
        else:
            wanted = int(float(self.round_kb) * 1024)
        return max(ALIGN, min(half, wanted) // ALIGN * ALIGN)

    def region_count(self, round_bytes: int) -> int:
        """How many round-sized regions of a slot the rounds use in turn: COLLECTIVES_SHM_REGIONS,
        or for auto as many as fit; at least 2, at most as many as fit."""
        fit = max(2, self.slot_bytes // round_bytes)
        return fit if self.regions == "auto" else max(2, min(fit, int(self.regions)))

    @classmethod
    def from_env(cls, environ: Optional[Mapping[str, str]] = None) -> "ShmConfig":
        environ = os.environ if environ is None else environ
        values = {}
        for field in dataclasses.fields(cls):
            var = "COLLECTIVES_SHM_" + field.name.upper()
            raw = environ.get(var)
            if raw is None or raw == "":
                continue
            if field.name in ("round_kb", "regions") and raw == "auto":
                values[field.name] = raw
                continue
            if field.name in _CHOICES:
                if raw not in _CHOICES[field.name]:
                    raise ValueError(f"{var}={raw!r}: must be one of {', '.join(_CHOICES[field.name])}")
                values[field.name] = raw
                continue
            try:
                number = float(raw)
            except ValueError:
                what = "auto or a number" if field.name in ("round_kb", "regions") else "a number"
                raise ValueError(f"{var}={raw!r}: must be {what}") from None
            if field.name == "worker_nice":
                if not math.isfinite(number) or number != int(number) or not 0 <= number <= 19:
                    raise ValueError(f"{var}={raw!r}: must be a whole number from 0 to 19")
            elif field.name == "regions":
                if not math.isfinite(number) or number != int(number) or not 2 <= number <= MAX_REGIONS:
                    raise ValueError(f"{var}={raw!r}: must be auto or a whole number from 2 to {MAX_REGIONS}")
            elif not math.isfinite(number) or number < 0 or (number == 0 and field.name != "inline_bytes"):
                raise ValueError(f"{var}={raw!r}: must be a positive number")
            elif number * UNITS[field.name][0] > MAX_BYTES:
                unit, name = UNITS[field.name]
                raise ValueError(f"{var}={raw!r}: must be at most {MAX_BYTES // unit} ({name}; 1 TiB)")
            values[field.name] = (int(number) if field.type in (int, "int") else
                                  _text(number) if field.name in ("round_kb", "regions") else number)
        return cls(**values)


def _text(number: float) -> str:
    """A setting kept as text, written one way: 1024.0 and 1024 are both "1024"."""
    return str(int(number)) if number == int(number) else repr(number)


def parse_setting(text: str) -> tuple:
    """'COLLECTIVES_SHM_<NAME>=<value>' -> (variable, value), checked as from_env checks it; a
    ValueError naming what is wrong otherwise (benchmarks' --setting)."""
    var, _, value = text.partition("=")
    names = {"COLLECTIVES_SHM_" + f.name.upper() for f in dataclasses.fields(ShmConfig)}
    if not var.startswith("COLLECTIVES_SHM_") or not value:
        raise ValueError(f"{text!r}: give COLLECTIVES_SHM_<NAME>=<value>, one of {', '.join(sorted(names))}")
    if var not in names:
        raise ValueError(f"{var} is not a shm setting: one of {', '.join(sorted(names))}")
    ShmConfig.from_env({var: value})
    return var, value


def parse_settings(text: str) -> dict:
    """'A=1' or 'A=1,B=2' (COLLECTIVES_SHM_* settings for one group) -> {variable: value}, each
    checked by parse_setting and all of them together as from_env reads them."""
    settings = dict(parse_setting(part) for part in text.split(","))
    ShmConfig.from_env(settings)
    return settings

