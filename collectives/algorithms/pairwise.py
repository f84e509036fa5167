"""Pairwise exchange: in step s every rank talks directly to the rank s places away.

reduce-scatter: in step s (1..p-1) rank r sends its contribution to chunk r+s straight to rank
r+s, and receives rank r-s's contribution to its own chunk, which it adds. all-to-all: the same
pattern, copying block r+s instead of a contribution. With 4 ranks:

    step 1:  0->1 1->2 2->3 3->0
    step 2:  0->2 1->3 2->0 3->1
    step 3:  0->3 1->0 2->1 3->2

Costs (alpha per message, beta per byte, gamma per byte reduced, n bytes per rank, p ranks):
    reduce-scatter  (p-1) alpha + (p-1)/p n beta + (p-1)/p n gamma
    all-to-all      (p-1) alpha + (p-1)/p n beta
The same bytes as the ring, but each message goes straight to its destination: no rank
forwards another's data, so it suits networks where every pair has its own path.
"""

from __future__ import annotations

import torch

from ..chunks import bounds


def reduce_scatter_pairwise(comm, buf: torch.Tensor, op: str):
    """Chunk `comm.rank` of `buf` ends reduced over every rank."""
    p, r = comm.size, comm.rank
    chunks = bounds(buf.numel(), p)
    a, b = chunks[r]
    incoming = comm.workspace(buf, (p - 1) * (b - a)).view(p - 1, b - a)  # a slot per sender: none reused
    for s in range(1, p):
        to, frm = (r + s) % p, (r - s) % p
        ta, tb = chunks[to]
        yield comm.send(buf[ta:tb], to, chunk=to), comm.recv(incoming[s - 1], frm, chunk=r)
        comm.reduce(buf[a:b], incoming[s - 1], op)


def all_to_all_pairwise(comm, send: torch.Tensor, recv: torch.Tensor):
    """Block j of `send` (p equal blocks) goes to rank j; block i of `recv` comes from rank i."""
    p, r = comm.size, comm.rank
    block = send.numel() // p
    recv[r * block:(r + 1) * block] = send[r * block:(r + 1) * block]
    for s in range(1, p):
        to, frm = (r + s) % p, (r - s) % p
        yield (comm.send(send[to * block:(to + 1) * block], to, chunk=f"{r}->{to}"),
               comm.recv(recv[frm * block:(frm + 1) * block], frm, chunk=f"{frm}->{r}"))
