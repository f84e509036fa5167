"""Bruck's algorithms: all-gather and all-to-all in ceil(lg p) steps for any p.

all-gather: each rank keeps the chunks it has in a rotated order, its own first. In step k it
sends the first 2^k chunks it holds to rank r - 2^k and appends the 2^k it receives from rank
r + 2^k; after ceil(lg p) steps it holds all p (the last step sends only p - 2^k), and rotates
them back into place. Unlike recursive doubling it needs no fold for p not a power of two.

    5 ranks, what rank 0 holds (as ranks' chunks):  [0] -> [0 1] -> [0 1 2 3] -> [0 1 2 3 4]

all-to-all: rotate the blocks so that block i is meant for rank r + i; in step k send every
block whose index has bit k set to rank r + 2^k (and receive the same positions from r - 2^k);
then undo the rotation. Each block travels through up to lg p ranks.

Costs (alpha per message, beta per byte, n bytes per rank, p ranks):
    all-gather   ceil(lg p) alpha + (p-1)/p n beta
    all-to-all   ceil(lg p) alpha + ceil(lg p) n/2 beta    (more bytes than pairwise, fewer messages)
"""

from __future__ import annotations

import torch

from ..chunks import bounds


def all_gather_bruck(comm, buf: torch.Tensor):
    """`buf` holds this rank's chunk at its place; fills in every other rank's chunk."""
    p, r = comm.size, comm.rank
    chunks = bounds(buf.numel(), p)
    held = [(r + i) % p for i in range(p)]  # whose chunk sits at each rotated position
    starts, pos = [], 0
    for owner in held:
        starts.append(pos)
        pos += chunks[owner][1] - chunks[owner][0]
    starts.append(pos)
    tmp = comm.workspace(buf, buf.numel())  # chunks in rotated order: this rank's first
    a, b = chunks[r]
    tmp[:b - a] = buf[a:b]
    have, k = 1, 1
    while have < p:
        count = min(have, p - have)
        to, frm = (r - k) % p, (r + k) % p
        # rank frm's first `count` chunks are those of ranks frm .. frm+count-1: positions have.. here
        yield (comm.send(tmp[:starts[count]], to, chunk=f"{r}..{(r + count - 1) % p}"),
               comm.recv(tmp[starts[have]:starts[have + count]], frm, chunk=f"{frm}..{(frm + count - 1) % p}"))
        for i in range(have, have + count):  # rotate the new chunks into place as they arrive
            a, b = chunks[held[i]]
            buf[a:b] = tmp[starts[i]:starts[i + 1]]
        have += count
        k <<= 1


def all_to_all_bruck(comm, send: torch.Tensor, recv: torch.Tensor):
    """Block j of `send` (p equal blocks) goes to rank j; block i of `recv` comes from rank i."""
    p, r = comm.size, comm.rank
    block = send.numel() // p
    blocks = send.view(p, block)  # (p, block)
    work = comm.workspace(send, p * block).view(p, block)  # row i is for rank r + i
    work[:p - r] = blocks[r:]
    work[p - r:] = blocks[:r]
    k = 1
    while k < p:
        rows = torch.tensor([i for i in range(p) if i & k])
        out = comm.workspace(send, len(rows) * block, slot="bruck out").view(len(rows), block)
        torch.index_select(work, 0, rows, out=out)  # the rows to send, packed
        got = comm.workspace(send, len(rows) * block, slot="bruck in").view(len(rows), block)
        yield (comm.send(out.view(-1), (r + k) % p, chunk=f"bit {k}"),
               comm.recv(got.view(-1), (r - k) % p, chunk=f"bit {k}"))
        work.index_copy_(0, rows, got)
        k <<= 1
    # row i now holds the block that rank r - i sent to this rank
    view = recv.view(p, block)
    order = torch.tensor([(r - i) % p for i in range(p)])
    view.index_copy_(0, order, work)
