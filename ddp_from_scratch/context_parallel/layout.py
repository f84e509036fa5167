"""How a sequence is cut over the ranks of a context-parallel group, and back.

    local = shard(x, rank, size, balanced=True, dim=2)     # this rank's tokens of x
    whole = unshard([local_0, local_1, ...], balanced=True, dim=2)
    positions(seq=16, rank=1, size=2, balanced=True)       # [4, 5, 6, 7, 8, 9, 10, 11]

Contiguous (balanced=False): rank r holds the r-th of N equal pieces. Under a causal mask a query
attends to the keys before it, so rank 0's queries need only rank 0's keys and the last rank's
need everybody's: the last rank does N times rank 0's work.

Head-tail (balanced=True, the zigzag layout torch's context_parallel uses when load balance is
on): the sequence is cut into 2N pieces and rank r holds piece r and piece 2N - 1 - r, one from
the head and one from the tail, so every rank does the same work:

    N = 2, pieces 0 1 2 3:    rank 0: 0 3    rank 1: 1 2

A rank's tokens are not consecutive then; `positions` says where each one sits in the whole
sequence, which is what a model's position embedding needs.
"""

from __future__ import annotations

from typing import List

import torch


def _check(seq: int, size: int, balanced: bool) -> None:
    pieces = 2 * size if balanced else size
    if seq % pieces:
        raise ValueError(f"a sequence of {seq} tokens does not cut into {pieces} equal pieces "
                         f"({'2 x ' if balanced else ''}{size} ranks{', head and tail' if balanced else ''}): "
                         f"use a multiple of {pieces}")


def shard(x: torch.Tensor, rank: int, size: int, balanced: bool, dim: int) -> torch.Tensor:
    """This rank's tokens of x along `dim` (contiguous in memory)."""
    _check(x.shape[dim], size, balanced)
    if not balanced:
        return x.chunk(size, dim=dim)[rank].contiguous()
    pieces = x.chunk(2 * size, dim=dim)
    return torch.cat([pieces[rank], pieces[2 * size - 1 - rank]], dim=dim)


def unshard(parts: List[torch.Tensor], balanced: bool, dim: int) -> torch.Tensor:
    """The whole sequence from every rank's part, in rank order."""
    if not balanced:
        return torch.cat(parts, dim=dim)
    heads = [p.chunk(2, dim=dim)[0] for p in parts]
    tails = [p.chunk(2, dim=dim)[1] for p in parts]
    return torch.cat(heads + tails[::-1], dim=dim)


def positions(seq: int, rank: int, size: int, balanced: bool) -> torch.Tensor:
    """The global positions of this rank's tokens, in the order it holds them."""
    return shard(torch.arange(seq), rank, size, balanced, dim=0)


def work(seq: int, rank: int, size: int, balanced: bool) -> int:
    """The query-key pairs this rank's queries attend to under a causal mask (its compute)."""
    mine = positions(seq, rank, size, balanced)
    return int((mine + 1).sum())
