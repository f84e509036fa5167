"""The order an shm group's calls run in: each call of ShmBackend (process_group.py) is a job
handed to CallQueue._submit, which runs it at once in the calling thread, queues it for the group's
worker thread, or (on the native path) hands it to the native engine's queue, and returns a torch
Future that the job settles.

    fut = backend._submit("all_reduce", job, tensors, nbytes)   # what every ShmBackend call does
    backend._drain()                                             # until every call issued has run

The rules, in _submit's docstring: a small call with nothing queued before it runs in the caller
(the hand-off to the worker costs more than it does); a call made from a callback the worker thread
is running runs at once (torch's PowerSGD hook issues collectives there, and waits); every other
call runs on the worker thread, in the order issued, the same on every rank. A job's error goes to
whoever waits on its Future; any error but the ranks disagreeing breaks the group (the abort word).

A group's backend holds one CallQueue, made from the group's state (state.GroupState: its waiter,
its Python path's collectives, its recorder, its engine once made), its point-to-point engine
(point_to_point.py), and the counter of calls its native engine did not take.
"""

from __future__ import annotations

import queue
import threading
from typing import Callable

import torch

from ..errors import CollectiveMismatchError
from .protocol import ShmArgumentError


class CallQueue:
    """How a group's calls are run and settled: submit() each, drain() until all are done."""

    def __init__(self, state, p2p, fallbacks, python_path: bool):
        self.state, self.p2p, self.fallbacks = state, p2p, fallbacks
        self._queue: "queue.Queue" = queue.Queue()
        self._pending = 0
        self._idle = threading.Condition()
        self._worker_id = None
        if python_path:  # the native path's engine (creator.create) has its own thread
            worker = threading.Thread(target=self._serve, daemon=True, name="shm-collectives")
            worker.start()
            self._worker_id = worker.ident

    def _serve(self) -> None:
        threads = None
        while True:
            job, fut, value, issuer_threads = self._queue.get()
            self.state.waiter.spin_s = 0.0  # the calling thread is computing (DDP's backward): do not take its core
            if issuer_threads != threads:  # as the thread that issued it: a new thread starts with every core
                torch.set_num_threads(issuer_threads)  # (native_engine.h: Core::as_issuer says why)
                threads = issuer_threads
            self._run(job, fut, value)
            with self._idle:
                self._pending -= 1
                self._idle.notify_all()

    def _run(self, job: Callable[[], None], fut: torch.futures.Future, value) -> None:
        """Run one collective; its error goes to whoever waits on the Work."""
        self._ran(job, fut, value)()

    def _ran(self, job: Callable[[], None], fut: torch.futures.Future, value) -> Callable[[], None]:
        """Run one collective and return what settles its Future (which runs the Future's
        callbacks, and the collectives they issue). Any error but a disagreement between the
        ranks' calls (which every rank raised at the same barrier, so the group is still usable)
        breaks the group on every rank (the abort word)."""
        try:
            job()
            return lambda: fut.set_result(value)
        except (CollectiveMismatchError, ShmArgumentError) as exc:  # every rank raised at one barrier
            return lambda error=exc: fut.set_exception(error)  # bound now: `exc` is unbound after the clause
        except BaseException as exc:  # noqa: BLE001
            self.state.waiter.abort()
            return lambda error=exc: fut.set_exception(error)

    def submit(self, op: str, job: Callable[[], None], value, nbytes: int = 0, inputs=None,
                refusal: bool = False) -> torch.futures.Future:
        """Run `job` at once in this thread when nothing is queued and it is small, else on the
        worker thread; a Future with `value` when it is done. The flight record names it `op`, as
        Gloo names the call, with `inputs` (else `value`) as its inputs and `value` as its outputs.

        A call made by the worker thread itself comes from a callback of the Future it is
        completing (`fut.then(...)`: torch's PowerSGD hook all-reduces P there, and waits): it runs
        at once, before the calls queued behind. Queued, it would wait for the thread that waits
        for it. Run at once, every rank runs a callback's collectives right after the call they
        follow, whether that call ran in the caller or on the worker, so the ranks agree on the
        order (Gloo's worker threads give no such order: docs/powersgd.md)."""
        fut = torch.futures.Future()
        if self.state.engine is not None and not refusal:  # a native group's call that its engine did not take
            self.fallbacks[op] += 1
        if self.state.recorder is not None:  # the flight record (recorder.py): in torch's format
            job = self._recorded(job, op, value if inputs is None else inputs, value)
        if self.state.engine is not None:  # in the native engine's order, with its counters (forward.cpp)
            shm, waiter = self.state.collectives, self.state.waiter

            def run(round_, calls, step, spin_s):
                # the engine's counters in, the job, the counters back out; the engine settles the
                # Future after it has them back, so a callback's collective (torch's PowerSGD hook)
                # runs on the counters this call left, on either path
                shm.round, shm.calls, waiter.step, waiter.spin_s = round_, calls, step, spin_s
                settle = self._ran(job, fut, value)
                return shm.round, shm.calls, waiter.step, settle
            self.state.engine.submit_python(run, nbytes)
            return fut
        with self._idle:
            nested = threading.get_ident() == self._worker_id
            inline = nested or (self._pending == 0 and nbytes <= self.state.config.inline_bytes)
            if not inline:
                self._pending += 1
        if inline:  # nothing queued before it: run it here, no thread hand-off (small calls' latency)
            self.state.waiter.spin_s = self.state.waiter.spin_s_idle  # the caller waits anyway: spin a little first
            self._run(job, fut, value)
        else:
            self._queue.put((job, fut, value, torch.get_num_threads()))
        return fut

    def refuse(self, kind: str, why: str) -> torch.futures.Future:
        """A Work that raises ShmArgumentError naming the call, this rank and the argument, after
        meeting the other ranks at the call's first barrier (none of them waits for this one)."""
        reason = f"{kind} on rank {self.state.rank} of the shm group: {why}; nothing was moved"
        return self.submit(kind, lambda: self.state.collectives.refuse(kind, reason), None, refusal=True)

    def _recorded(self, job: Callable[[], None], op: str, inputs, outputs) -> Callable[[], None]:
        entry = self.state.recorder.scheduled(op, inputs, outputs)

        def run():
            self.state.recorder.started(entry)
            job()
            self.state.recorder.completed(entry)
        return run

    def drain(self) -> None:
        """Until every call issued so far, collective or point-to-point, has finished."""
        if self.state.engine is not None:
            self.state.engine.drain()
        with self._idle:
            self._idle.wait_for(lambda: self._pending == 0)
        self.p2p.drain()
        if self.state.engine is not None:
            self.state.engine.drain_messages()  # the native path's messages (native_p2p.h)
