"""A transformer's self-attention block split over a TP group by heads, made from the one-rank
block so both start from the same weights.

    attn = TensorParallelAttention(one_rank_attention(hidden, heads), group)   # x: (batch, seq, hidden)

Each rank keeps heads / p of the heads: the rows of the q, k and v projections that make them
(column-parallel: output features r * h/p to (r + 1) * h/p), attention over those heads alone
(no head needs another's), and the matching columns of the output projection (row-parallel), whose
partial sums g all-reduces. f sits once on the input, before the three projections, so the
input's gradient (a sum over q, k and v and over ranks) is all-reduced once: one all_reduce of
batch x seq x hidden elements forward and one backward, as the MLP block; two of each per
transformer block, Megatron's closed form.

With sequence_parallel=True the input and output are this rank's slice of the sequence: an
all_gather of the slices replaces f, a reduce_scatter replaces g, as in the MLP block (mlp.py).

A head count the TP size does not divide, or a hidden size the head count does not divide, is
refused, naming both numbers.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..workload.transformer import Attention, attend
from .layers import ColumnParallelLinear, RowParallelLinear
from .operators import f, gather_sequence, scatter_sequence


def one_rank_attention(hidden: int, heads: int, seed: int = 0) -> Attention:
    torch.manual_seed(seed)
    return Attention(hidden, heads)


class TensorParallelAttention(nn.Module):
    def __init__(self, full: Attention, group, bias_in_partial_sums: bool = False, sequence_parallel: bool = False):
        super().__init__()
        p = dist.get_world_size(group)
        if full.heads % p:
            raise ValueError(f"the attention's {full.heads} heads do not split over the tensor-parallel size {p}: "
                             f"choose a head count that is a multiple of {p}")
        self.group, self.heads, self.sequence_parallel = group, full.heads // p, sequence_parallel
        self.q, self.k, self.v = (ColumnParallelLinear(lin, group, name=f"the attention's {n} projection")
                                  for n, lin in (("q", full.q), ("k", full.k), ("v", full.v)))
        self.out = RowParallelLinear(full.out, group, name="the attention's output projection",
                                     bias_in_partial_sums=bias_in_partial_sums)
        self.attend = attend  # this rank's heads, over the whole sequence (or a ring of its pieces)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:  # x: this rank's slice of the sequence; so is the result
            x = gather_sequence(x, self.group)
        else:
            x = f(x, self.group)  # once for the three projections: one all_reduce of the input's gradient
        q, k, v = (F.linear(x, lin.weight, lin.bias) for lin in (self.q, self.k, self.v))
        y = self.attend(q, k, v, self.heads)
        if not self.sequence_parallel:
            return self.out(y)
        return self.out.add_bias(scatter_sequence(self.out.partial_sum(y), self.group))
