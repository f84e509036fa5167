"""Broadcasts for large buffers: a pipelined chain, and van de Geijn's scatter + all-gather.

Pipelined chain: the ranks form a line from the root, root -> root+1 -> ... -> root+p-1, and
the buffer travels in k pieces. Rank 1 forwards piece 0 while it receives piece 1, so after the
first p-1 steps of filling the line every step moves a piece across every link at once:

    step:     0      1      2      3      4
    r0 ->r1   p0     p1     p2
    r1 ->r2          p0     p1     p2
    r2 ->r3                 p0     p1     p2

van de Geijn: scatter the buffer from the root (binomial tree), then all-gather it (ring):
every rank sends and receives about 2n bytes in all, whatever p is.

Costs (alpha per message, beta per byte, n bytes, p ranks, k pieces):
    pipelined chain      (p - 2 + k) (alpha + n/k beta), least at k = sqrt((p - 2) n beta / alpha)
    scatter + all-gather (lg p + p - 1) alpha + 2 (p-1)/p n beta
Both beat the binomial tree's lg p (alpha + n beta) once n beta dominates.
"""

from __future__ import annotations

import torch

from typing import Optional

from . import ring, tree
from .cost import pieces_for
from ..chunks import bounds


def broadcast_chain(comm, buf: torch.Tensor, root: int, pieces: Optional[int] = None):
    """pieces=None: the number that minimises the chain's cost under the fitted model."""
    p = comm.size
    if pieces is None:
        pieces = pieces_for("chain", p, buf.numel() * buf.element_size())
    v = (comm.rank - root) % p
    prev, nxt = (comm.rank - 1) % p, (comm.rank + 1) % p
    sends = []
    for k, (a, b) in enumerate(x for x in bounds(buf.numel(), pieces) if x[1] > x[0]):
        if v > 0:
            yield (comm.recv(buf[a:b], prev, chunk=f"piece {k}"),)
        if v < p - 1:
            sends.append(comm.send(buf[a:b], nxt, chunk=f"piece {k}"))  # forwarded while the next piece arrives
    yield sends


def broadcast_scatter_allgather(comm, buf: torch.Tensor, root: int):
    yield from tree.scatter_binomial(comm, buf, root)
    yield from ring.all_gather(comm, buf)
