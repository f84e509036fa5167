"""Ring algorithms: reduce-scatter, all-gather, and all-reduce as the two in a row.

The ranks stand in a ring; each sends only to its right neighbour (rank + 1) and receives only
from its left (rank - 1). The buffer is cut into one chunk per rank (collectives/chunks.py). With 4 ranks:

    reduce-scatter, step s: rank r sends chunk (r - s - 1) to r + 1, which adds it to its own
    copy. After 3 steps rank r holds chunk r summed over every rank.

          step 0          step 1          step 2
    r0  c3 -> r1      c2 -> r1      c1 -> r1        r0 ends with c0 = r0+r1+r2+r3
    r1  c0 -> r2      c3 -> r2      c2 -> r2        r1 ends with c1
    r2  c1 -> r3      c0 -> r3      c3 -> r3        ...
    r3  c2 -> r0      c1 -> r0      c0 -> r0

    all-gather: the same walk, copying instead of adding: after 3 steps every rank has every chunk.

Cost (alpha: latency per message, beta: seconds per byte, gamma: seconds per byte reduced,
n: bytes of the buffer, p: ranks), Thakur, Rabenseifner and Gropp 2005:
    reduce-scatter  (p-1) alpha + (p-1)/p n beta + (p-1)/p n gamma
    all-gather      (p-1) alpha + (p-1)/p n beta
    all-reduce      2(p-1) alpha + 2(p-1)/p n beta + (p-1)/p n gamma
Every byte crosses each link the least number of times possible, so the ring is bandwidth
optimal; its 2(p-1) latencies make it slow for small buffers.

`pieces` splits each step's chunk into that many messages, so the add of one piece overlaps
the transfer of the next (the pipelining NCCL does with its slices).
"""

from __future__ import annotations

import torch

from ..chunks import bounds


def _split(start: int, end: int, pieces: int):
    """(start, end) of up to `pieces` contiguous, nearly equal, non-empty pieces of [start, end).
    An empty chunk (fewer elements than ranks) sends no message at all, on either side."""
    return [(start + a, start + b) for a, b in bounds(end - start, pieces) if b > a]


def reduce_scatter(comm, buf: torch.Tensor, op: str, pieces: int = 1):
    """Leaves chunk `comm.rank` of `buf` reduced over every rank (buf: 1-d; the rest is scratch)."""
    n, r = comm.size, comm.rank
    chunks = bounds(buf.numel(), n)
    tmp = comm.workspace(buf, max(b - a for a, b in chunks))  # one incoming chunk
    right, left = (r + 1) % n, (r - 1) % n
    for s in range(n - 1):
        out_chunk, in_chunk = (r - s - 1) % n, (r - s - 2) % n
        sends = [comm.send(buf[a:b], right, chunk=out_chunk) for a, b in _split(*chunks[out_chunk], pieces)]
        base = chunks[in_chunk][0]
        parts = _split(*chunks[in_chunk], pieces)
        recvs = [comm.recv(tmp[a - base:b - base], left, chunk=in_chunk) for a, b in parts]
        for j, ((a, b), got) in enumerate(zip(parts, recvs)):
            yield (got, *sends) if j == len(recvs) - 1 else (got,)  # one yield a step when pieces=1
            comm.reduce(buf[a:b], tmp[a - base:b - base], op)  # overlaps the next piece's transfer
        if not recvs:
            yield sends


def all_gather(comm, buf: torch.Tensor, pieces: int = 1):
    """`buf` holds this rank's chunk at its place; fills in every other rank's chunk."""
    n, r = comm.size, comm.rank
    chunks = bounds(buf.numel(), n)
    right, left = (r + 1) % n, (r - 1) % n
    for s in range(n - 1):
        out_chunk, in_chunk = (r - s) % n, (r - s - 1) % n
        requests = [comm.send(buf[a:b], right, chunk=out_chunk) for a, b in _split(*chunks[out_chunk], pieces)]
        requests += [comm.recv(buf[a:b], left, chunk=in_chunk) for a, b in _split(*chunks[in_chunk], pieces)]
        yield requests


def all_reduce(comm, buf: torch.Tensor, op: str, pieces: int = 1):
    """Reduce-scatter, then all-gather: every rank ends with every chunk, each reduced exactly
    once (on its owner) and then copied, so every rank holds the same bits."""
    yield from reduce_scatter(comm, buf, op, pieces)
    yield from all_gather(comm, buf, pieces)
