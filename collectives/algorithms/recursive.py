"""Recursive doubling and halving, and Rabenseifner's all-reduce built from the two.

Recursive doubling (all-reduce): in step k every rank swaps its whole buffer with the rank
whose number differs in bit k, and both add. After lg p steps everyone has the sum:

    step 0:  0 <-> 1   2 <-> 3        (each pair now holds r0+r1, r2+r3)
    step 1:  0 <-> 2   1 <-> 3        (everyone holds r0+r1+r2+r3)

Recursive halving (reduce-scatter): the same partners in the opposite order of distance, but
each rank sends only the half of its current range that the partner keeps, and adds the half it
keeps: 0 keeps chunks 0-1 and sends 2-3 to rank 2, and so on; after lg p steps rank r holds
chunk r reduced. Recursive doubling (all-gather) runs that in reverse: ranges double instead
of halve.

Rabenseifner's all-reduce = recursive-halving reduce-scatter + recursive-doubling all-gather;
his reduce = recursive-halving reduce-scatter + a binomial gather to the root.

A world that is not a power of two is folded first (fold.Fold): the first 2(p' - p) ranks
pair up and the even one hands its data to the odd one, which acts for both.

Costs (alpha per message, beta per byte sent, gamma per byte reduced, n bytes, p ranks, powers
of two; a fold adds about 2 (alpha + n beta)):
    recursive doubling all-reduce    lg p (alpha + n beta + n gamma)
    recursive halving reduce-scatter lg p alpha + (p-1)/p n beta + (p-1)/p n gamma
    recursive doubling all-gather    lg p alpha + (p-1)/p n beta
    Rabenseifner all-reduce          2 lg p alpha + 2 (p-1)/p n beta + (p-1)/p n gamma
Few messages (lg p), so these win on small buffers; recursive doubling all-reduce sends the
whole buffer lg p times, so it loses on large ones, where Rabenseifner and the ring win.
"""

from __future__ import annotations

import torch

from . import tree
from ..chunks import bounds
from .fold import Fold


def _fold_in(comm, buf, op, fold: Fold, tmp):
    """The even rank of each folded pair gives its buffer to the odd one, which reduces it."""
    partner = fold.partner(comm.rank)
    if partner is None:
        return
    if fold.sits_out(comm.rank):
        yield (comm.send(buf, partner, chunk="fold"),)
    else:
        yield (comm.recv(tmp, partner, chunk="fold"),)
        comm.reduce(buf, tmp, op)


def _fold_out(comm, buf, fold: Fold, start: int = 0, end: int = None):
    """The odd rank of each folded pair hands buf[start:end] back to the even one."""
    partner = fold.partner(comm.rank)
    if partner is None or end == start:
        return
    part = buf[start:end]
    yield ((comm.recv if fold.sits_out(comm.rank) else comm.send)(part, partner, chunk="unfold"),)


def _owned(fold: Fold, chunks):
    """Each virtual rank's element range: the chunks of the real ranks it acts for."""
    return [(chunks[fold.members(v)[0]][0], chunks[fold.members(v)[-1]][1]) for v in range(fold.p)]


def _span(ranges, first_virtual: int, last_virtual: int):
    """Element range covering the ranges of virtual ranks first..last (inclusive)."""
    return ranges[first_virtual][0], ranges[last_virtual][1]


def all_reduce_doubling(comm, buf: torch.Tensor, op: str):
    """Recursive doubling all-reduce (see the module docstring)."""
    fold, tmp = Fold(comm.size), comm.workspace(buf, buf.numel())
    yield from _fold_in(comm, buf, op, fold, tmp)
    if not fold.sits_out(comm.rank):
        v, distance = fold.virtual(comm.rank), 1
        while distance < fold.p:
            peer = fold.real(v ^ distance)
            yield comm.send(buf, peer, chunk=f"all/{distance}"), comm.recv(tmp, peer, chunk=f"all/{distance}")
            comm.reduce(buf, tmp, op)  # a op b on one side, b op a on the other: the same bits
            distance <<= 1
    yield from _fold_out(comm, buf, fold, 0, buf.numel())


def _halving(comm, buf, op, fold: Fold, ranges, tmp):
    """Recursive halving among the virtual ranks: virtual rank v ends with ranges[v] reduced."""
    v = fold.virtual(comm.rank)
    lo, hi = 0, fold.p  # the virtual ranks whose chunks this rank still reduces
    while hi - lo > 1:
        mid = (lo + hi) // 2
        keep, give, peer = ((lo, mid), (mid, hi), v + (mid - lo)) if v < mid else ((mid, hi), (lo, mid), v - (mid - lo))
        ka, kb = _span(ranges, keep[0], keep[1] - 1)
        ga, gb = _span(ranges, give[0], give[1] - 1)
        peer = fold.real(peer)
        yield comm.send(buf[ga:gb], peer, chunk=f"{give[0]}-{give[1] - 1}"), \
            comm.recv(tmp[:kb - ka], peer, chunk=f"{keep[0]}-{keep[1] - 1}")
        comm.reduce(buf[ka:kb], tmp[:kb - ka], op)
        lo, hi = keep


def _doubling(comm, buf, fold: Fold, ranges):
    """Recursive doubling all-gather among the virtual ranks, each starting with ranges[v]."""
    v, distance = fold.virtual(comm.rank), 1
    while distance < fold.p:
        mine = (v // distance) * distance
        theirs = ((v ^ distance) // distance) * distance
        ma, mb = _span(ranges, mine, mine + distance - 1)
        ta, tb = _span(ranges, theirs, theirs + distance - 1)
        peer = fold.real(v ^ distance)
        yield comm.send(buf[ma:mb], peer, chunk=f"{mine}-{mine + distance - 1}"), \
            comm.recv(buf[ta:tb], peer, chunk=f"{theirs}-{theirs + distance - 1}")
        distance <<= 1


def reduce_scatter_halving(comm, buf: torch.Tensor, op: str):
    """Recursive halving reduce-scatter: chunk `comm.rank` of `buf` ends reduced."""
    fold, chunks, tmp = Fold(comm.size), bounds(buf.numel(), comm.size), comm.workspace(buf, buf.numel())
    yield from _fold_in(comm, buf, op, fold, tmp)
    if not fold.sits_out(comm.rank):
        yield from _halving(comm, buf, op, fold, _owned(fold, chunks), tmp)
    partner = fold.partner(comm.rank)
    if partner is not None:  # the odd rank reduced its even partner's chunk too: hand it over
        yield from _fold_out(comm, buf, fold, *chunks[min(comm.rank, partner)])


def all_gather_doubling(comm, buf: torch.Tensor):
    """Recursive doubling all-gather: `buf` holds this rank's chunk; fills in the rest."""
    fold, chunks = Fold(comm.size), bounds(buf.numel(), comm.size)
    partner = fold.partner(comm.rank)
    if partner is not None:  # the even rank's chunk joins its partner's
        a, b = chunks[min(comm.rank, partner)]
        if b > a:
            yield ((comm.send if fold.sits_out(comm.rank) else comm.recv)(buf[a:b], partner, chunk="fold"),)
    if not fold.sits_out(comm.rank):
        yield from _doubling(comm, buf, fold, _owned(fold, chunks))
    yield from _fold_out(comm, buf, fold, 0, buf.numel())


def all_reduce_rabenseifner(comm, buf: torch.Tensor, op: str):
    """Recursive-halving reduce-scatter, then recursive-doubling all-gather (one fold around both).

    Here the buffer is cut into p' equal parts, one per virtual rank, not into one chunk per real
    rank: with a fold, the latter would give the folded pairs twice the data of the others."""
    fold, tmp = Fold(comm.size), comm.workspace(buf, buf.numel())
    ranges = bounds(buf.numel(), fold.p)
    yield from _fold_in(comm, buf, op, fold, tmp)
    if not fold.sits_out(comm.rank):
        yield from _halving(comm, buf, op, fold, ranges, tmp)
        yield from _doubling(comm, buf, fold, ranges)
    yield from _fold_out(comm, buf, fold, 0, buf.numel())


def reduce_rabenseifner(comm, buf: torch.Tensor, op: str, root: int):
    """Reduce as Rabenseifner does: recursive-halving reduce-scatter, then a binomial gather of
    the reduced chunks to the root. Root's buf ends with the reduction."""
    yield from reduce_scatter_halving(comm, buf, op)
    yield from tree.gather_binomial(comm, buf, root)
