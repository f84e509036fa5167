"""The small metadata exchange that some wrappers run before their data collective.

all_gather and gather allow a different first dimension on each rank, and scatter lets the
ranks other than src pass None (as torch users write it), so these need every rank's shape
before any data moves. One all_gather of 16 int64s per call carries, for each rank: whether its
own local checks failed, whether it passed a tensor, its dtype, its shape and its src/dst. With
that in hand every rank can refuse the same bad call in the same way, before the data
collective (which Gloo would abort on, or wait in forever):

- a rank whose local check failed: every rank raises, quoting that rank's own message;
- trailing dimensions or dtypes that differ (all_gather, gather), or a tensor that is not
  shaped like src's (scatter): every rank raises `CollectiveMismatchError` naming the ranks;
- src/dst that differ between ranks: the same.

    rows = exchange(info, tensor, root, error)     # one row per group rank
    raise_if_any_failed(info, rows, error, "gather")
"""

from __future__ import annotations

import dataclasses
import zlib
from typing import List, Optional, Sequence

import torch
import torch.distributed as dist

from . import compat
from .checked_mode import DTYPES
from .checks import GroupInfo
from .errors import CollectiveError, CollectiveMismatchError

SLOTS = 16
MAX_DIMS = 10  # dims beyond these are carried as a checksum


@dataclasses.dataclass
class Row:
    """One rank's view of the call."""

    failed: bool
    has_tensor: bool
    dtype: Optional[torch.dtype]
    shape: Optional[tuple]  # None without a tensor; dims past MAX_DIMS are not recoverable
    root: int
    tail_checksum: int

    def describe(self) -> str:
        if not self.has_tensor:
            return "no tensor (None)"
        return f"shape={self.shape}, dtype={self.dtype}"


def _encode(tensor, root: Optional[int], failed: bool) -> List[int]:
    row = [0] * SLOTS
    row[0] = int(failed)
    row[4] = -1 if root is None or not isinstance(root, int) else root
    if isinstance(tensor, torch.Tensor):
        shape = list(tensor.shape)
        row[1] = 1
        row[2] = DTYPES.index(tensor.dtype)
        row[3] = len(shape)
        for i, d in enumerate(shape[:MAX_DIMS]):
            row[5 + i] = d
        row[15] = zlib.crc32(repr(shape[MAX_DIMS:]).encode())
    return row


def _decode(row: Sequence[int]) -> Row:
    has = bool(row[1])
    ndim = row[3]
    shape = tuple(row[5:5 + min(ndim, MAX_DIMS)]) + (("...",) if ndim > MAX_DIMS else ()) if has else None
    return Row(bool(row[0]), has, DTYPES[row[2]] if has else None, shape, row[4], row[15])


def exchange(info: GroupInfo, tensor, root: Optional[int], error: Optional[str]) -> List[Row]:
    """Every group rank's Row, in group-rank order (one small all_gather)."""
    device = torch.device("cuda", torch.cuda.current_device()) if info.backend == "nccl" else torch.device("cpu")
    mine = torch.tensor(_encode(tensor, root, error is not None), dtype=torch.int64, device=device)
    everyone = torch.empty(info.size * SLOTS, dtype=torch.int64, device=device)
    compat.all_gather_single(everyone, mine, group=info.group)
    return [_decode(r) for r in everyone.view(info.size, SLOTS).tolist()]  # (group size, SLOTS)


def raise_if_any_failed(info: GroupInfo, rows: List[Row], error: Optional[str], collective: str) -> None:
    """If any rank's local check failed, raise on every rank, quoting each failing rank's message."""
    failed = [info.ranks[i] for i, row in enumerate(rows) if row.failed]
    if not failed:
        return
    messages: List[Optional[str]] = [None] * info.size
    dist.all_gather_object(messages, error, group=info.group)  # only on this error path
    lines = "\n".join(f"  rank {info.ranks[i]}: {m}" for i, m in enumerate(messages) if m)
    raise CollectiveError(f"{collective}: rank(s) {failed} failed a local check, so no rank entered the "
                          f"collective:\n{lines}")


def describe_rows(info: GroupInfo, rows: List[Row]) -> str:
    return "\n".join(f"  rank {info.ranks[i]}: {row.describe()}" for i, row in enumerate(rows))


def check_same_root(info: GroupInfo, rows: List[Row], collective: str, kind: str) -> None:
    roots = {row.root for row in rows}
    if len(roots) > 1:
        lines = "\n".join(f"  rank {info.ranks[i]}: {kind}={row.root}" for i, row in enumerate(rows))
        raise CollectiveMismatchError(f"{collective}: the ranks passed different {kind}:\n{lines}")
