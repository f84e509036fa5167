"""A column-parallel and a row-parallel Linear, each made from a whole nn.Linear (the one-rank
model's, so both start from the same weights), keeping this rank's shard.

    up = ColumnParallelLinear(nn.Linear(h, 4 * h), group)    # rank r: out-features [r*4h/p, (r+1)*4h/p)
    down = RowParallelLinear(nn.Linear(4 * h, h), group)     # rank r: in-features, the same range
    y = down(gelu(up(x)))                                     # one all_reduce forward, one backward

Column-parallel: weight rows (output features) split over the TP group, bias split the same way;
the input is whole on every rank and goes through f (operators.py) first; the output is this
rank's columns of the result. Row-parallel: weight columns (input features) split, so it takes
the column-parallel layer's output as it is; each rank's product is a partial sum over its input
features, and g all-reduces it; the bias is whole and added once, after the sum (Megatron's
order: every rank adds the same bias to the same sum, so every rank holds the same bits).
torch's RowwiseParallel adds it otherwise: its DTensor turns the replicated bias into a partial
one by dividing it by the TP size, each rank adds bias / p to its partial sum, and the all_reduce
sums those. `bias_in_partial_sums=True` takes torch's order, bit for bit; the two orders differ
in the last bits of y (one rounding of b / p per rank, and the bias added before the sum
instead of after: tests/tensor_parallel/test_tensor_parallel.py bounds it).

A feature count that the TP size does not divide is refused, naming the layer and both numbers.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .operators import f, g


def tp_size_and_rank(group) -> tuple:
    return dist.get_world_size(group), dist.get_rank(group)


def split_size(n: int, p: int, what: str) -> int:
    if n % p:
        raise ValueError(f"{what} is {n}, which the tensor-parallel size {p} does not divide: "
                         f"choose a size that is a multiple of {p}")
    return n // p


class ColumnParallelLinear(nn.Module):
    """Y_r = X W_r^T + b_r: this rank's output features of `full`."""

    def __init__(self, full: nn.Linear, group, name: str = "ColumnParallelLinear"):
        super().__init__()
        p, r = tp_size_and_rank(group)
        k = split_size(full.out_features, p, f"{name}'s out_features")
        self.group = group
        self.weight = nn.Parameter(full.weight.detach()[r * k:(r + 1) * k].clone())
        self.bias = nn.Parameter(full.bias.detach()[r * k:(r + 1) * k].clone()) if full.bias is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(f(x, self.group), self.weight, self.bias)


class _PartialBias(torch.autograd.Function):
    """b / p forward (each rank's share of a bias added inside the partial sums); the gradient
    passes whole backward: the bias is replicated, and the sum it enters counts it once."""

    @staticmethod
    def forward(ctx, bias, size):
        return bias / size

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class RowParallelLinear(nn.Module):
    """Y = sum_r X_r W_r^T + b: the input arrives split by features (a column-parallel layer's output)."""

    def __init__(self, full: nn.Linear, group, name: str = "RowParallelLinear", bias_in_partial_sums: bool = False):
        super().__init__()
        p, r = tp_size_and_rank(group)
        k = split_size(full.in_features, p, f"{name}'s in_features")
        self.group, self.size, self.bias_in_partial_sums = group, p, bias_in_partial_sums
        self.weight = nn.Parameter(full.weight.detach()[:, r * k:(r + 1) * k].clone())
        self.bias = nn.Parameter(full.bias.detach().clone()) if full.bias is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.add_bias(g(self.partial_sum(x), self.group))

    def partial_sum(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's term of the sum, before g (or, with sequence parallelism, a reduce_scatter)."""
        if self.bias_in_partial_sums and self.bias is not None:  # torch's RowwiseParallel: b / p in each partial sum
            return F.linear(x, self.weight, _PartialBias.apply(self.bias, self.size))
        return F.linear(x, self.weight)

    def add_bias(self, summed: torch.Tensor) -> torch.Tensor:
        """The bias once, after the sum (Megatron's order), unless it went into the partial sums."""
        if self.bias is None or self.bias_in_partial_sums:
            return summed
        return summed + self.bias

    def bias_needs_all_reduce(self) -> bool:
        """With sequence parallelism the bias added after the reduce_scatter gets a gradient from
        this rank's slice only; one added inside the partial sums gets the whole sequence's."""
        return self.bias is not None and not self.bias_in_partial_sums
