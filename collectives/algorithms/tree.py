"""Trees: binomial broadcast, reduce, gather and scatter; all-reduce as reduce + broadcast; and
NCCL's double binary tree.

Binomial tree, rooted at `root` (ranks renumbered so the root is 0: v = (rank - root) mod p).
Broadcast with 8 ranks: the root sends to 4, then 0 and 4 send to 2 and 6, then everyone with
the data sends to the rank one above it. Reduce runs the same tree upwards, adding as it goes:

    step 0:  0 -> 4                         (broadcast; reduce reads it bottom-up)
    step 1:  0 -> 2, 4 -> 6
    step 2:  0 -> 1, 2 -> 3, 4 -> 5, 6 -> 7

Gather and scatter use the same tree; a rank forwards the chunks of its whole subtree at once.

Double binary tree (NCCL): in a binary tree half the ranks are leaves, which only send, so
their links sit idle going down; a second tree in which those ranks are the inner ones carries
the other half of the buffer. Each tree reduces its half towards its root and broadcasts it back,
in `pieces` pipelined messages, so every link is busy both ways.

Costs (alpha per message, beta per byte, gamma per byte reduced, n bytes, p ranks):
    binomial broadcast             lg p (alpha + n beta)
    binomial reduce                lg p (alpha + n beta + n gamma)
    binomial gather / scatter      lg p alpha + (p-1)/p n beta
    reduce + broadcast all-reduce  2 lg p (alpha + n beta) + lg p n gamma
    double binary tree all-reduce  about 2 (depth + k - 1) (alpha + n/(2k) beta), k pieces per tree
"""

from __future__ import annotations

import functools
from typing import List, Optional, Tuple

import torch

from .cost import pieces_for
from ..chunks import bounds


def _parent_and_children(v: int, p: int) -> Tuple[Optional[int], List[int]]:
    """Binomial tree on virtual ranks 0..p-1: v's parent (v minus its lowest set bit) and its
    children (v + 2^k for every 2^k below that bit), nearest last."""
    low = v & -v if v else 1 << p.bit_length()
    parent = v - low if v else None
    children, k = [], 1
    while k < low and v + k < p:
        children.append(v + k)
        k <<= 1
    return parent, children[::-1]  # farthest first: its subtree is the largest


def _real(v: int, root: int, p: int) -> int:
    return (v + root) % p


def broadcast_binomial(comm, buf: torch.Tensor, root: int):
    p = comm.size
    v = (comm.rank - root) % p
    parent, children = _parent_and_children(v, p)
    if parent is not None:
        yield (comm.recv(buf, _real(parent, root, p), chunk="all"),)
    yield [comm.send(buf, _real(c, root, p), chunk="all") for c in children]


def reduce_binomial(comm, buf: torch.Tensor, op: str, root: int):
    """Root's buf ends with the reduction; the others' are scratch."""
    p = comm.size
    v = (comm.rank - root) % p
    parent, children = _parent_and_children(v, p)
    tmp = comm.workspace(buf, buf.numel())
    for c in reversed(children):  # nearest first: its subtree finishes first
        yield (comm.recv(tmp, _real(c, root, p), chunk=f"subtree of {_real(c, root, p)}"),)
        comm.reduce(buf, tmp, op)
    if parent is not None:
        yield (comm.send(buf, _real(parent, root, p), chunk=f"subtree of {comm.rank}"),)


def _rotated(buf: torch.Tensor, root: int, p: int):
    """The chunks in virtual order (root's first), as one buffer, and each virtual chunk's range."""
    chunks = bounds(buf.numel(), p)
    order = [chunks[_real(v, root, p)] for v in range(p)]
    starts, pos = [], 0
    for a, b in order:
        starts.append((pos, pos + b - a))
        pos += b - a
    return order, starts


def gather_binomial(comm, buf: torch.Tensor, root: int):
    """Each rank's chunk is at its place in buf; root's buf ends with every chunk."""
    p = comm.size
    v = (comm.rank - root) % p
    order, virtual = _rotated(buf, root, p)
    tmp = comm.workspace(buf, buf.numel())  # chunks in virtual order
    (a, b), (ta, tb) = order[v], virtual[v]
    tmp[ta:tb] = buf[a:b]
    parent, children = _parent_and_children(v, p)
    for c in reversed(children):
        last = min(p, c + (c & -c)) - 1  # c's subtree: virtual ranks c .. last
        yield (comm.recv(tmp[virtual[c][0]:virtual[last][1]], _real(c, root, p), chunk=f"{c}-{last}"),)
    if parent is not None:
        last = min(p, v + (v & -v)) - 1
        yield (comm.send(tmp[virtual[v][0]:virtual[last][1]], _real(parent, root, p), chunk=f"{v}-{last}"),)
    else:
        for (a, b), (ta, tb) in zip(order, virtual):
            buf[a:b] = tmp[ta:tb]


def scatter_binomial(comm, buf: torch.Tensor, root: int):
    """Root's buf holds every chunk; each rank's buf ends with its own chunk at its place."""
    p = comm.size
    v = (comm.rank - root) % p
    order, virtual = _rotated(buf, root, p)
    tmp = comm.workspace(buf, buf.numel())
    parent, children = _parent_and_children(v, p)
    last = min(p, v + (v & -v)) - 1 if v else p - 1
    if parent is None:
        for (a, b), (ta, tb) in zip(order, virtual):
            tmp[ta:tb] = buf[a:b]
    else:
        yield (comm.recv(tmp[virtual[v][0]:virtual[last][1]], _real(parent, root, p), chunk=f"{v}-{last}"),)
    sends = []
    for c in children:
        c_last = min(p, c + (c & -c)) - 1
        sends.append(comm.send(tmp[virtual[c][0]:virtual[c_last][1]], _real(c, root, p), chunk=f"{c}-{c_last}"))
    yield sends
    (a, b), (ta, tb) = order[v], virtual[v]
    buf[a:b] = tmp[ta:tb]


def all_reduce_binomial(comm, buf: torch.Tensor, op: str):
    """Binomial reduce to rank 0, then binomial broadcast from it."""
    yield from reduce_binomial(comm, buf, op, 0)
    yield from broadcast_binomial(comm, buf, 0)


# -- NCCL's double binary tree -----------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def _binary_tree(p: int):
    """({child: parent}, {rank: children}) of the in-order binary tree on ranks 0..p-1."""
    children = {0: [1 << (p - 1).bit_length() - 1] if p > 1 else []}  # the root's one child: top power of 2
    for r in range(1, p):
        half = (r & -r) >> 1  # a rank's level is its lowest set bit; odd ranks are leaves
        kids = []
        if half:
            kids.append(r - half)
            h = half
            while h and r + h >= p:  # the right child is missing: the nearest rank inside that subtree
                h >>= 1
            if h:
                kids.append(r + h)
        children[r] = kids
    return {c: r for r, kids in children.items() for c in kids}, children


def binary_tree(rank: int, p: int) -> Tuple[Optional[int], List[int]]:
    """(parent, children) of `rank` in an in-order binary tree on ranks 0..p-1: rank 4's
    children are 2 and 6, rank 2's are 1 and 3, and the root, rank 0, has one child, the highest
    power of two below p. Where a right child would be p or more, the nearest rank in that
    subtree takes its place."""
    parents, children = _binary_tree(p)
    return parents.get(rank), children[rank]


def double_trees(rank: int, p: int):
    """(parent, children) of `rank` in each of the two trees. The second is the first with every
    rank shifted by one (mirrored for an odd world), so the leaves of one (odd ranks) are inner
    ranks of the other."""
    shift = (lambda r: p - 1 - r) if p % 2 else (lambda r: (r - 1) % p)
    back = {shift(r): r for r in range(p)}
    parent, children = binary_tree(shift(rank), p)
    return binary_tree(rank, p), (None if parent is None else back[parent], [back[c] for c in children])


def all_reduce_double_tree(comm, buf: torch.Tensor, op: str, pieces: Optional[int] = None):
    """Half the buffer up and down each tree, in `pieces` pipelined messages per half (None: the
    number that minimises the cost under the fitted model)."""
    p, r = comm.size, comm.rank
    if p == 1:
        return
    if pieces is None:
        pieces = pieces_for("double_binary_tree", p, buf.numel() * buf.element_size())
    halves = bounds(buf.numel(), 2)
    trees = double_trees(r, p)
    plan = [(t, a + x, a + y) for t, (a, b) in enumerate(halves) for x, y in bounds(b - a, pieces) if y > x]
    tmp = comm.workspace(buf, buf.numel())
    up = []
    for t, a, b in plan:  # reduce towards each tree's root, piece by piece
        parent, children = trees[t]
        for c in children:
            yield (comm.recv(tmp[a:b], c, chunk=f"tree {t} [{a}:{b}]"),)
            comm.reduce(buf[a:b], tmp[a:b], op)
        if parent is not None:
            up.append(comm.send(buf[a:b], parent, chunk=f"tree {t} [{a}:{b}]"))
    yield up
    down = []
    for t, a, b in plan:  # and back down
        parent, children = trees[t]
        if parent is not None:
            yield (comm.recv(buf[a:b], parent, chunk=f"tree {t} [{a}:{b}]"),)
        down += [comm.send(buf[a:b], c, chunk=f"tree {t} [{a}:{b}]") for c in children]
    yield down
