"""The collectives done directly in shared memory: each rank copies in, reduces its own slice of
everyone's data, and copies out.

all_reduce of one chunk on p ranks (DeepSpeed's CPU shared-memory all-reduce works this way):

    1. rank r copies its chunk into its slot, all but slice r     (p copies at once)
    2. barrier
    3. rank r adds slice r of every other slot to slice r of its own tensor, in place, and
       copies the sum into its slot (a rank that takes no result, reduce's non-dst, writes the
       sum into its slot only)
    4. barrier
    5. rank r copies slice q of slot q, for every other q, into its tensor

Every element is reduced by exactly one rank in one fixed order (its own value first, then the
others' in rank order), and everyone copies that result, so every rank holds the same bits. On
2 ranks the order cannot matter (a + b == b + a), so the result equals Gloo's bit for bit; on
more ranks Gloo's ring adds in another order and the last bits can differ. Small buffers (up
to SMALL_BYTES) skip steps 3-4: after the barrier every rank adds all the slots itself, in
rank order, so all still hold the same bits.

No barrier is needed after step 5: each slot has two halves and consecutive rounds alternate
between them, so a rank can only write a half again two rounds later, when every rank has
passed the barrier of the round in between and so has finished reading it. Buffers larger than
half a slot go through in rounds of that size. The other collectives are the same pattern with
less to do: broadcast (src copies in, everyone copies out), reduce (only dst copies out),
all_gather (everyone copies in, everyone copies every slot out), reduce_scatter (each rank
reduces only its own chunk, straight into its output), barrier.
"""

from __future__ import annotations

import torch

from ..algorithms.comm import local_reduce
from ..algorithms.layout import bounds
from .segment import Segment
from .wait import Waiter

SMALL_BYTES = 16 << 10
_COMBINE = {"sum": torch.add, "product": torch.mul, "min": torch.minimum, "max": torch.maximum,
            "band": torch.bitwise_and, "bor": torch.bitwise_or, "bxor": torch.bitwise_xor}


def _combine(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, op: str) -> None:
    """out = a op b in one pass over memory (a copy and an in-place op would be two)."""
    try:
        _COMBINE[op](a, b, out=out)
    except RuntimeError:  # no CPU kernel for this dtype (uint16/32/64): the widening path
        out.copy_(a)
        local_reduce(out, b, op)


class ShmCollectives:
    """The collectives of one group on its segment (one rank's view). Tensors are contiguous, CPU."""

    def __init__(self, segment: Segment, rank: int, waiter: Waiter):
        self.segment, self.rank, self.waiter = segment, rank, waiter
        self.size = segment.world_size
        self.half = segment.slot_bytes // 2
        self.round = 0
        self._typed: dict = {}  # (dtype, half) -> every rank's half-slot viewed as that dtype (slicing costs)

    def _next_round(self) -> int:
        self.round += 1
        return self.round & 1

    def _slot(self, rank: int, dtype: torch.dtype, numel: int, half: int) -> torch.Tensor:
        slots = self._typed.get((dtype, half))
        if slots is None:
            slots = self._typed[(dtype, half)] = [
                self.segment.slot(q)[half * self.half:(half + 1) * self.half].view(dtype) for q in range(self.size)]
        return slots[rank][:numel]

    def _rounds(self, numel: int, itemsize: int, parts: int = 1):
        """Element ranges that fit half a slot (`parts` of them side by side in it)."""
        per = max(1, self.half // (itemsize * parts))
        return [(a, min(a + per, numel)) for a in range(0, numel, per)] or [(0, 0)]

    def all_reduce(self, flat: torch.Tensor, op: str) -> None:
        self.waiter.what = "all_reduce"
        self._reduce(flat, op, copy_out=True)

    def reduce(self, flat: torch.Tensor, op: str, dst: int) -> None:
        self.waiter.what = "reduce"
        self._reduce(flat, op, copy_out=self.rank == dst)

    def _reduce(self, flat: torch.Tensor, op: str, copy_out: bool) -> None:
        """The module docstring's steps, round by round; copy_out: this rank takes the result."""
        p, r, dtype = self.size, self.rank, flat.dtype
        if flat.numel() * flat.element_size() <= min(SMALL_BYTES, self.half):
            h = self._next_round()
            self._slot(r, dtype, flat.numel(), h).copy_(flat)
            self.waiter.barrier()
            if copy_out:  # every rank adds every slot, in rank order: the same bits everywhere
                n = flat.numel()
                flat.copy_(self._slot(0, dtype, n, h))
                for q in range(1, p):
                    local_reduce(flat, self._slot(q, dtype, n, h), op)
            return
        for a, b in self._rounds(flat.numel(), flat.element_size()):
            m, h = b - a, self._next_round()
            s, e = bounds(m, p)[r]
            slot = self._slot(r, dtype, m, h)
            # 1. copy in what the others reduce (this rank's own slice it reads from its tensor)
            if s > 0:
                slot[:s].copy_(flat[a:a + s])
            if e < m:
                slot[e:].copy_(flat[a + e:b])
            self.waiter.barrier()
            # 3. this rank's slice: its own value first, then the others' in rank order
            if e > s:
                others = [q for q in range(p) if q != r]
                # into this rank's tensor in place when it takes the result (then into the slot
                # for the others): the sum is written where its inputs were just read, and step
                # 5 has one slice less to copy; measured 5-9% faster at 2 ranks, 8-26 MiB
                into = flat[a + s:a + e] if copy_out else slot[s:e]
                _combine(into, flat[a + s:a + e], self._slot(others[0], dtype, m, h)[s:e], op)
                for q in others[1:]:
                    local_reduce(into, self._slot(q, dtype, m, h)[s:e], op)
                if copy_out:
                    slot[s:e].copy_(into)
            self.waiter.barrier()
            if copy_out:  # 5. every other slice from the slot of the rank that reduced it
                for q, (s, e) in enumerate(bounds(m, p)):
                    if e > s and q != r:
                        flat[a + s:a + e].copy_(self._slot(q, dtype, m, h)[s:e])

    def broadcast(self, flat: torch.Tensor, src: int) -> None:
        self.waiter.what = "broadcast"
        for a, b in self._rounds(flat.numel(), flat.element_size()):
            h = self._next_round()
            if self.rank == src:
                self._slot(src, flat.dtype, b - a, h).copy_(flat[a:b])
            self.waiter.barrier()
            if self.rank != src:
                flat[a:b].copy_(self._slot(src, flat.dtype, b - a, h))

    def all_gather(self, out: torch.Tensor, flat: torch.Tensor) -> None:
        """out (p * numel, flat) gets every rank's flat in rank order."""
        p, r, n = self.size, self.rank, flat.numel()
        self.waiter.what = "all_gather"
        for a, b in self._rounds(n, flat.element_size()):
            h = self._next_round()
            self._slot(r, flat.dtype, b - a, h).copy_(flat[a:b])
            self.waiter.barrier()
            for q in range(p):
                out[q * n + a:q * n + b].copy_(self._slot(q, flat.dtype, b - a, h))

    def reduce_scatter(self, out: torch.Tensor, flat: torch.Tensor, op: str) -> None:
        """out (numel / p) gets chunk `rank` of the reduction of every rank's flat."""
        p, r = self.size, self.rank
        c = flat.numel() // p
        self.waiter.what = "reduce_scatter"
        # each round: the same piece of every chunk, side by side in the half-slot
        for a, b in self._rounds(c, flat.element_size(), parts=p):
            k, h = b - a, self._next_round()
            self._slot(r, flat.dtype, p * k, h).view(p, k).copy_(flat.view(p, c)[:, a:b])
            self.waiter.barrier()
            out[a:b].copy_(self._slot(r, flat.dtype, p * k, h).view(p, k)[r])
            for q in range(p):
                if q != r:
                    local_reduce(out[a:b], self._slot(q, flat.dtype, p * k, h).view(p, k)[r], op)

    def barrier(self) -> None:
        self.waiter.what = "barrier"
        self.waiter.barrier()
