"""A transformer's MLP block (Linear h -> 4h, GELU, Linear 4h -> h) split over a TP group, made
from the one-rank block so both start from the same weights.

    mlp = TensorParallelMLP(one_rank_mlp, group)                       # x: (batch, seq, h) on every rank
    mlp = TensorParallelMLP(one_rank_mlp, group, sequence_parallel=True)  # x: (batch, seq / p, h), this rank's slice

Without sequence parallelism: f, the column-parallel up-projection, GELU on this rank's 4h / p
features, the row-parallel down-projection, g: one all_reduce of batch x seq x h elements
forward, one backward. With it, the input and output are this rank's slice of the sequence: an
all_gather of the slices replaces f, a reduce_scatter replaces g, and the bias of the
down-projection is added to the slice; the same bytes as the all_reduce, and the activations
outside the block (LayerNorm, dropout, the residual) are 1/p the size.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .layers import ColumnParallelLinear, RowParallelLinear
from .operators import gather_sequence, scatter_sequence


class TensorParallelMLP(nn.Module):
    def __init__(self, full: nn.Sequential, group, sequence_parallel: bool = False, bias_in_partial_sums: bool = False):
        super().__init__()
        up, act, down = full
        if not isinstance(act, nn.GELU):
            raise ValueError(f"TensorParallelMLP takes Linear, GELU, Linear; its activation is {type(act).__name__}")
        self.group, self.sequence_parallel = group, sequence_parallel
        self.up = ColumnParallelLinear(up, group, name="the MLP's up-projection")
        self.down = RowParallelLinear(down, group, name="the MLP's down-projection",
                                      bias_in_partial_sums=bias_in_partial_sums)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.sequence_parallel:
            return self.down(F.gelu(self.up(x)))
        whole = gather_sequence(x, self.group)                     # (b, s, h) on every rank
        hidden = F.gelu(F.linear(whole, self.up.weight, self.up.bias))  # this rank's 4h / p features
        partial = self.down.partial_sum(hidden)                    # a partial sum over features
        return self.down.add_bias(scatter_sequence(partial, self.group))  # this rank's slice of the sum


def one_rank_mlp(hidden: int, seed: int = 0, ffn: int = 0) -> nn.Sequential:
    """The block every rank builds identically (the same seed) before splitting it; its inner
    size is `ffn` (default 4 x hidden)."""
    torch.manual_seed(seed)
    ffn = ffn or 4 * hidden
    return nn.Sequential(nn.Linear(hidden, ffn), nn.GELU(), nn.Linear(ffn, hidden))
