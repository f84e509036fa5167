"""send, recv and recv from any source on an shm group: messages through the pair mailboxes
(transport.py), moved by one thread per group so that a rank never blocks another.

torch's isend/irecv return at once, and a program may post a send and a receive before waiting
for either (a ring: every rank sends to the next and receives from the one before). A thread
that ran one message at a time could deadlock there (both ranks inside a send larger than a
mailbox, neither receiving), so every posted message is moved along together, as
ShmComm.wait_all does, until it is done; its Future then completes. Messages between a pair
arrive in the order they were posted; tags are not matched (a receive takes the next message
from its source, whatever its tag). recv_anysource takes the first message any rank has begun
to send to this one.

    engine = PointToPoint(backend)
    fut = engine.post("send", tensor, peer)      # a torch Future: done when the message is through
"""

from __future__ import annotations

import queue
import threading
import time
from typing import List, Optional, Tuple

import torch

from ..errors import CollectiveMismatchError
from .transport import ShmComm, Transfer
from . import futex
from .wait import FAULT_CHECK_S, ahead_by


class PointToPoint:
    def __init__(self, backend):
        self._backend = backend
        self._inbox: "queue.Queue" = queue.Queue()
        self._comm: Optional[ShmComm] = None
        self._thread: Optional[threading.Thread] = None
        self._idle = threading.Condition()
        self._posted = 0  # posted and not yet finished (guarded by _idle)

    def post(self, kind: str, tensor: torch.Tensor, peer: int) -> torch.futures.Future:
        """kind: "send", "recv" or "recv_any" (peer -1; the Future's value is the source rank)."""
        fut = torch.futures.Future()
        with self._idle:
            self._posted += 1
            if self._thread is None:
                self._comm = ShmComm(self._backend, drain=False, header=True)
                self._thread = threading.Thread(target=self._serve, daemon=True, name="shm-point-to-point")
                self._thread.start()
        self._inbox.put((kind, tensor, peer, fut))
        return fut

    def drain(self) -> None:
        """Until every posted message is through (or failed)."""
        with self._idle:
            self._idle.wait_for(lambda: self._posted == 0)

    # -- the thread ------------------------------------------------------------------------------
    def _done(self, fut: torch.futures.Future, value=None, error: Optional[BaseException] = None) -> None:
        if error is None:
            fut.set_result(value)
        else:
            fut.set_exception(error)
        with self._idle:
            self._posted -= 1
            self._idle.notify_all()

    def _any_source(self) -> int:
        """A rank with a message begun towards this one that no posted receive will take, or -1."""
        comm, seg = self._comm, self._comm.segment
        for q in range(comm.size):
            k = q * comm.size + comm.rank
            if q != comm.rank and ahead_by(int(seg.mail_sent[k]), int(seg.mail_taken[k])) > 0 and not comm._queues.get(k):
                return q
        return -1

    def _start(self, moving: list, kind: str, tensor: torch.Tensor, peer: int, fut: torch.futures.Future) -> None:
        """Post one message; an error in doing so fails its Future only."""
        try:
            self._comm.waiter.check_abort(kind.replace("_any", ""))
            moving.append((self._comm._post(kind, tensor, peer, None), fut, peer))
        except BaseException as exc:  # noqa: BLE001 - the thread serves the other messages on
            self._done(fut, error=exc)

    def _serve(self) -> None:
        comm = self._comm
        moving: List[Tuple[Transfer, torch.futures.Future, int]] = []
        waiting_any: List[Tuple[torch.Tensor, torch.futures.Future]] = []
        start, next_check = time.monotonic(), time.monotonic() + FAULT_CHECK_S
        while True:
            block = not moving and not waiting_any
            try:
                while True:
                    kind, tensor, peer, fut = self._inbox.get(block=block)
                    block = False
                    if kind == "recv_any":
                        waiting_any.append((tensor, fut))
                    else:
                        self._start(moving, kind, tensor, peer, fut)
                    start = time.monotonic()
            except queue.Empty:
                pass
            while waiting_any and (q := self._any_source()) >= 0:
                tensor, fut = waiting_any.pop(0)
                self._start(moving, "recv", tensor, q, fut)
            try:
                moved = comm._advance()
                comm.messages.clear()  # the algorithms' record of messages: not kept here
            except BaseException as exc:  # noqa: BLE001 - fails every message posted
                for _, fut, _ in moving:
                    self._done(fut, error=exc)
                moving = []
                continue
            still = []
            for transfer, fut, peer in moving:
                if transfer.finished:
                    self._done(fut, value=peer, error=CollectiveMismatchError(transfer.error) if transfer.error else None)
                else:
                    still.append((transfer, fut, peer))
            moving = still
            if moved or not (moving or waiting_any):
                continue
            now = time.monotonic()
            if now >= next_check:
                next_check = now + FAULT_CHECK_S
                try:
                    comm.waiter.what = "a point-to-point message"
                    first = moving[0][0].message if moving else None
                    peer = (first.src if first.dst == comm.rank else first.dst) if first else comm.rank
                    comm.waiter._check_peers(peer, now - start, late="did not complete it")  # native_p2p.h's words
                except BaseException as exc:  # noqa: BLE001
                    for _, fut, _ in moving:
                        self._done(fut, error=exc)
                    for _, fut in waiting_any:
                        self._done(fut, error=exc)
                    moving, waiting_any = [], []
                    continue
            if moving and futex.AVAILABLE:
                word, value = moving[0][0].blocking_word()
                futex.wait(comm.segment.address(word), value, 2e-4)  # 0.2 ms: then look at the inbox and the others again
            else:
                time.sleep(200e-6)
