"""Cross-memory attach: an all_reduce that reads the other ranks' tensors and writes the sums
straight back into them (process_vm_readv / process_vm_writev), instead of copying everything
in and out of the segment.

all_reduce on p ranks, rank r owns slice r of every round of every rank's tensor (the element
ranges the segment would take in turn, python_path.py's rounds; so each element has the owner, and the
sum the bits, it would have there):

    0. every rank puts its tensor's address in its word of the segment; barrier (the call's
       agreement check, as for every call: a disagreement raises before anyone reads)
    1. piece by piece through its slices: read the piece from every other rank's tensor, add
       (its own value first, then the others in rank order: python_path.py's order, so the same bits),
       write the sum into every other rank's tensor
    2. barrier: every rank has written into every other

Memory moved per rank: read n, write n (its own slice and the others'), against 4-4.5 n through
the segment (ops.all_reduce_traffic). The kernel copies between the two address spaces itself,
pinning each page as it goes, so a byte costs more CPU than a memcpy's: it pays for large
tensors, where the segment's copies no longer stay in cache (benchmarks.studies.shm_paths measures it).

When it is used: Linux lets one process read and write another's memory this way only if it
may ptrace it: same user, no seccomp filter refusing the calls (some container runtimes), and
under Yama's ptrace_scope 1 (Ubuntu's default) only its own descendants, which sibling ranks are
not. At start-up every rank tries both calls on every other rank (probe); the ranks use them only
if all of them succeeded, else every call goes through the segment, with the same results. It is
also off where ranks outnumber cores: the kernel's copies cost more CPU than memcpy's, and there
the CPU is what the ranks lack (measured slower at 4 ranks on 2 cores). It is off by default
(COLLECTIVES_SHM_CMA=0): where it could be on, the segment in 1 MiB rounds (python_path.py) measured
faster at every size on the native path (benchmarks/RESULTS.md, "Why are the shm backend's defaults what they are?"). =auto turns it on where the
ranks have cores and the calls work, =1 wherever the calls work; `group.cma_off_reason` says why
it is off ("" when on).

Faults: a rank writes into the others only between the call's two barriers, and holds its
`writing` word meanwhile. A rank that leaves a call with an error first waits until no live rank
is writing, so no write can land in memory its caller may already have freed; a writer checks
the abort word before each piece and learns of a dead peer from the calls (ESRCH), so it stops
within a piece.
"""

from __future__ import annotations

import ctypes
import errno
import os
import time
from typing import Callable, List, Tuple

import torch

from ..chunks import bounds
from ..machine import cpus
from ..errors import CollectiveError
from .segment import ABORT, Segment
from .wait import DIED, PeerFailure, Waiter, process_alive

# An all_reduce of at least ShmConfig.cma_min_bytes (16 MiB) goes through cross-memory attach;
# smaller ones through the segment, whose copies stay in the caches and beat the kernel's
# page-by-page copies (benchmarks.studies.shm_paths measures both).

_libc = ctypes.CDLL(None, use_errno=True)


class _Iovec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


def _syscall(name: str):
    fn = getattr(_libc, name, None)  # glibc 2.15 and later, Linux only
    if fn is not None:
        fn.restype = ctypes.c_ssize_t
        fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_ulong]
    return fn


_READV, _WRITEV = _syscall("process_vm_readv"), _syscall("process_vm_writev")


class CrossMemory:
    """One rank's reads and writes of the other ranks' memory, on one segment (group ranks)."""

    def __init__(self, segment: Segment, rank: int, waiter: Waiter):
        self.segment, self.rank, self.waiter = segment, rank, waiter
        self.size = segment.world_size
        self.pids = [int(pid) for pid in segment.pids]
        self._local, self._remote = _Iovec(), _Iovec()
        self._buffers: dict = {}  # (dtype, numel) -> a piece buffer per other rank

    # -- one transfer ----------------------------------------------------------------------------
    def move(self, write: bool, peer: int, local: int, remote: int, nbytes: int) -> None:
        """Copy nbytes from this rank's address `local` to `peer`'s address `remote` (write) or
        back (read); the kernel may move less than asked, so it goes on until all is moved."""
        fn, local_iov, remote_iov, done = (_WRITEV if write else _READV), self._local, self._remote, 0
        while done < nbytes:
            local_iov.iov_base, local_iov.iov_len = local + done, nbytes - done
            remote_iov.iov_base, remote_iov.iov_len = remote + done, nbytes - done
            got = fn(self.pids[peer], ctypes.byref(local_iov), 1, ctypes.byref(remote_iov), 1, 0)
            if got <= 0:
                err = ctypes.get_errno()
                what = f"{self.waiter.what or 'cross-memory attach'} on rank {self.rank}"
                if err == errno.ESRCH or not process_alive(self.pids[peer]):
                    self.waiter.abort(culprit=peer, why=DIED)
                    raise PeerFailure(f"{what}: rank {peer} (pid {self.pids[peer]}) died while this rank "
                                      f"{'wrote into' if write else 'read'} its memory")
                raise CollectiveError(f"{what}: process_vm_{'writev' if write else 'readv'} of {nbytes - done} bytes "
                                      f"{'into' if write else 'from'} rank {peer} failed: {os.strerror(err)}")
            done += got

    # -- the all_reduce --------------------------------------------------------------------------
    def all_reduce(self, flat: torch.Tensor, op: str, first_barrier: Callable[[], None], piece_bytes: int,
                   add: Callable[[torch.Tensor, torch.Tensor, List[torch.Tensor], str], None],
                   rounds: List[Tuple[int, int]]) -> None:
        """The module docstring's steps on a contiguous CPU tensor. `first_barrier` is the call's
        checked barrier; add(into, first, others, op) is ops._sum, the order every path adds in.
        `rounds`: the element ranges the segment would take in turn (python_path.py's _rounds); rank r
        reduces slice r of each, as it would there, so each element has the same first addend
        and the sums the same bits."""
        seg, r, p = self.segment, self.rank, self.size
        seg.addresses[r] = flat.data_ptr()
        first_barrier()
        addresses = [int(a) for a in seg.addresses]
        slices = [(a + s, a + e) for a, b in rounds for s, e in [bounds(b - a, p)[r]]]
        others = [q for q in range(p) if q != r]
        size = flat.element_size()
        step = max(1, piece_bytes // size)
        buffers = self._buffers.get((flat.dtype, step))
        if buffers is None:
            self._buffers.clear()  # one dtype and piece size at a time is enough to keep
            buffers = self._buffers[(flat.dtype, step)] = [torch.empty(step, dtype=flat.dtype) for _ in others]
        seg.writing[r] = 1
        try:
            pieces = [(c, min(step, e - c)) for s, e in slices for c in range(s, e, step)]
            for c, k in pieces:  # k elements from element c, of this rank's slice of a round
                if seg.control[ABORT]:  # another rank failed: stop writing into the others
                    self.waiter._check_peers(r, 0.0)
                for q, buf in zip(others, buffers):
                    self.move(False, q, buf.data_ptr(), addresses[q] + c * size, k * size)
                piece = flat[c:c + k]
                add(piece, piece, [buf[:k] for buf in buffers], op)
                for q in others:
                    self.move(True, q, piece.data_ptr(), addresses[q] + c * size, k * size)
            seg.writing[r] = 0
            self.waiter.barrier()
        except BaseException:
            seg.writing[r] = 0
            if not seg.control[ABORT]:
                self.waiter.abort()  # this rank failed: the others stop at their next piece
            self._wait_for_writers()
            raise

    def _wait_for_writers(self) -> None:
        """Until no other live rank is writing into this rank's memory (or the timeout)."""
        seg, deadline = self.segment, time.monotonic() + self.waiter.timeout_s
        while time.monotonic() < deadline:
            if not any(seg.writing[q] and process_alive(self.pids[q]) for q in range(self.size) if q != self.rank):
                return
            time.sleep(1e-4)


def probe(segment: Segment, rank: int, waiter: Waiter, mode: str = "auto") -> str:
    """"" on every rank if every rank can read and write every other rank's memory, else on every
    rank why not (naming the ranks that could not). Every rank of the group calls it once, at
    start-up (three barriers). mode: ShmConfig.cma ("auto", "1"/"on", "0"/"off")."""
    p, pid = segment.world_size, os.getpid()
    mark = torch.zeros(p, dtype=torch.int64)  # slot q: written by rank q
    mark[rank] = pid
    segment.addresses[rank] = mark.data_ptr()
    cores = cpus()
    why = (f"COLLECTIVES_SHM_CMA={mode}" if mode in ("0", "off") else
           "a group of one" if p == 1 else
           f"{p} ranks share {cores} cores: the kernel's copies take CPU the other ranks need (measured slower; "
           "COLLECTIVES_SHM_CMA=1 turns it on anyway)" if mode == "auto" and p > cores else
           "no process_vm_readv/writev in this C library" if _READV is None or _WRITEV is None else "")
    waiter.barrier()
    if not why:
        cm, seen, mine = CrossMemory(segment, rank, waiter), torch.zeros(1, dtype=torch.int64), torch.tensor([pid])
        try:
            for q in range(p):
                if q != rank:
                    address = int(segment.addresses[q])
                    cm.move(False, q, seen.data_ptr(), address + 8 * q, 8)
                    if int(seen) != cm.pids[q]:
                        raise CollectiveError(f"read {int(seen)} from rank {q}, not its pid {cm.pids[q]}")
                    cm.move(True, q, mine.data_ptr(), address + 8 * rank, 8)
        except CollectiveError as exc:
            why = str(exc).split(": ", 1)[-1]
    segment.cma_ok[rank] = 0 if why else 1
    waiter.barrier()  # every rank has tried, and said whether its reads and writes went through
    if not why:  # the writes of every rank whose calls went through must be here
        lost = [q for q in range(p) if q != rank and segment.cma_ok[q] and int(mark[q]) != int(segment.pids[q])]
        if lost:
            why = f"the writes of rank{'s' if len(lost) > 1 else ''} {', '.join(map(str, lost))} did not arrive"
            segment.cma_ok[rank] = 0
    waiter.barrier()
    failed = [q for q in range(p) if not segment.cma_ok[q]]
    if not failed:
        return ""
    return (f"rank{'s' if len(failed) > 1 else ''} {', '.join(map(str, failed))} cannot use it"
            + (f" (rank {rank}: {why})" if why else ""))
