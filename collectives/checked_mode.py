"""Checked mode: before each collective, the ranks compare what they are about to do.

    with collectives.checked():          # or COLLECTIVES_CHECKED=1 in every rank's environment
        collectives.all_reduce(t, op="sum")

Every rank sends a fingerprint (collective, op, shape, dtype, device type, root, group, sequence
number, and whether its own local checks failed) in one small all_gather of 16 int64s, which is
the same size on every rank and so cannot itself abort Gloo. If any two differ, every rank of the
group raises `CollectiveMismatchError` naming the ranks and what each passed, before the real
collective, so the group stays usable. Without it, Gloo aborts the process on a size mismatch,
hangs on a mismatched collective, and silently mixes a SUM with a MAX.

Turn it on in all ranks or none: the fingerprint exchange is itself a collective.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import zlib
from typing import Iterator, List, Optional

import torch
import torch.distributed as dist

from . import compat
from .checks import GroupInfo
from .errors import CollectiveError, CollectiveMismatchError
from .names import COLLECTIVES
from .reduce_ops import OP_NAMES

ENV_VAR = "COLLECTIVES_CHECKED"
# Collectives whose ranks may pass different first dimensions.
DIM0_FREE = ("all_gather", "gather")
# Every dtype torch has, in a fixed order (the same on every rank running the same torch).
DTYPES = sorted({v for v in vars(torch).values() if isinstance(v, torch.dtype)}, key=str)
DEVICE_TYPES = ("cpu", "cuda")
SLOTS = 16
MAX_DIMS = 6  # dims beyond these are compared by a checksum

_depth = 0
_from_env = os.environ.get(ENV_VAR, "0").strip().lower() not in ("", "0", "false", "no")


@contextlib.contextmanager
def checked(enabled: bool = True) -> Iterator[None]:
    """Turn checked mode on (or off with enabled=False) inside the block."""
    global _depth, _from_env
    saved = (_depth, _from_env)
    if enabled:
        _depth += 1
    else:
        _depth, _from_env = 0, False
    try:
        yield
    finally:
        _depth, _from_env = saved


def is_checked() -> bool:
    return _depth > 0 or _from_env


@dataclasses.dataclass
class Call:
    """What this rank is about to do; the fingerprint and the human-readable form of it."""

    collective: str
    info: GroupInfo
    sequence: int
    tensor: Optional[torch.Tensor] = None
    op: Optional[str] = None
    root: Optional[int] = None
    error: Optional[str] = None  # this rank's local check failure, if any

    def encode(self) -> List[int]:
        fp = [0] * SLOTS
        fp[0] = COLLECTIVES.index(self.collective)
        fp[1] = OP_NAMES.index(self.op) + 1 if self.op else 0
        fp[4] = -1 if self.root is None else self.root
        fp[5] = zlib.crc32(repr(self.info.ranks).encode())
        fp[6] = self.sequence
        fp[7] = 1 if self.error else 0
        t = self.tensor
        if isinstance(t, torch.Tensor):
            fp[2] = DTYPES.index(t.dtype) + 1
            fp[3] = DEVICE_TYPES.index(t.device.type) + 1 if t.device.type in DEVICE_TYPES else 99
            shape = list(t.shape)
            if self.collective in DIM0_FREE and shape:
                shape[0] = -2  # ranks may differ here
            fp[8] = len(shape)
            for i, d in enumerate(shape[:MAX_DIMS]):
                fp[9 + i] = d
            fp[15] = zlib.crc32(repr(shape[MAX_DIMS:]).encode())
        return fp

    def describe(self) -> str:
        parts = []
        t = self.tensor
        if isinstance(t, torch.Tensor):
            parts += [f"shape={tuple(t.shape)}", f"dtype={t.dtype}", f"device={t.device.type}"]
        if self.op:
            parts.append(f"op={self.op}")
        if self.root is not None:
            parts.append(f"{'src' if self.collective in ('broadcast', 'scatter') else 'dst'}={self.root}")
        parts.append(f"call #{self.sequence} on group {list(self.info.ranks)}")
        text = f"{self.collective}({', '.join(parts)})"
        return text + (f"  <- failed its local check: {self.error}" if self.error else "")


_FIELDS = {0: "collective", 1: "op", 2: "dtype", 3: "device", 4: "src/dst", 5: "group", 6: "call number"}


def _exchange_device(info: GroupInfo) -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if info.backend == "nccl" else torch.device("cpu")


def verify(call: Call) -> None:
    """Exchange fingerprints with the group; raise on every rank if any rank differs or failed."""
    info = call.info
    mine = torch.tensor(call.encode(), dtype=torch.int64, device=_exchange_device(info))
    everyone = torch.empty(info.size * SLOTS, dtype=torch.int64, device=mine.device)
    compat.all_gather_single(everyone, mine, group=info.group)
    rows = everyone.view(info.size, SLOTS).tolist()  # (group size, SLOTS)
    failed = [info.ranks[i] for i, row in enumerate(rows) if row[7]]
    differing = sorted(
        {_FIELDS.get(s, "shape") for s in range(SLOTS) if s != 7 and len({row[s] for row in rows}) > 1}
    )
    if not failed and not differing:
        return
    # The error path may be slow: gather every rank's readable description (sizes may differ).
    described: List[Optional[str]] = [None] * info.size
    dist.all_gather_object(described, call.describe(), group=info.group)
    lines = "\n".join(f"  rank {info.ranks[i]}: {text}" for i, text in enumerate(described))
    if failed:
        raise CollectiveError(
            f"checked mode: {call.collective} was refused because rank(s) {failed} failed a local check; "
            f"no rank entered the collective:\n{lines}"
        )
    raise CollectiveMismatchError(
        f"checked mode: the ranks of group {list(info.ranks)} disagree on {call.collective} "
        f"(call #{call.sequence}): {', '.join(differing)} differ(s):\n{lines}"
    )
