"""A torch.distributed backend in Python: `dist.init_process_group("shm")` for ranks on one machine.

    import collectives.shm                      # registers "shm" with torch.distributed
    dist.init_process_group("shm", ...)         # or dist.new_group(ranks, backend="shm")
    torch.nn.parallel.DistributedDataParallel(model)   # torch's own DDP runs on it
    DeviceMesh.from_group(group, "cpu")         # and DTensor, fully_shard, the functional collectives

torch wraps the backend in its own ProcessGroup, as it does Gloo: the group has a name and
is registered under it, and every caller (Python, DDP's C++ reducer, the functional collectives)
reaches ShmBackend's method of the same name through a C++ Backend that forwards to it
(forward.cpp, built on first use: native.py). `backend_of(group)` is the ShmBackend of a group.

Every call runs in shared memory: broadcast, all_reduce, reduce, all_gather, reduce_scatter and
barrier (python_path.py; large all_reduces by cross-memory attach where it is turned on and the ranks
may, cma.py: `backend_of(group).cma_off_reason` says why not), gather, scatter and all_to_all (routing.py),
the coalesced forms (one call after another), monitored_barrier, and send/recv through the pair
mailboxes (point_to_point.py). The collectives run one after another on a worker thread, in the
order they were issued (the same on every rank), and each returns at once with a torch Future
that forward.cpp wraps in a Work, so DDP overlaps them with backward as it does with Gloo; small
calls with nothing queued before them run at once in the calling thread, since the hand-off to
the worker costs more than they do (on the native path, so does any call its caller waits for at
once; call_queue.py). How a group is made and found (create, new_group_with, backend_of): creator.py.
"""

from __future__ import annotations

import collections
import threading
from datetime import timedelta
from typing import Callable, List

import torch

from .. import reduce_ops
from ..dtypes import as_bytes
from . import cma, layout
from .call_queue import CallQueue
from .config import ShmConfig
from . import routing
from .arguments import overlap, unwritable, wrong_devices, wrong_list, wrong_op, wrong_sizes, wrong_splits
from .protocol import ShmArgumentError
from .state import GroupState
from .python_path import ShmCollectives
from .point_to_point import PointToPoint
from ..settings import SHM_FR_ENTRIES
from .recorder import Recorder
from .segment import Segment
from .wait import Waiter

# The settings (config.py) are read once per group. Calls up to inline_bytes run in the calling
# thread when nothing is queued: handing one to the worker thread costs more than the whole call.


def _op(opts) -> str:
    return reduce_ops.op_name(opts.reduceOp, "shm") if opts is not None else "sum"


def _reduced(op: str, size: int, run: Callable[[str], None], result: torch.Tensor, gets_result: bool = True) -> None:
    """Run a reduction with `op`, where "avg" is the one place it is handled: the ranks sum, and
    a rank that gets the result divides it by the group's size once (the order Gloo uses too)."""
    run("sum" if op == "avg" else op)
    if op == "avg" and gets_result:
        result.div_(size)


def _through_flat(t: torch.Tensor, run: Callable[[torch.Tensor], None], fresh: bool = False) -> None:
    """run(flat) on `t` as one flat contiguous tensor: `t`'s own memory when it is contiguous, else
    a contiguous copy (`fresh`: a new buffer, for an output that overlaps its input); the result is
    copied into `t` where `flat` is not `t`'s memory."""
    flat = t.new_empty(t.numel()) if fresh else t.view(-1) if t.is_contiguous() else t.contiguous().view(-1)
    run(flat)
    if flat.data_ptr() != t.data_ptr():
        t.copy_(flat.view_as(t))


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class ShmBackend:
    """One rank's side of an shm group: every method torch's Backend has, by the name forward.cpp
    calls, each checking its arguments and handing its job to its CallQueue's submit (call_queue.py),
    which returns a torch Future."""

    def __init__(self, store, rank: int, size: int, timeout: timedelta):
        self._rank, self._size = rank, size
        self.config = config = ShmConfig.from_env()
        # the same on every rank, or an error; cores: the CPUs the ranks may run on between them
        round_bytes, self._cores = layout.agree(store, rank, size, config, timeout)
        self._segment = Segment.create_or_attach(store, rank, size, config.slot_bytes, timeout=timeout,
                                                 mailbox_bytes=config.mailbox_bytes)
        self._waiter = Waiter(self._segment, rank, strategy=config.wait, timeout_s=timeout.total_seconds(),
                              cores=self._cores)
        self._shm = ShmCollectives(self._segment, rank, self._waiter, config, round_bytes)
        # cross-memory attach where every rank may read and write every other's memory, else why not
        self.cma_off_reason = cma.probe(self._segment, rank, self._waiter, config.cma)
        if not self.cma_off_reason:
            self._shm.cma = cma.CrossMemory(self._segment, rank, self._waiter)
        self._p2p = PointToPoint(self)
        # the flight record (recorder.py): TORCH_FR_BUFFER_SIZE entries (0: off); unset, on where it
        # costs nothing measurable (the native path records in C++), off on the Python path (+20%)
        self.recorder = Recorder.from_env(default=SHM_FR_ENTRIES if config.path == "native" else 0)
        self._engine = None  # the native path's engine (forward.cpp), once create() has made it
        self.state = GroupState(rank, size, config, self._cores, self._segment, self._shm, self._waiter,
                                self.recorder, lambda: self.calls.drain())
        # on the native path: the calls its engine did not take, which ran here, by collective
        # (docs/shm.md lists the forms it refuses); fallbacks() reads them
        self._to_python = collections.Counter()
        self.calls = CallQueue(self.state, self._p2p, self._to_python, python_path=config.path == "python")

    def use_engine(self, engine) -> None:
        """The native path's engine the creator made for this group: its calls run there."""
        self._engine = self.state.engine = engine

    @property
    def round_bytes(self) -> int:
        """The most a round of a large collective moves per slot (COLLECTIVES_SHM_ROUND_KB, layout.py)."""
        return self._shm.half

    @property
    def path(self) -> str:
        """Where this group's calls run: "native" (C++, forward.cpp's engine) or "python"."""
        return "native" if self._engine is not None else "python"

    def fallbacks(self) -> dict:
        """On the native path: how many calls of this group the engine did not take and the Python
        path ran, by collective ({"reduce_scatter": 3}); {} when every call ran in C++, and on a
        group on the Python path (where every call runs there by choice)."""
        return dict(self._to_python)

    def sleeps(self) -> dict:
        """How often this rank has slept in the kernel at a barrier of this group (futex waits,
        COLLECTIVES_SHM_WAIT=futex), and how many of those sleeps a peer's wake ended rather than
        the 50 ms fault-check timeout: {"slept": n, "woken": m}, both paths' waits together."""
        slept, woken = self._waiter.slept, self._waiter.woken
        if self._engine is not None:
            slept, woken = slept + self._engine.slept, woken + self._engine.woken
        return {"slept": slept, "woken": woken}

    def spins(self) -> dict:
        """How often this rank's waits at a barrier of this group spun, and how many of those
        spins reading the machine cut short (more runnable threads than the ranks' cores, wait.py):
        {"spun": n, "cut": m, "cores": the cores counted}, both paths' waits together."""
        spun, cut, cores = self._waiter.spun, self._waiter.spins_cut, self._waiter.machine_cores
        if self._engine is not None:
            native_spun, native_cut = self._engine.spins
            spun, cut, cores = spun + native_spun, cut + native_cut, self._engine.machine_cores
        return {"spun": spun, "cut": cut, "cores": cores}

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size

    # -- in shared memory ----------------------------------------------------------------------
    def allreduce(self, tensors: List[torch.Tensor], opts=None):
        op = _op(opts)
        why = wrong_devices(tensor=tensors) or unwritable(tensor=tensors) or wrong_op(op, "all_reduce", tensors)
        if why:
            return self.calls.refuse("all_reduce", why)

        def job():
            for t in tensors:
                _through_flat(t, lambda flat: _reduced(op, self.size(), lambda o: self._shm.all_reduce(flat, o), flat))
        return self.calls.submit("all_reduce", job, tensors, _nbytes(tensors))

    def broadcast(self, tensors: List[torch.Tensor], opts):
        why = wrong_devices(tensor=tensors) or ("" if self.rank() == opts.rootRank else unwritable(tensor=tensors))
        if why:
            return self.calls.refuse("broadcast", why)

        def job():
            for t in tensors:
                _through_flat(t, lambda flat: self._shm.broadcast(flat, opts.rootRank))
        return self.calls.submit("broadcast", job, tensors)

    def reduce(self, tensors: List[torch.Tensor], opts):
        op = _op(opts)
        why = wrong_devices(tensor=tensors) or unwritable(tensor=tensors) or wrong_op(op, "reduce", tensors)
        if why:
            return self.calls.refuse("reduce", why)

        def job():
            for t in tensors:
                _through_flat(t, lambda flat: _reduced(op, self.size(), lambda o: self._shm.reduce(flat, o, opts.rootRank),
                                                       flat, gets_result=self.rank() == opts.rootRank))
        return self.calls.submit("reduce", job, tensors)

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts=None):
        why = wrong_devices(output=output, input=input) or wrong_sizes(output, input, self.size(), "output", "input") \
            or unwritable(output=output)
        if why:
            return self.calls.refuse("all_gather", why)

        def job():
            _through_flat(output, lambda out: self._shm.all_gather(out, input.contiguous().view(-1)))
        return self.calls.submit("all_gather", job, [output], inputs=[input])

    _allgather_base = all_gather_single  # the names torch used before 2.13

    def allgather(self, output_tensors: List[List[torch.Tensor]], input_tensors: List[torch.Tensor], opts=None):
        why = wrong_devices(output_tensor_list=output_tensors, input=input_tensors) or next(
            (w for outs, inp in zip(output_tensors, input_tensors)
             for w in [wrong_list(outs, inp, self.size(), "output_tensor_list")] if w), "") \
            or unwritable(output_tensor_list=output_tensors)
        if why:
            return self.calls.refuse("all_gather", why)

        def job():
            for outs, inp in zip(output_tensors, input_tensors):
                flat = inp.contiguous().view(-1)
                joined = flat.new_empty(self.size() * flat.numel())
                self._shm.all_gather(joined, flat)
                for q, out in enumerate(outs):
                    out.copy_(joined[q * flat.numel():(q + 1) * flat.numel()].view_as(out))
        return self.calls.submit("all_gather", job, output_tensors, inputs=input_tensors)

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, opts=None):
        op = _op(opts)
        why = wrong_devices(output=output, input=input) or wrong_sizes(input, output, self.size(), "input", "output") \
            or unwritable(output=output) or wrong_op(op, "reduce_scatter", [input])
        if why:
            return self.calls.refuse("reduce_scatter", why)
        aliased = overlap(output, input)  # e.g. the output is this rank's chunk of the input

        def job():
            _through_flat(output, lambda out: _reduced(
                op, self.size(), lambda o: self._shm.reduce_scatter(out, input.contiguous().view(-1), o), out),
                fresh=aliased)
        return self.calls.submit("reduce_scatter", job, [output], inputs=[input])

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter(self, output_tensors: List[torch.Tensor], input_tensors: List[List[torch.Tensor]], opts=None):
        op = _op(opts)
        why = wrong_devices(output=output_tensors, input_list=input_tensors) or next(
            (w for out, ins in zip(output_tensors, input_tensors)
             for w in [wrong_list(ins, out, self.size(), "input_list")] if w), "") \
            or unwritable(output=output_tensors) or wrong_op(op, "reduce_scatter", output_tensors)
        if why:
            return self.calls.refuse("reduce_scatter", why)

        def job():
            for out, ins in zip(output_tensors, input_tensors):
                joined = torch.cat([t.reshape(-1) for t in ins])
                flat = out.new_empty(out.numel())
                _reduced(op, self.size(), lambda o: self._shm.reduce_scatter(flat, joined, o), flat)
                out.copy_(flat.view_as(out))
        return self.calls.submit("reduce_scatter", job, output_tensors, inputs=input_tensors)

    def barrier(self, opts=None):
        return self.calls.submit("barrier", self._shm.barrier, [])

    # -- routing: gather, scatter, all_to_all (routing.py) -----------------------------------------
    def _wrong_rooted(self, kind: str, one, one_name: str, listed, list_name: str, root: int, role: str) -> str:
        """What gather and scatter check alike: one tensor on every rank, and a list of one per
        rank like it at the root (`role`: "destination" or "source") and none elsewhere."""
        why = wrong_devices(**{one_name: one, list_name: listed}) or (
            f"it takes one {one_name} tensor" if len(one) != 1 else "")
        if not why and self.rank() == root:
            return wrong_list(listed, one[0], self.size(), list_name)
        if not why and listed:
            return f"{list_name} must be empty on rank {self.rank()}, which is not the {role} (rank {root})"
        return why

    def gather(self, output_tensors, input_tensors, opts):
        root, outs = opts.rootRank, output_tensors[0] if output_tensors else []
        why = self._wrong_rooted("gather", input_tensors, "input", outs, "gather_list", root, "destination") \
            or unwritable(gather_list=outs)
        if why:
            return self.calls.refuse("gather", why)
        inp = input_tensors[0]

        def job():
            staged = [t if t.is_contiguous() else t.new_empty(t.shape) for t in outs]
            routing.gather(self._shm, staged, inp.contiguous(), root)
            for t, s in zip(outs, staged):
                if s is not t:
                    t.copy_(s)
        return self.calls.submit("gather", job, outs, inputs=input_tensors)

    def scatter(self, output_tensors, input_tensors, opts):
        root, ins = opts.rootRank, input_tensors[0] if input_tensors else []
        why = self._wrong_rooted("scatter", output_tensors, "output", ins, "scatter_list", root, "source") \
            or unwritable(output=output_tensors)
        if why:
            return self.calls.refuse("scatter", why)
        out = output_tensors[0]

        def job():
            staged = out if out.is_contiguous() else out.new_empty(out.shape)
            routing.scatter(self._shm, staged, [t.contiguous() for t in ins], root)
            if staged is not out:
                out.copy_(staged)
        return self.calls.submit("scatter", job, output_tensors, inputs=ins)

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        why = wrong_devices(output=output, input=input) or wrong_splits(
            output, input, list(output_split_sizes), list(input_split_sizes), self.size()) or unwritable(output=output)
        if why:
            return self.calls.refuse("all_to_all", why)
        rows = lambda t, splits: list(splits) or [t.shape[0] // self.size()] * self.size()  # noqa: E731
        row_bytes = lambda t: t[0].numel() * t.element_size() if t.dim() and t.shape[0] else 0  # noqa: E731
        out_b = [n * row_bytes(output) for n in rows(output, output_split_sizes)]
        in_b = [n * row_bytes(input) for n in rows(input, input_split_sizes)]

        def job():
            staged = output if output.is_contiguous() else output.new_empty(output.shape)
            routing.all_to_all(self._shm, as_bytes(staged), as_bytes(input.contiguous()), out_b, in_b)
            if staged is not output:
                output.copy_(staged)
        return self.calls.submit("all_to_all", job, [output], inputs=[input])

    alltoall_base = all_to_all_single  # its name before torch 2.13

    def alltoall(self, output_tensors, input_tensors, opts=None):
        why = wrong_devices(output_tensor_list=output_tensors, input_tensor_list=input_tensors)
        for name, ts in (("output_tensor_list", output_tensors), ("input_tensor_list", input_tensors)):
            if not why and len(ts) != self.size():
                why = f"{name} has {len(ts)} tensors; it must have one per rank ({self.size()})"
        dtypes = {t.dtype for t in list(output_tensors) + list(input_tensors)}
        if not why and len(dtypes) > 1:
            why = f"the tensors must share one dtype, not {', '.join(sorted(map(str, dtypes)))}"
        why = why or unwritable(output_tensor_list=output_tensors)
        if why:
            return self.calls.refuse("all_to_all", why)
        out_b = [t.numel() * t.element_size() for t in output_tensors]
        in_b = [t.numel() * t.element_size() for t in input_tensors]

        def job():
            joined_in = torch.cat([as_bytes(t.contiguous()) for t in input_tensors])
            joined_out = torch.empty(sum(out_b), dtype=torch.uint8)
            routing.all_to_all(self._shm, joined_out, joined_in, out_b, in_b)
            at = 0
            for t, n in zip(output_tensors, out_b):
                t.copy_(joined_out[at:at + n].view(t.dtype).view(t.shape))
                at += n
        return self.calls.submit("all_to_all", job, output_tensors, inputs=input_tensors)

    # -- the coalesced forms: one call after another, in one job -------------------------------
    def allreduce_coalesced(self, tensors, opts=None):
        op = _op(opts)
        why = wrong_devices(tensors=tensors)
        if not why and len({t.dtype for t in tensors}) > 1:
            why = "the tensors must share one dtype, as Gloo's allreduce_coalesced requires"
        why = why or unwritable(tensors=tensors) or wrong_op(op, "all_reduce", tensors)
        if why:
            return self.calls.refuse("all_reduce", why)

        def job():
            flat = torch.cat([t.reshape(-1) for t in tensors]) if tensors else torch.empty(0)
            _reduced(op, self.size(), lambda o: self._shm.all_reduce(flat, o), flat)
            at = 0
            for t in tensors:
                t.copy_(flat[at:at + t.numel()].view_as(t))
                at += t.numel()
        return self.calls.submit("allreduce_coalesced", job, tensors, _nbytes(tensors))

    def allgather_coalesced(self, output_lists, input_list, opts=None):
        # output_lists[q][i]: rank q's input_list[i]; the list form of all_gather, per input
        if len(output_lists) != self.size() or any(len(outs) != len(input_list) for outs in output_lists):
            return self.calls.refuse("all_gather", f"output_tensor_lists must hold {self.size()} lists (one per rank) of "
                                f"{len(input_list)} tensors (one per input)")
        transposed = [[outs[i] for outs in output_lists] for i in range(len(input_list))]
        return self.allgather(transposed, input_list, opts)

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
        return self._coalesced(self.all_gather_single, outputs, inputs, opts)

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=None):
        return self._coalesced(self.reduce_scatter_single, outputs, inputs, opts)

    def _coalesced(self, call, outputs, inputs, opts) -> torch.futures.Future:
        """Each pair through `call`, in order; one Future for them all, done when all are, with the
        first error in order as it was raised (collect_all fails at the first error to come, and a
        `then` callback's error reaches the caller as a RuntimeError)."""
        futs = [call(o, i, opts) for o, i in zip(outputs, inputs)]
        outer, left, lock = torch.futures.Future(), [len(futs)], threading.Lock()

        def one_done(_):
            with lock:
                left[0] -= 1
                if left[0]:
                    return
            for f in futs:
                try:
                    f.value()
                except BaseException as exc:  # noqa: BLE001 - the pair's own error, type and all
                    outer.set_exception(exc)
                    return
            outer.set_result(outputs)
        if not futs:
            outer.set_result(outputs)
        for f in futs:
            f.add_done_callback(one_done)
        return outer

    # -- barriers --------------------------------------------------------------------------------
    def monitored_barrier(self, opts=None, wait_all_ranks: bool = False):
        """A barrier that, after opts.timeout, names the rank (wait_all_ranks: every rank) that did
        not reach it, as Gloo's does (torch's dist.monitored_barrier refuses every backend but
        Gloo: call the group's own, `group.monitored_barrier(timeout, wait_all_ranks)`)."""
        timeout = opts.timeout.total_seconds() if opts is not None and opts.timeout.total_seconds() > 0 else None

        def job():
            self._shm.monitored_barrier(timeout, wait_all_ranks)
        return self.calls.submit("barrier", job, [])

    # -- point to point (point_to_point.py) ------------------------------------------------------
    def _message(self, kind: str, tensors, peer: int, tag: int) -> torch.futures.Future:
        if len(tensors) != 1:
            why = f"it takes one tensor, not {len(tensors)}"
        else:
            why = wrong_devices(tensor=tensors) or ("" if tensors[0].is_contiguous() else "the tensor is not contiguous")
        if not why and peer == self.rank():
            why = f"rank {peer} is this rank"
        if not why and kind != "recv_any" and not 0 <= peer < self.size():
            why = f"rank {peer} is not in the group (its ranks are 0 to {self.size() - 1})"
        if why:
            fut = torch.futures.Future()
            fut.set_exception(ShmArgumentError(f"{kind} on rank {self.rank()} of the shm group: {why}"))
            return fut
        if self._engine is not None:  # the native path's messages did not take it (native_p2p.h)
            self._to_python[kind] += 1
        fut = self._p2p.post(kind, tensors[0], peer)
        if self.recorder is not None:
            # torchfrtrace's form: "send 0->1", "recv 1<-0" (group ranks; from any source: -1)
            name = f"send {self.rank()}->{peer}" if kind == "send" else f"recv {self.rank()}<-{peer}"
            entry = self.recorder.scheduled(name, tensors, tensors, p2p=True)
            self.recorder.started(entry)

            # the caller's Future completes after the record says so (a callback on the message's
            # own Future may run after the caller's wait returned); Future.then would wrap errors
            outer = torch.futures.Future()

            def completed(f):
                try:
                    value = f.value()
                except BaseException as exc:  # noqa: BLE001 - the message's error, type and all
                    outer.set_exception(exc)
                    return
                self.recorder.completed(entry)
                outer.set_result(value)
            fut.add_done_callback(completed)
            fut = outer
        return fut

    def send(self, tensors, dst: int, tag: int = 0):
        return self._message("send", tensors, dst, tag)

    def recv(self, tensors, src: int, tag: int = 0):
        return self._message("recv", tensors, src, tag)

    def recv_anysource(self, tensors, tag: int = 0):
        return self._message("recv_any", tensors, -1, tag)
