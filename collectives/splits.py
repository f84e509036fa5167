"""all_to_all's uneven splits, checked on every rank before any row moves.

With uneven splits each rank says how many rows it sends every other rank (input_split_sizes),
and may say how many it expects from each (output_split_sizes). The two must agree pairwise:
what rank i sends rank j is what rank j expects from rank i. Gloo aborts the process when they do
not, so before the data collective every rank sends one row of fixed size,

    [failed, dtype, ndim, trailing shape's checksum, sends to 0..N-1, expects from 0..N-1 (or -1)]

in one all_gather (the same size on every rank, so it cannot abort), and every rank then refuses
the same bad call in the same words, naming the ranks:

    rows = splits.agree(info, tensor, input_split_sizes, output_split_sizes, error)  # rows from each rank

The rows a rank receives are learned from the same exchange when it did not give them.
"""

from __future__ import annotations

import zlib
from typing import List, Optional, Sequence

import torch
import torch.distributed as dist

from . import compat
from .checked_mode import DTYPES
from .checks import GroupInfo
from .errors import CollectiveError, CollectiveMismatchError

HEAD = 4  # failed, dtype, ndim, trailing shape's checksum


def local_error(tensor: torch.Tensor, info: GroupInfo, sends: Optional[Sequence[int]],
                expects: Optional[Sequence[int]]) -> Optional[str]:
    """What is wrong with this rank's own splits, or None."""
    if sends is None:
        return ("all_to_all: output_split_sizes without input_split_sizes; give input_split_sizes (the rows this "
                "rank sends each rank, summing to dim 0)")
    if tensor.dim() == 0:
        return "all_to_all: uneven splits need a tensor with a first dimension to split, got a 0-d tensor"
    for name, given in (("input_split_sizes", sends), ("output_split_sizes", expects)):
        if given is None:
            continue
        given = list(given)
        if len(given) != info.size:
            return f"all_to_all: {name} has {len(given)} entries for a group of {info.size} ranks: give one per rank"
        if any(not isinstance(n, int) or isinstance(n, bool) or n < 0 for n in given):
            return f"all_to_all: {name} {given} must be whole numbers of rows, 0 or more"
    if sum(sends) != tensor.shape[0]:
        return (f"all_to_all: input_split_sizes {list(sends)} add up to {sum(sends)} rows, but the tensor has "
                f"{tensor.shape[0]} (dim 0 of shape {tuple(tensor.shape)})")
    return None


def _row(tensor: torch.Tensor, size: int, sends, expects, failed: bool) -> List[int]:
    row = [int(failed), DTYPES.index(tensor.dtype), tensor.dim(), zlib.crc32(repr(tuple(tensor.shape[1:])).encode())]
    fine = not failed
    row += list(sends) if fine else [0] * size
    row += list(expects) if fine and expects is not None else [-1] * size
    return row


def agree(info: GroupInfo, tensor: torch.Tensor, sends, expects, error: Optional[str]) -> List[int]:
    """The rows this rank receives from each group rank, once every rank's splits agree; raises the
    same error on every rank otherwise (a rank's own error, dtypes or trailing shapes that differ,
    or a pair of ranks whose splits do not match)."""
    n = info.size
    device = torch.device("cuda", torch.cuda.current_device()) if info.backend == "nccl" else torch.device("cpu")
    mine = torch.tensor(_row(tensor, n, sends, expects, error is not None), dtype=torch.int64, device=device)
    everyone = torch.empty(n * (HEAD + 2 * n), dtype=torch.int64, device=device)
    compat.all_gather_single(everyone, mine, group=info.group)
    rows = everyone.view(n, HEAD + 2 * n).tolist()
    failed = [info.ranks[i] for i, row in enumerate(rows) if row[0]]
    if failed:
        messages: List[Optional[str]] = [None] * n
        dist.all_gather_object(messages, error, group=info.group)  # only on this error path
        lines = "\n".join(f"  rank {info.ranks[i]}: {m}" for i, m in enumerate(messages) if m)
        raise CollectiveError(f"all_to_all: rank(s) {failed} failed a local check, so no rank entered the "
                              f"collective:\n{lines}")
    if len({(row[1], row[2], row[3]) for row in rows}) > 1:
        raise CollectiveMismatchError(
            "all_to_all: the ranks' rows must have the same dtype and trailing dimensions (only the row counts may "
            "differ), but they differ:\n" + "\n".join(
                f"  rank {info.ranks[i]}: {DTYPES[row[1]]}, {row[2]}-d" for i, row in enumerate(rows))
            + f"\n  (this rank, {info.global_rank}: {tensor.dtype}, shape {tuple(tensor.shape)})")
    sent = [row[HEAD:HEAD + n] for row in rows]  # sent[i][j]: what rank i sends rank j
    wrong = [(i, j, sent[i][j], rows[j][HEAD + n + i]) for i in range(n) for j in range(n)
             if rows[j][HEAD + n + i] >= 0 and rows[j][HEAD + n + i] != sent[i][j]]
    if wrong:
        raise CollectiveMismatchError("all_to_all: the splits do not match between ranks:\n" + "\n".join(
            f"  rank {info.ranks[i]} sends {k} row(s) to rank {info.ranks[j]}, which expects {m} (its "
            f"output_split_sizes[{i}])" for i, j, k, m in wrong[:8]) + (f"\n  ... {len(wrong) - 8} more" if len(wrong) > 8
                                                                       else ""))
    return [sent[i][info.group_rank] for i in range(n)]
