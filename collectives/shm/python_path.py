"""The collectives done directly in shared memory: each rank copies in, reduces its own slice of
everyone's data, and copies out.

all_reduce of one chunk on p ranks (DeepSpeed's CPU shared-memory all-reduce works this way):

    1. rank r copies its chunk into its slot, all but slice r     (p copies at once)
    2. barrier
    3. rank r adds slice r of every other slot to slice r of its own tensor, in place, and
       copies the sum into its slot (a rank that takes no result, reduce's non-dst, writes the
       sum into its slot only); it does so in pieces (ShmConfig.piece_bytes), each summed and copied
       while it is still in cache, so the sum is read from memory once, not once per rank
       added (4 ranks: 22% fewer bytes of memory moved in all; all_reduce_traffic counts them)
    4. barrier
    5. rank r copies slice q of slot q, for every other q, into its tensor

Every element is reduced by exactly one rank in one fixed order (its own value first, then the
others' in rank order), and everyone copies that result, so every rank holds the same bits. On
2 ranks the order cannot matter (a + b == b + a), so the result equals Gloo's bit for bit; on
more ranks Gloo's ring adds in another order and the last bits can differ. Small buffers (up
to small_limit(world size): 64 KiB on 2 ranks, 16 KiB from 8) skip steps 3-4: after the
barrier every rank adds all the slots itself, in rank order, so all still hold the same bits.

No barrier is needed after step 5: each slot has two halves and consecutive rounds alternate
between them, so a rank can only write a half again two rounds later, when every rank has
passed the barrier of the round in between and so has finished reading it. Buffers larger than
half a slot go through in rounds of that size. The other collectives are the same pattern with
less to do: broadcast (src copies in, everyone copies out), reduce (only dst copies out),
all_gather (everyone copies in, everyone copies every slot out), reduce_scatter (each rank
reduces only its own chunk, straight into its output), barrier.

An all_reduce of 16 MiB or more skips the copies where every rank may: cma.py reads each slice
straight from the other ranks' tensors and writes the sum straight back, same order, same bits
(`all_reduce_path` says which way a call goes).

The ranks must agree on what they call: at a call's first barrier every rank has written which
collective, op, root, dtype and element count it is in, and each compares everyone's. Where raw
torch.distributed calls disagree (rank 0 all-reduces 3 floats, rank 1 4; one says sum, one max;
one broadcasts, one all-reduces), every rank raises CollectiveMismatchError naming each rank's
call, and the group stays usable; Gloo aborts the process or hangs there, and without the check
shared memory would give a silent wrong answer.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..chunks import bounds
from ..errors import CollectiveMismatchError
from ..reduce_ops import combine, local_reduce
from . import cma
from .config import ShmConfig
from .protocol import CALL_STRUCT, DTYPE_CODES, KINDS, OPS, REFUSED, ShmArgumentError, disagreement
from .segment import Segment
from .wait import PeerFailure, Waiter, behind

SMALL_BYTES = 16 << 10
SMALL_TOTAL_BYTES = 128 << 10


def small_limit(world_size: int) -> int:
    """The largest all_reduce or reduce, in bytes, that takes the small path on world_size ranks.
    There every rank reads every slot, so what it reads grows with the ranks: the small path runs
    while the slots add up to SMALL_TOTAL_BYTES, and always up to SMALL_BYTES. That is 64 KiB on 2
    ranks, 32 KiB on 4, 16 KiB from 8 (measured on the 16-core Xeon: docs/shm.md, the small path)."""
    return max(SMALL_BYTES, SMALL_TOTAL_BYTES // world_size)


# Step 3 in pieces of ShmConfig.piece_bytes (1 MiB): the partial sum of a piece stays in cache
# while the others' pieces are added to it and it is copied out (benchmarks.studies.shm_paths measures
# the pieces against the whole slice).


def _sum(into: torch.Tensor, first: torch.Tensor, others, op: str) -> None:
    """into = first op others[0] op others[1] ... (in that order, every element); `into` may be
    `first`. The one order every path adds in, so every path gives the same bits."""
    combine(into, first, others[0], op)
    for src in others[1:]:
        local_reduce(into, src, op)


def all_reduce_traffic(nbytes: int, p: int, path: str = "pieces") -> float:
    """Bytes one rank reads plus writes in memory for an all_reduce of nbytes on p ranks, by the
    path it takes (ShmCollectives.all_reduce_path), counted from the steps; a piece of step 3 is
    taken to stay in cache.

        step 1, copy in (all but its own slice)   read (p-1)/p n    write (p-1)/p n
        step 3, "whole" slice at once             read (2p-1)/p n   write n     (the sum re-read for each rank added, then copied)
        step 3, in "pieces"                       read n            write 2/p n (each input read once, the sum written twice)
        step 5, copy out                          read (p-1)/p n    write (p-1)/p n
        "cma" (cma.py): no copies, read n, write n (its own slice, and its slice of every other tensor)

    4.5 n (whole), 4 n (pieces), 2 n (cma) on 2 ranks; 5.75 n, 4.5 n, 2 n on 4.
    """
    n = float(nbytes)
    if path == "cma":
        return 2 * n
    step3 = {"pieces": n + 2 * n / p, "whole": (2 * p - 1) / p * n + n}[path]
    return 4 * (p - 1) / p * n + step3


class ShmCollectives:
    """The collectives of one group on its segment (one rank's view). Tensors are contiguous, CPU."""

    def __init__(self, segment: Segment, rank: int, waiter: Waiter, config: ShmConfig, round_bytes: int):
        self.segment, self.rank, self.waiter = segment, rank, waiter
        self.size = segment.world_size
        # a round's share of a slot: half of it, or less (COLLECTIVES_SHM_ROUND_KB, as layout.agree
        # resolved it: never more than half a slot)
        self.half = round_bytes
        self.small = min(small_limit(self.size), self.half)  # the small path's largest all_reduce
        # the round-sized regions of a slot that rounds use in turn (COLLECTIVES_SHM_REGIONS)
        self.regions = config.region_count(self.half)
        self.round = 0
        self.calls = 0  # collectives this rank has entered (every rank the same, when they agree)
        self._pending: Optional[bytes] = None
        self._banks = [memoryview(segment.calls[b]).cast("B") for b in range(2)]
        self._typed: dict = {}  # (dtype, half) -> every rank's half-slot viewed as that dtype (slicing costs)
        self.piece_bytes = config.piece_bytes  # step 3's pieces (benchmarks/studies/shm_paths.py sets it per group)
        self.cma_min_bytes = config.cma_min_bytes
        # all_reduce through cross-memory attach, where every rank may use it (cma.probe, at start-up)
        self.cma: Optional[cma.CrossMemory] = None

    # -- every rank must be in the same collective, on the same arguments ----------------------
    def begin(self, kind: str, tensor: Optional[torch.Tensor] = None, op: str = "", root: int = -1) -> None:
        """Note which collective this rank is in; the call's first barrier checks that every rank
        noted the same (meet)."""
        self.waiter.what = kind
        numel = tensor.numel() if tensor is not None else 0
        self._pending = CALL_STRUCT.pack(KINDS.index(kind) + 1 | OPS.index(op) << 4 | (root + 1) << 8,
                                    DTYPE_CODES[tensor.dtype] if tensor is not None else -1, numel & 0x7FFFFFFF,
                                    numel >> 31)

    def refuse(self, kind: str, reason: str) -> None:
        """This rank's arguments for `kind` are wrong (`reason`): meet the other ranks at the call's
        first barrier anyway, marked as refused, so that every rank raises there instead of
        waiting for this one; then raise ShmArgumentError(reason) here. Nothing is written."""
        self.waiter.what = kind
        self._pending = CALL_STRUCT.pack(KINDS.index(kind) + 1, REFUSED, 0, 0)
        self.next_round()  # one round, as every call enters before its first barrier: the halves stay in step
        try:
            self.meet()
        except CollectiveMismatchError:
            pass  # the others raise it, naming this rank; this rank raises its own reason
        raise ShmArgumentError(reason)

    def meet(self) -> None:
        """The barrier; at a call's first one each rank has put what it is calling in its words
        (two banks, by the call's parity: a rank can be at most one call ahead of another there),
        and every rank compares them all. A disagreement raises CollectiveMismatchError on every
        rank, after the same barrier, so the group stays usable."""
        pending, self._pending = self._pending, None
        if pending is None:
            self.waiter.barrier()
            return
        bank = self._banks[self.calls & 1]  # bytes of (world_size, CALL_WORDS) int32
        self.calls += 1
        bank[self.rank * CALL_STRUCT.size:(self.rank + 1) * CALL_STRUCT.size] = pending
        self.waiter.barrier()
        # a rank whose peers are ahead never waits, so never sees the abort word while waiting:
        # look here, or it would run a collective the others gave up (a late rank's next call)
        self.waiter.check_abort()
        if bank.tobytes() != pending * self.size:  # bytes, not numpy: this is on every call's path
            raise CollectiveMismatchError(disagreement(self.waiter.what, self.rank, list(CALL_STRUCT.iter_unpack(bank))))

    def next_round(self) -> int:
        """The region of every slot the next round uses (0 to regions - 1, in turn; "half" below
        names it, as the default is the slot's two halves): a rank may fill the next round's
        region while a slower one still reads the last's. More regions (COLLECTIVES_SHM_REGIONS)
        write a region again only after its lines have left the peers' caches, which pays where
        handing lines between cores is slow (docs/shm.md)."""
        self.round += 1
        return self.round % self.regions

    def slot(self, rank: int, dtype: torch.dtype, numel: int, half: int) -> torch.Tensor:
        """`numel` elements of `dtype` at the start of half `half` of rank `rank`'s data slot."""
        slots = self._typed.get((dtype, half))
        if slots is None:
            slots = self._typed[(dtype, half)] = [
                self.segment.slot(q)[half * self.half:(half + 1) * self.half].view(dtype) for q in range(self.size)]
        return slots[rank][:numel]

    def _rounds(self, numel: int, itemsize: int, parts: int = 1):
        """Element ranges that fit half a slot (`parts` of them side by side in it)."""
        per = max(1, self.half // (itemsize * parts))
        return [(a, min(a + per, numel)) for a in range(0, numel, per)] or [(0, 0)]

    def all_reduce_path(self, nbytes: int) -> str:
        """How an all_reduce of nbytes goes: "small" (every rank adds every slot), "pieces" or
        "whole" (copies through the segment, step 3 in pieces or at once), "cma" (cma.py)."""
        if self.cma is not None and nbytes >= self.cma_min_bytes:
            return "cma"
        if nbytes <= self.small:
            return "small"
        return "whole" if self.piece_bytes >= self.half else "pieces"

    def all_reduce(self, flat: torch.Tensor, op: str) -> None:
        self.begin("all_reduce", flat, op)
        if self.all_reduce_path(flat.numel() * flat.element_size()) == "cma":
            # straight from and into the other ranks' tensors (cma.py): same steps, same order
            self.cma.all_reduce(flat, op, self.meet, self.piece_bytes, _sum,
                                rounds=self._rounds(flat.numel(), flat.element_size()))
        else:
            self._reduce(flat, op, copy_out=True)

    def reduce(self, flat: torch.Tensor, op: str, dst: int) -> None:
        self.begin("reduce", flat, op, root=dst)
        self._reduce(flat, op, copy_out=self.rank == dst)

    def _reduce(self, flat: torch.Tensor, op: str, copy_out: bool) -> None:
        """The module docstring's steps, round by round; copy_out: this rank takes the result."""
        p, r, dtype = self.size, self.rank, flat.dtype
        if flat.numel() * flat.element_size() <= self.small:
            h = self.next_round()
            self.slot(r, dtype, flat.numel(), h).copy_(flat)
            self.meet()
            if copy_out:  # every rank adds every slot, in rank order: the same bits everywhere
                n = flat.numel()
                flat.copy_(self.slot(0, dtype, n, h))
                for q in range(1, p):
                    local_reduce(flat, self.slot(q, dtype, n, h), op)
            return
        for a, b in self._rounds(flat.numel(), flat.element_size()):
            m, h = b - a, self.next_round()
            s, e = bounds(m, p)[r]
            slot = self.slot(r, dtype, m, h)
            # 1. copy in what the others reduce (this rank's own slice it reads from its tensor)
            if s > 0:
                slot[:s].copy_(flat[a:a + s])
            if e < m:
                slot[e:].copy_(flat[a + e:b])
            self.meet()
            # 3. this rank's slice: its own value first, then the others' in rank order, into
            # this rank's tensor in place when it takes the result (and from there into the
            # slot for the others): the sum is written where its inputs were just read, and
            # step 5 has one slice less to copy
            if e > s:
                mine = flat[a + s:a + e]
                others = [self.slot(q, dtype, m, h)[s:e] for q in range(p) if q != r]
                if copy_out:
                    self._sum_in_pieces(mine, mine, others, op, also=slot[s:e])
                else:
                    self._sum_in_pieces(slot[s:e], mine, others, op)
            self.meet()
            if copy_out:  # 5. every other slice from the slot of the rank that reduced it
                for q, (s, e) in enumerate(bounds(m, p)):
                    if e > s and q != r:
                        flat[a + s:a + e].copy_(self.slot(q, dtype, m, h)[s:e])

    def _sum_in_pieces(self, into: torch.Tensor, first: torch.Tensor, others, op: str, also=None) -> None:
        """_sum piece by piece (piece_bytes), each piece also copied into `also` while it is in cache."""
        if not others:  # a group of one: nothing to add
            if into.data_ptr() != first.data_ptr():
                into.copy_(first)
            if also is not None:
                also.copy_(into)
            return
        step = max(1, self.piece_bytes // into.element_size())
        for c in range(0, into.numel(), step):
            piece = into[c:c + step]
            _sum(piece, first[c:c + step], [src[c:c + step] for src in others], op)
            if also is not None:
                also[c:c + step].copy_(piece)

    def broadcast(self, flat: torch.Tensor, src: int) -> None:
        self.begin("broadcast", flat, root=src)
        for a, b in self._rounds(flat.numel(), flat.element_size()):
            h = self.next_round()
            if self.rank == src:
                self.slot(src, flat.dtype, b - a, h).copy_(flat[a:b])
            self.meet()
            if self.rank != src:
                flat[a:b].copy_(self.slot(src, flat.dtype, b - a, h))

    def all_gather(self, out: torch.Tensor, flat: torch.Tensor) -> None:
        """out (p * numel, flat) gets every rank's flat in rank order."""
        p, r, n = self.size, self.rank, flat.numel()
        self.begin("all_gather", flat)
        for a, b in self._rounds(n, flat.element_size()):
            h = self.next_round()
            self.slot(r, flat.dtype, b - a, h).copy_(flat[a:b])
            self.meet()
            for q in range(p):
                out[q * n + a:q * n + b].copy_(self.slot(q, flat.dtype, b - a, h))

    def reduce_scatter(self, out: torch.Tensor, flat: torch.Tensor, op: str) -> None:
        """out (numel / p) gets chunk `rank` of the reduction of every rank's flat."""
        p, r = self.size, self.rank
        c = flat.numel() // p
        self.begin("reduce_scatter", flat, op)
        # each round: the same piece of every chunk, side by side in the half-slot
        for a, b in self._rounds(c, flat.element_size(), parts=p):
            k, h = b - a, self.next_round()
            self.slot(r, flat.dtype, p * k, h).view(p, k).copy_(flat.view(p, c)[:, a:b])
            self.meet()
            # this rank's piece of every slot: its own first, then the others' in rank order
            pieces = [self.slot(q, flat.dtype, p * k, h).view(p, k)[r] for q in range(p)]
            self._sum_in_pieces(out[a:b], pieces[r], pieces[:r] + pieces[r + 1:], op)

    def monitored_barrier(self, timeout_s: Optional[float], wait_all_ranks: bool) -> None:
        """A barrier whose timeout (timeout_s, else the group's) names the ranks that did not
        reach it: the first of them, or all with wait_all_ranks (Gloo's monitoredBarrier)."""
        self.begin("monitored_barrier")
        self.next_round()
        saved = self.waiter.timeout_s
        self.waiter.timeout_s = saved if timeout_s is None else timeout_s
        try:
            self.meet()
        except PeerFailure as exc:
            late = [q for q in range(self.size) if q != self.rank and behind(int(self.segment.steps[q]), self.waiter.step)]
            if not late:
                raise
            named = late if wait_all_ranks else late[:1]
            raise PeerFailure(f"monitored_barrier on rank {self.rank}: rank{'s' if len(named) > 1 else ''} "
                              f"{', '.join(map(str, named))} did not reach it within {self.waiter.timeout_s:g} s "
                              f"({exc})") from exc
        finally:
            self.waiter.timeout_s = saved

    def barrier(self) -> None:
        self.begin("barrier")
        # a round like every other call's, though it moves no data: after a disagreement at the
        # first barrier every rank has then entered exactly one round and all stay on one half-slot
        self.next_round()
        self.meet()
