"""A torch.distributed backend in Python: `dist.init_process_group("shm")` for ranks on one machine.

    import collectives.shm                      # registers "shm" with torch.distributed
    dist.init_process_group("shm", ...)         # or dist.new_group(ranks, backend="shm")
    torch.nn.parallel.DistributedDataParallel(model)   # torch's own DDP runs on it

ProcessGroupShm subclasses torch's ProcessGroup, so torch calls it for every collective, its
DDP included. broadcast, all_reduce, reduce, all_gather (list and single-tensor forms),
reduce_scatter (both forms) and barrier run in shared memory (ops.py; large all_reduces by
cross-memory attach where the ranks may, cma.py: `group.cma_off_reason` says why not); they run one after
another on a worker thread, in the order they were issued (the same on every rank), and each
call returns at once with a Work on a torch Future (ShmWork), so DDP overlaps them with backward
as it does with Gloo; small calls with nothing queued before them run at once in the calling
thread, since the hand-off to the worker costs more than they do. Everything else (gather, scatter, all_to_all, send/recv, the coalesced
forms Gloo has) goes to an inner Gloo group built from the same store, after the shared-memory work
already issued has finished; the first call of each says so in a warning.
"""

from __future__ import annotations

import queue
import threading
import warnings
from datetime import timedelta
from typing import Callable, List

import torch
import torch.distributed as dist

from .. import reduce_ops
from ..errors import CollectiveMismatchError
from . import cma
from .config import ShmConfig
from .arguments import overlap, wrong_devices, wrong_list, wrong_sizes
from .ops import ShmArgumentError, ShmCollectives
from .segment import Segment
from .wait import Waiter

# The settings (config.py), read once per group. The data slot per rank, 64 MiB, holds a 25 MiB
# DDP bucket in one round of each half; measured, ResNet-50's DDP step on 2 ranks took 0.904 and
# 0.874 of Gloo's time with 64 MiB slots, 0.930 and 0.910 with 16 MiB (pages are only allocated
# when touched). Calls up to inline_bytes run in the calling thread when nothing is queued: a
# hand-off to the worker thread costs tens of microseconds, more than the whole collective.


def _op(opts) -> str:
    return reduce_ops.op_name(opts.reduceOp, "shm") if opts is not None else "sum"


def _reduced(op: str, size: int, run: Callable[[str], None], result: torch.Tensor, gets_result: bool = True) -> None:
    """Run a reduction with `op`, where "avg" is the one place it is handled: the ranks sum, and
    a rank that gets the result divides it by the group's size once (the order Gloo uses too)."""
    run("sum" if op == "avg" else op)
    if op == "avg" and gets_result:
        result.div_(size)


class ShmWork(dist.Work):
    """A Work on a torch Future whose wait() raises the collective's error.

    (torch's own _create_work_from_future makes a Work whose wait() returns True even when the
    future holds an exception: measured on torch 2.13, a silent failure.)
    """

    def __init__(self, fut: torch.futures.Future):
        super().__init__()
        self._fut = fut

    def wait(self, timeout=None) -> bool:
        self._fut.wait()  # raises the collective's error, if it had one
        return True

    def get_future(self) -> torch.futures.Future:
        return self._fut

    def is_completed(self) -> bool:
        return self._fut.done()

    def is_success(self) -> bool:
        return self._fut.done()


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class ProcessGroupShm(dist.ProcessGroup):
    def __init__(self, store, rank: int, size: int, timeout: timedelta):
        super().__init__(rank, size)
        self.config = config = ShmConfig.from_env()
        self._segment = Segment.create_or_attach(store, rank, size, config.slot_bytes, timeout=timeout,
                                                 mailbox_bytes=config.mailbox_bytes)
        self._waiter = Waiter(self._segment, rank, strategy=config.wait, timeout_s=timeout.total_seconds())
        self._shm = ShmCollectives(self._segment, rank, self._waiter, config)
        # cross-memory attach where every rank may read and write every other's memory, else why not
        self.cma_off_reason = cma.probe(self._segment, rank, self._waiter, config.cma)
        if not self.cma_off_reason:
            self._shm.cma = cma.CrossMemory(self._segment, rank, self._waiter)
        self._gloo = dist.ProcessGroupGloo(dist.PrefixStore("shm-fallback/", store), rank, size, timeout)
        self._warned: set = set()
        self._queue: "queue.Queue" = queue.Queue()
        self._pending = 0
        self._idle = threading.Condition()
        threading.Thread(target=self._serve, daemon=True, name="shm-collectives").start()

    def getBackendName(self) -> str:
        return "shm"

    # -- the worker thread --------------------------------------------------------------------
    def _serve(self) -> None:
        while True:
            job, fut, value = self._queue.get()
            self._waiter.spin_s = 0.0  # the calling thread is computing (DDP's backward): do not take its core
            self._run(job, fut, value)
            with self._idle:
                self._pending -= 1
                self._idle.notify_all()

    def _run(self, job: Callable[[], None], fut: torch.futures.Future, value) -> None:
        """Run one collective; its error goes to whoever waits on the Work. Any error but a
        disagreement between the ranks' calls (which every rank raised at the same barrier, so
        the group is still usable) breaks the group on every rank (the abort word)."""
        try:
            job()
            fut.set_result(value)
        except (CollectiveMismatchError, ShmArgumentError) as exc:  # every rank raised at one barrier
            fut.set_exception(exc)
        except BaseException as exc:  # noqa: BLE001
            self._waiter.abort()
            fut.set_exception(exc)

    def _submit(self, job: Callable[[], None], value, nbytes: int = 0) -> dist.Work:
        fut = torch.futures.Future()
        with self._idle:
            inline = self._pending == 0 and nbytes <= self.config.inline_bytes
            if not inline:
                self._pending += 1
        if inline:  # nothing queued before it: run it here, no thread hand-off (small calls' latency)
            self._waiter.spin_s = self._waiter.spin_s_idle  # the caller waits anyway: spin a little first
            self._run(job, fut, value)
        else:
            self._queue.put((job, fut, value))
        return ShmWork(fut)

    def _refuse(self, kind: str, why: str) -> dist.Work:
        """A Work that raises ShmArgumentError naming the call, this rank and the argument, after
        meeting the other ranks at the call's first barrier (none of them waits for this one)."""
        reason = f"{kind} on rank {self.rank()} of the shm group: {why}; nothing was moved"
        return self._submit(lambda: self._shm.refuse(kind, reason), None)

    def _drain(self) -> None:
        with self._idle:
            self._idle.wait_for(lambda: self._pending == 0)

    def _fallback(self, name: str):
        if name not in self._warned:
            self._warned.add(name)
            warnings.warn(f"the shm backend has no {name} of its own: it goes through an inner Gloo group",
                          stacklevel=3)
        self._drain()  # keep the order in which the calls were made
        return self._gloo

    # -- in shared memory ----------------------------------------------------------------------
    def allreduce(self, tensors: List[torch.Tensor], opts=None):
        op = _op(opts)
        why = wrong_devices(tensor=tensors)
        if why:
            return self._refuse("all_reduce", why)

        def job():
            for t in tensors:
                flat = t.view(-1) if t.is_contiguous() else t.contiguous().view(-1)
                _reduced(op, self.size(), lambda o: self._shm.all_reduce(flat, o), flat)
                if flat.data_ptr() != t.data_ptr():
                    t.copy_(flat.view_as(t))
        return self._submit(job, tensors, _nbytes(tensors))

    def broadcast(self, tensors: List[torch.Tensor], opts):
        why = wrong_devices(tensor=tensors)
        if why:
            return self._refuse("broadcast", why)

        def job():
            for t in tensors:
                flat = t.contiguous().view(-1)
                self._shm.broadcast(flat, opts.rootRank)
                if flat.data_ptr() != t.data_ptr():
                    t.copy_(flat.view_as(t))
        return self._submit(job, tensors)

    def reduce(self, tensors: List[torch.Tensor], opts):
        op = _op(opts)
        why = wrong_devices(tensor=tensors)
        if why:
            return self._refuse("reduce", why)

        def job():
            for t in tensors:
                flat = t.contiguous().view(-1)
                _reduced(op, self.size(), lambda o: self._shm.reduce(flat, o, opts.rootRank), flat,
                         gets_result=self.rank() == opts.rootRank)
                if flat.data_ptr() != t.data_ptr():
                    t.copy_(flat.view_as(t))
        return self._submit(job, tensors)

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts=None):
        why = wrong_devices(output=output, input=input) or wrong_sizes(output, input, self.size(), "output", "input")
        if why:
            return self._refuse("all_gather", why)

        def job():
            out = output.contiguous().view(-1)
            self._shm.all_gather(out, input.contiguous().view(-1))
            if out.data_ptr() != output.data_ptr():
                output.copy_(out.view_as(output))
        return self._submit(job, [output])

    _allgather_base = all_gather_single  # the names torch used before 2.13

    def allgather(self, output_tensors: List[List[torch.Tensor]], input_tensors: List[torch.Tensor], opts=None):
        why = wrong_devices(output_tensor_list=output_tensors, input=input_tensors) or next(
            (w for outs, inp in zip(output_tensors, input_tensors)
             for w in [wrong_list(outs, inp, self.size(), "output_tensor_list")] if w), "")
        if why:
            return self._refuse("all_gather", why)

        def job():
            for outs, inp in zip(output_tensors, input_tensors):
                flat = inp.contiguous().view(-1)
                joined = flat.new_empty(self.size() * flat.numel())
                self._shm.all_gather(joined, flat)
                for q, out in enumerate(outs):
                    out.copy_(joined[q * flat.numel():(q + 1) * flat.numel()].view_as(out))
        return self._submit(job, output_tensors)

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, opts=None):
        op = _op(opts)
        why = wrong_devices(output=output, input=input) or wrong_sizes(input, output, self.size(), "input", "output")
        if why:
            return self._refuse("reduce_scatter", why)
        aliased = overlap(output, input)  # e.g. the output is this rank's chunk of the input

        def job():
            out = output.new_empty(output.numel()) if aliased else output.contiguous().view(-1)
            _reduced(op, self.size(), lambda o: self._shm.reduce_scatter(out, input.contiguous().view(-1), o), out)
            if out.data_ptr() != output.data_ptr():
                output.copy_(out.view_as(output))
        return self._submit(job, [output])

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter(self, output_tensors: List[torch.Tensor], input_tensors: List[List[torch.Tensor]], opts=None):
        op = _op(opts)
        why = wrong_devices(output=output_tensors, input_list=input_tensors) or next(
            (w for out, ins in zip(output_tensors, input_tensors)
             for w in [wrong_list(ins, out, self.size(), "input_list")] if w), "")
        if why:
            return self._refuse("reduce_scatter", why)

        def job():
            for out, ins in zip(output_tensors, input_tensors):
                joined = torch.cat([t.reshape(-1) for t in ins])
                flat = out.new_empty(out.numel())
                _reduced(op, self.size(), lambda o: self._shm.reduce_scatter(flat, joined, o), flat)
                out.copy_(flat.view_as(out))
        return self._submit(job, output_tensors)

    def barrier(self, opts=None):
        return self._submit(self._shm.barrier, [])

    # -- through the inner Gloo group ------------------------------------------------------------
    def gather(self, output_tensors, input_tensors, opts):
        return self._fallback("gather").gather(output_tensors, input_tensors, opts)

    def scatter(self, output_tensors, input_tensors, opts):
        return self._fallback("scatter").scatter(output_tensors, input_tensors, opts)

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts):
        return self._fallback("all_to_all").alltoall_base(output, input, output_split_sizes, input_split_sizes, opts)

    alltoall_base = all_to_all_single  # its name before torch 2.13

    def alltoall(self, output_tensors, input_tensors, opts):
        return self._fallback("all_to_all").alltoall(output_tensors, input_tensors, opts)

    def send(self, tensors, dst, tag):
        return self._fallback("send").send(tensors, dst, tag)

    def recv(self, tensors, src, tag):
        return self._fallback("recv").recv(tensors, src, tag)

    def recv_anysource(self, tensors, tag):
        return self._fallback("recv").recv_anysource(tensors, tag)

    def allreduce_coalesced(self, tensors, opts):
        return self._fallback("allreduce_coalesced").allreduce_coalesced(tensors, opts)

    def allgather_coalesced(self, output_lists, input_list, opts):
        return self._fallback("allgather_coalesced").allgather_coalesced(output_lists, input_list, opts)


def create(store, rank: int, size: int, timeout: timedelta) -> ProcessGroupShm:
    """The creator torch calls for init_process_group("shm") and new_group(backend="shm")."""
    return ProcessGroupShm(store, rank, size, timeout)
