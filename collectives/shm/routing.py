"""The collectives that route data without reducing it, in shared memory: gather, scatter and
all_to_all (even or uneven splits). They use the slots as python_path.py does (round by round through
alternating half-slots, the call check at the first barrier), on bytes, so every dtype goes.

    gather:      every rank copies its tensor into its slot; barrier; dst copies every slot out
    scatter:     src copies chunk q of its input, for every q, side by side into its slot;
                 barrier; rank q copies chunk q out
    all_to_all:  first every rank writes how many bytes it sends to and expects from each rank
                 (2 x world_size numbers) and all read the whole table: a send that does not match
                 its receiver's expectation makes every rank raise CollectiveMismatchError naming
                 the pair, before any data moves (Gloo aborts the process there). Then, round by
                 round, rank r copies the next piece of its part for each q into region q of its
                 slot, and after the barrier copies region r of every slot into its output.

    from collectives.shm.routing import all_to_all
    all_to_all(collectives, out_bytes, in_bytes, out_splits, in_splits)   # byte counts per rank
"""

from __future__ import annotations

from typing import List

import torch

from ..dtypes import as_bytes
from ..errors import CollectiveMismatchError
from .python_path import ShmCollectives


def _rounds_of(total: int, per: int):
    return [(a, min(a + per, total)) for a in range(0, total, per)] or [(0, 0)]


def gather(sc: ShmCollectives, outs: List[torch.Tensor], tensor: torch.Tensor, dst: int) -> None:
    """outs (on dst: world_size contiguous tensors like `tensor`, one per rank) get every rank's tensor."""
    sc.begin("gather", tensor, root=dst)
    flat, outs = as_bytes(tensor), [as_bytes(t) for t in outs]
    n = flat.numel()
    for a, b in _rounds_of(n, sc.half):
        h = sc.next_round()
        sc.slot(sc.rank, torch.uint8, b - a, h).copy_(flat[a:b])
        sc.meet()
        if sc.rank == dst:
            for q, out in enumerate(outs):
                out[a:b].copy_(sc.slot(q, torch.uint8, b - a, h))


def scatter(sc: ShmCollectives, output: torch.Tensor, ins: List[torch.Tensor], src: int) -> None:
    """output gets src's ins[rank] (on src: world_size contiguous tensors like output)."""
    sc.begin("scatter", output, root=src)
    out, ins = as_bytes(output), [as_bytes(t) for t in ins]
    p, n = sc.size, out.numel()
    for a, b in _rounds_of(n, max(1, sc.half // p)):
        k, h = b - a, sc.next_round()
        if sc.rank == src:
            slot = sc.slot(src, torch.uint8, p * k, h).view(p, k)
            for q, t in enumerate(ins):
                slot[q].copy_(t[a:b])
        sc.meet()
        out[a:b].copy_(sc.slot(src, torch.uint8, p * k, h).view(p, k)[sc.rank])


def _exchange_counts(sc: ShmCollectives, sends: List[int], expects: List[int]) -> torch.Tensor:
    """Every rank's byte counts, (world_size, 2, world_size) int64: [q, 0, r] what q sends to r,
    [q, 1, r] what q expects from r. One round, one barrier (the call's first: the call check)."""
    p = sc.size
    h = sc.next_round()
    mine = torch.tensor([sends, expects], dtype=torch.int64)
    sc.slot(sc.rank, torch.int64, 2 * p, h).copy_(mine.view(-1))
    sc.meet()
    return torch.stack([sc.slot(q, torch.int64, 2 * p, h).view(2, p) for q in range(p)])


def all_to_all(sc: ShmCollectives, out: torch.Tensor, inp: torch.Tensor, out_splits: List[int],
               in_splits: List[int]) -> None:
    """out and inp are flat uint8; in_splits[q] bytes of inp go to rank q, out_splits[q] bytes of
    out come from rank q (both in rank order)."""
    p, r = sc.size, sc.rank
    sc.begin("all_to_all", None)
    table = _exchange_counts(sc, in_splits, out_splits)
    sent, expected = table[:, 0, :], table[:, 1, :].t()  # [q, r]: q to r, and what r expects from q
    if not torch.equal(sent, expected):
        bad = (sent != expected).nonzero().tolist()
        pairs = "; ".join(f"rank {q} sends {sent[q, d].item()} bytes to rank {d}, which expects "
                          f"{expected[q, d].item()}" for q, d in bad[:4]) + ("; ..." if len(bad) > 4 else "")
        raise CollectiveMismatchError(f"all_to_all on rank {r} of the shm group: the ranks' splits disagree "
                                      f"({pairs}); none of them moved data, and the group is still usable")
    in_at = [0] + torch.tensor(in_splits).cumsum(0).tolist()
    out_at = [0] + torch.tensor(out_splits).cumsum(0).tolist()
    per = max(1, sc.half // p)  # region q of a half-slot carries the piece for rank q
    largest = int(sent.max()) if sent.numel() else 0
    for a, b in _rounds_of(largest, per):
        h = sc.next_round()
        slot = sc.slot(r, torch.uint8, p * per, h)
        for q in range(p):
            s, e = min(a, in_splits[q]), min(b, in_splits[q])
            if e > s:
                slot[q * per:q * per + e - s].copy_(inp[in_at[q] + s:in_at[q] + e])
        sc.meet()
        for q in range(p):
            s, e = min(a, out_splits[q]), min(b, out_splits[q])
            if e > s:
                out[out_at[q] + s:out_at[q] + e].copy_(sc.slot(q, torch.uint8, p * per, h)[r * per:r * per + e - s])
