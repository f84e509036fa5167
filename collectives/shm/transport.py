"""Point-to-point messages in shared memory: the transport the from-scratch algorithms run on
when their group is an shm group (collectives.algorithms picks it by itself).

Every ordered pair (src, dst) has a mailbox in the segment with two halves and two counters:
`sent` (pieces put in, written only by src) and `taken` (pieces taken out, written only by dst).
A message goes through in pieces of half a mailbox: src may put piece i in half i % 2 while
sent - taken < 2; dst may take it while sent > taken. One writer per word: no atomics. Messages
between a pair go in the order they were posted, as with any transport.

Waiting for a set of requests (`wait_all`) moves every posted message along, not only the ones
waited for, so two ranks that exchange large messages at once both make progress; when nothing
moves it sleeps on the counter that would let the first waited request move (futex), after a
short spin while every rank has a core, and checks the peers' liveness as the barriers do.

    comm = ShmComm(backend)             # an shm group's ShmBackend: its segment and waiter; group ranks
    A.all_reduce(t, group=shm_group, algorithm="ring")   # uses it
"""

from __future__ import annotations

import time
from collections import deque
from typing import Deque, Dict, List

import torch

from ..p2p import Comm, Message, process_workspace
from ..dtypes import as_bytes
from .segment import MAIL_SENT0, MAIL_TAKEN0
from . import futex
from .wait import FAULT_CHECK_S, after, ahead_by

HEADER_BYTES = 8  # a point-to-point message's length in bytes (int64), ahead of its payload


class Transfer:
    """One message, moved piece by piece through its pair's mailbox. With `header` (the user's
    send/recv, point_to_point.py) the message starts with its length, so that a receive into a
    tensor of another size is an error: the receiver takes the whole message out of the mailbox,
    writes none of it, and names both sizes (`error`); the pair stays in step. The algorithms'
    messages (every rank computes both sides' sizes) go without it."""

    __slots__ = ("kind", "pair", "bytes", "done", "message", "comm", "total", "header", "error")

    def __init__(self, comm: "ShmComm", kind: str, tensor: torch.Tensor, peer: int, chunk, header: bool = False):
        src, dst = (comm.rank, peer) if kind == "send" else (peer, comm.rank)
        self.kind, self.pair, self.comm = kind, src * comm.size + dst, comm
        self.bytes = as_bytes(tensor)
        self.header, self.error = header, None
        self.total = self.bytes.numel() + (HEADER_BYTES if header else 0)  # bytes through the mailbox
        self.done = 0
        self.message = Message(comm.step, src, dst, self.bytes.numel(), chunk, time.perf_counter(), 0.0)

    @property
    def finished(self) -> bool:
        return self.done >= self.total

    def _put(self, piece: torch.Tensor) -> None:
        """Fill a mailbox half with the message's next len(piece) bytes (its header first)."""
        start = self.done - (HEADER_BYTES if self.header else 0)
        if start < 0:  # the first piece of a message with a header
            piece[:HEADER_BYTES].copy_(torch.tensor([self.bytes.numel()], dtype=torch.int64).view(torch.uint8))
            piece, start = piece[HEADER_BYTES:], 0
        piece.copy_(self.bytes[start:start + piece.numel()])

    def _read_header(self, header: torch.Tensor) -> None:
        """The sender's length: another size than this rank's tensor makes the receive an error,
        and the sender's pieces are taken out and dropped (the pair stays in step)."""
        sent = int(header.view(torch.int64)[0])
        if sent != self.bytes.numel():
            src = self.pair // self.comm.size
            self.error = (f"recv on rank {self.comm.rank} of the shm group: rank {src} sent {sent} bytes, "
                          f"and this rank's tensor holds {self.bytes.numel()} bytes; nothing was written "
                          "into it (the message was taken out, so the next one arrives in order)")
            self.total = HEADER_BYTES + sent

    def _take(self, piece: torch.Tensor) -> None:
        """Take the message's next len(piece) bytes out of a mailbox half (past its header)."""
        start = self.done - (HEADER_BYTES if self.header else 0)
        if start < 0:
            piece, start = piece[HEADER_BYTES:], 0
        if self.error is None:
            self.bytes[start:start + piece.numel()].copy_(piece)

    def progress(self) -> bool:
        """Move as many pieces as the mailbox allows now; True if any moved."""
        seg, k, moved = self.comm.segment, self.pair, False
        box = seg.mailbox(k // seg.world_size, k % seg.world_size)
        half_bytes = seg.mailbox_bytes // 2
        while not self.finished:
            sent, taken = int(seg.mail_sent[k]), int(seg.mail_taken[k])
            if self.kind == "send":
                if ahead_by(sent, taken) >= 2:
                    break
                n = min(half_bytes, self.total - self.done)
                half = sent % 2
                self._put(box[half * half_bytes:half * half_bytes + n])
                seg.mail_sent[k] = after(sent)  # int32 counts: they wrap (wait.py)
                word = MAIL_SENT0 + k
            else:
                if ahead_by(sent, taken) <= 0:
                    break
                half = taken % 2
                if self.header and self.done == 0:  # the sender's length decides the pieces' sizes
                    self._read_header(box[half * half_bytes:half * half_bytes + HEADER_BYTES])
                n = min(half_bytes, self.total - self.done)
                self._take(box[half * half_bytes:half * half_bytes + n])
                seg.mail_taken[k] = after(taken)
                word = MAIL_TAKEN0 + k
            if futex.AVAILABLE:
                futex.wake(seg.address(word))
            self.done += n
            moved = True
        if self.finished and not self.message.end:
            self.message.end = time.perf_counter()
            self.comm.messages.append(self.message)
        return moved

    def blocking_word(self):
        """(control word, the value it has now) that must change for this transfer to move."""
        seg, k = self.comm.segment, self.pair
        word = MAIL_TAKEN0 + k if self.kind == "send" else MAIL_SENT0 + k
        return word, int(seg.control[word])

class ShmComm(Comm):
    """The algorithms' transport over an shm group's mailboxes (group ranks)."""

    def __init__(self, process_group, drain: bool = True, header: bool = False):
        """process_group: the group's ShmBackend; drain: wait for its calls issued before (the
        point-to-point engine itself does not); header: every message carries its length (the
        engine's, for the user's send/recv)."""
        state = process_group.state  # state.GroupState
        if state.segment.mail is None:
            raise ValueError("shm mailboxes exist for groups of at most 64 ranks")
        if drain:
            state.drain()  # the group's own calls issued before come first
        self.segment, self.waiter = state.segment, state.waiter
        self.rank, self.size = process_group.rank(), process_group.size()
        self.header = header
        self.messages: List[Message] = []
        self._queues: Dict[int, Deque[Transfer]] = {}  # pair -> transfers in posting order

    def _post(self, kind, tensor, peer, chunk) -> Transfer:
        transfer = Transfer(self, kind, tensor, peer, chunk, self.header)
        if transfer.finished:  # an empty message: nothing to send, on either side
            return transfer
        self._queues.setdefault(transfer.pair, deque()).append(transfer)
        self._advance()
        return transfer

    def send(self, tensor, peer, chunk=None):
        return self._post("send", tensor, peer, chunk)

    def recv(self, tensor, peer, chunk=None):
        return self._post("recv", tensor, peer, chunk)

    def workspace(self, like, numel, slot="algorithm"):
        return process_workspace(like, numel, slot)

    def _advance(self) -> bool:
        """Move the first message of every pair as far as it goes; True if anything moved."""
        moved = False
        for queue in self._queues.values():
            while queue:
                moved |= queue[0].progress()
                if not queue[0].finished:
                    break
                queue.popleft()
        return moved

    def wait_all(self, requests) -> None:
        pending = [r for r in requests if not r.finished]
        start = time.monotonic()
        next_check = start + FAULT_CHECK_S
        spin_until = time.perf_counter() + self.waiter.spin_s_idle
        while pending:
            if self._advance():
                spin_until = time.perf_counter() + self.waiter.spin_s_idle
            pending = [r for r in pending if not r.finished]
            if not pending:
                return
            now = time.monotonic()
            if now >= next_check:
                self.waiter.what = "a point-to-point message"
                first = pending[0].message
                self.waiter._check_peers(first.src if first.dst == self.rank else first.dst, now - start)
                next_check = now + FAULT_CHECK_S
            if time.perf_counter() >= spin_until and futex.AVAILABLE:
                queue = self._queues.get(pending[0].pair)
                word, value = (queue[0] if queue else pending[0]).blocking_word()
                futex.wait(self.segment.address(word), value, 1e-3)  # 1 ms: then move the others along again
