"""What each collective must produce, computed locally from every rank's flat input.

    expected("reduce_scatter", inputs, op="sum", root=0) -> one flat tensor (or None) per rank
"""

import functools

import torch

from collectives import reduce_ops
from collectives.chunks import bounds


def reduced(inputs, op: str) -> torch.Tensor:
    return functools.reduce(lambda a, b: reduce_ops.fold(op, [a, b]), inputs)


def expected(collective: str, inputs, op: str = "sum", root: int = 0):
    p = len(inputs)
    if collective == "all_reduce":
        return [reduced(inputs, op)] * p
    if collective == "reduce":
        return [reduced(inputs, op) if r == root else None for r in range(p)]
    if collective == "broadcast":
        return [inputs[root]] * p
    if collective == "reduce_scatter":
        whole = reduced(inputs, op)
        return [whole[a:b] for a, b in bounds(whole.numel(), p)]
    if collective == "all_gather":
        return [torch.cat(inputs)] * p
    if collective == "gather":
        return [torch.cat(inputs) if r == root else None for r in range(p)]
    if collective == "scatter":
        return [inputs[root][a:b] for a, b in bounds(inputs[root].numel(), p)]
    if collective == "all_to_all":
        block = inputs[0].numel() // p
        return [torch.cat([x[r * block:(r + 1) * block] for x in inputs]) for r in range(p)]
    raise ValueError(collective)


def inputs_for(collective: str, p: int, numel: int, dtype=torch.int64, seed: int = 0, op: str = "sum"):
    """Small integers (exact in any order), or bit patterns for the bitwise ops; all_to_all gets
    p equal blocks."""
    if collective == "all_to_all":
        numel = p * max(1, numel // p)
    g = torch.Generator().manual_seed(seed)
    if op in ("band", "bor", "bxor"):
        return [torch.randint(0, 1 << 20, (numel,), generator=g).to(dtype) for _ in range(p)]
    low, high = (1, 3) if op == "product" else (-9, 10)
    return [torch.randint(low, high, (numel,), generator=g).to(dtype) for _ in range(p)]
