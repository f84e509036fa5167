"""The exchange at the heart of expert parallelism: each expert's rows to the rank that holds it,
and its outputs back, by two all_to_alls with uneven splits that change every step.

    mine, sent = dispatch(rows, counts, group)     # rows sorted by expert; counts: (E,) per expert
    out = run_experts(local_experts, mine, sent.local_counts)
    back = combine_back(out, sent)                 # the outputs, in the order `rows` was sent

With E experts over N ranks, rank j holds experts j x E/N ... (j + 1) x E/N - 1, so rows sorted
by expert are already sorted by destination. One step:

    1. counts   all_to_all of the (E,) counts: rank j learns, from each rank i, how many rows i
                sends each of j's experts, (N, E/N); summed per source, the output splits
    2. rows     all_to_all with uneven splits: rank i's rows for rank j's experts go to j; they
                arrive source-major (all of rank 0's rows, then rank 1's, ...)
    3. regroup  expert-major: each local expert's rows from rank 0, rank 1, ... consecutive, the
                order the one-rank layer gives it (its rows in token order, the ranks' tokens
                being the global tokens in rank order)
    back:       the inverse permutation, then the reverse all_to_all (splits swapped)

Backward is the same exchange reversed: the gradient of a sent row comes back by the all_to_all
with the splits swapped (_AllToAll), and the regrouping is a permutation. Both all_to_alls go
through collectives.all_to_all's uneven form, which checks the splits on every rank first.
"""

from __future__ import annotations

import dataclasses
from typing import List

import torch
import torch.distributed as dist

import collectives as C


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows: torch.Tensor, send: List[int], recv: List[int], group) -> torch.Tensor:
        ctx.send, ctx.recv, ctx.group = send, recv, group
        return C.all_to_all(rows, group=group, input_split_sizes=send, output_split_sizes=recv)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return C.all_to_all(grad.contiguous(), group=ctx.group, input_split_sizes=ctx.recv,
                            output_split_sizes=ctx.send), None, None, None


@dataclasses.dataclass
class Sent:
    """What one dispatch moved, to send the outputs back."""

    send: List[int]  # rows to each rank
    recv: List[int]  # rows from each rank
    local_counts: List[int]  # rows for each local expert, after regrouping
    regroup: torch.Tensor  # expert-major row i is source-major row regroup[i]
    group: object

    def sent_elsewhere(self, rank: int) -> int:
        """Rows that left this rank (its own rows to its own experts do not travel)."""
        return sum(self.send) - self.send[rank]


def dispatch(rows: torch.Tensor, counts: torch.Tensor, group) -> tuple:
    """(this rank's experts' rows, expert-major; Sent) for `rows` sorted by expert with
    counts[e] rows for expert e (every expert of the layer, E divisible by the group size)."""
    n = dist.get_world_size(group)
    per_rank = counts.view(n, -1)  # (N, E/N): rows for rank j's experts
    received = C.all_to_all(counts.contiguous(), group=group).view(n, -1)  # (N sources, E/N local experts)
    send, recv = per_rank.sum(dim=1).tolist(), received.sum(dim=1).tolist()
    arrived = _AllToAll.apply(rows, send, recv, group)  # source-major
    starts = torch.cumsum(received.reshape(-1), 0) - received.reshape(-1)
    starts, sizes = starts.view_as(received), received
    regroup = torch.cat([torch.arange(int(starts[i, e]), int(starts[i, e] + sizes[i, e]))
                         for e in range(received.shape[1]) for i in range(n)])
    return arrived.index_select(0, regroup), Sent(send, recv, received.sum(dim=0).tolist(), regroup, group)


def combine_back(out: torch.Tensor, sent: Sent) -> torch.Tensor:
    """The experts' outputs (expert-major) back to the ranks their rows came from, in the order
    each rank sent them."""
    source_major = out.new_zeros(out.shape).index_copy(0, sent.regroup, out)
    return _AllToAll.apply(source_major, sent.recv, sent.send, sent.group)
