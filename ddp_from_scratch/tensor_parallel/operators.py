"""Megatron's two operators, f and g, as autograd functions on the project's collectives: the whole
of tensor parallelism's communication in a block is these two (and, with sequence parallelism,
their all_gather / reduce_scatter forms).

    x = f(x, group)   # forward: identity;    backward: all_reduce the gradient over the group
    y = g(y, group)   # forward: all_reduce;  backward: identity

Where they sit in an MLP split over the TP group (Megatron-LM, Shoeybi et al. 2019, figure 3):

    x ──f──> [X W1_r] ──gelu──> [. W2_r] ──g──> y        W1 split by columns, W2 by rows
             (rank r's columns)  (rank r's rows: a partial sum of y)

Every rank holds the whole x. The column-parallel layer needs no communication forward (each rank
makes its own columns of X W1) but its input's gradient is a sum over ranks (each rank's columns
contribute to every element of dL/dx): f's backward all-reduces it. The row-parallel layer leaves
each rank a partial sum of y: g's forward all-reduces it; y's gradient is whole on every rank, so
g's backward passes it on. Two all_reduces of batch x sequence x hidden elements per block
forward (attention and MLP: one g each), two backward (one f each).

Sequence parallelism (Korthikanti et al. 2022) keeps the activations between blocks split along
the sequence instead of whole: g becomes a reduce_scatter along the sequence (each rank keeps its
slice of the sum) and f an all_gather (each block needs the whole sequence), with the roles
swapped backward. A reduce_scatter plus an all_gather move the bytes of one all_reduce.

    x_whole = gather_sequence(x_slice, group)     # forward: all_gather;     backward: reduce_scatter
    y_slice = scatter_sequence(y_partial, group)  # forward: reduce_scatter; backward: all_gather

The sequence is dim 1 of a (batch, sequence, hidden) tensor. Each call counts what it moved in
`MESSAGES` (a list of (collective, elements)) when counting is on, for the closed-form checks.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import List, Optional, Tuple

import torch

import collectives as C

MESSAGES: Optional[List[Tuple[str, int]]] = None


@contextmanager
def counting():
    """Record every collective f, g and the sequence operators issue, as (name, elements)."""
    global MESSAGES
    saved, MESSAGES = MESSAGES, []
    try:
        yield MESSAGES
    finally:
        MESSAGES = saved


def note_message(name: str, t: torch.Tensor) -> None:
    if MESSAGES is not None:
        MESSAGES.append((name, t.numel()))


def all_reduced(t: torch.Tensor, group, op: str = "sum") -> torch.Tensor:
    """A reduced copy of `t` over the group (t itself is left as it is), counted."""
    out = t.contiguous().clone()
    note_message("all_reduce", out)
    C.all_reduce(out, op=op, group=group)
    return out


def _all_gather_seq(t: torch.Tensor, group) -> torch.Tensor:
    """(b, s/p, h) on every rank -> (b, s, h), rank order along the sequence."""
    note_message("all_gather", t)
    rows = C.all_gather(t.transpose(0, 1).contiguous(), group=group)  # sequence first: gathered on dim 0
    return rows.transpose(0, 1).contiguous()


def _reduce_scatter_seq(t: torch.Tensor, group) -> torch.Tensor:
    """(b, s, h) partial sums -> this rank's (b, s/p, h) slice of the sum."""
    note_message("reduce_scatter", t)
    mine = C.reduce_scatter(t.transpose(0, 1).contiguous(), group=group)
    return mine.transpose(0, 1).contiguous()


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return all_reduced(grad, ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return all_reduced(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_gather_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter_seq(grad, ctx.group), None


class _ScatterSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather_seq(grad, ctx.group), None


def f(x: torch.Tensor, group) -> torch.Tensor:
    """Identity forward; all_reduce of the gradient backward (before a column-parallel layer)."""
    return _CopyToTP.apply(x, group)


def g(x: torch.Tensor, group) -> torch.Tensor:
    """all_reduce forward; identity backward (after a row-parallel layer)."""
    return _ReduceFromTP.apply(x, group)


def gather_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """Sequence parallelism's f: all_gather along the sequence forward, reduce_scatter backward."""
    return _GatherSequence.apply(x, group)


def scatter_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """Sequence parallelism's g: reduce_scatter along the sequence forward, all_gather backward."""
    return _ScatterSequence.apply(x, group)
