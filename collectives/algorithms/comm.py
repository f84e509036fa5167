"""The small transport interface every algorithm here is written against, and its two ends.

An algorithm is a generator run on every rank. It posts point-to-point messages and yields the
requests it must wait for; whatever runs it (real processes or the simulator) resumes it when
those have completed:

    def ring_all_gather(comm, out):
        ...
        sent = comm.send(out[a:b], right, chunk=k)      # posted now, returns a Request
        got = comm.recv(out[c:d], left, chunk=k - 1)
        yield sent, got                                  # wait for both
        comm.reduce(acc, tmp, "sum")                     # local work: acc op= tmp

Slices passed to send/recv are contiguous 1-d views of the caller's buffers. `chunk` labels the
message for the traces (which piece of the data it carries); `comm.step` counts the yields, so
every message is recorded with the step it belongs to.

The interface (Comm, Message) is collectives/p2p.py's. `DistComm` is the real end:
torch.distributed isend/irecv on a group (Gloo across processes and machines, NCCL on GPU), with
group ranks (CUDA tensors on Gloo go through host memory, as Gloo's own collectives do); on an
"shm" group the algorithms use that backend's mailboxes instead (collectives/shm/transport.py).
`run_on_ranks(algorithm, comm, *args)` drives a generator to the end on the calling rank. The
simulator (sim.py) is the other end.

DistComm posts a step's receives before its sends, whatever order the algorithm wrote them in:
a send is handed to torch when something is first waited on. Measured on two namespace hosts
linked at 1 Gbit/s (Gloo, 16 MiB each way, both ranks at once): isend then irecv on both ranks
moved 0.061 GB/s each way, irecv then isend 0.107 (0.120 one way): with the sends first, Gloo
carried the two directions one after the other (docs/algorithms.md, "Across hosts").
"""

from __future__ import annotations

import socket
import time
import weakref
from typing import Iterator, List, Optional

import torch
import torch.distributed as dist

from ..dtypes import as_bytes, moves_as_bytes
from ..p2p import Comm, Message, process_workspace


# process group -> host index of each of its ranks (DistComm.hosts); weak, so that it keeps no
# group alive after destroy_process_group (see collectives.checks.GroupInfo)
_hosts_of: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class _DistRequest:
    def __init__(self, work, message: Message, messages: List[Message], landed=None, flush=lambda: None):
        self.work, self.message, self.messages, self.landed = work, message, messages, landed
        self.flush = flush  # DistComm.flush: posts the sends not handed to torch yet (this one, if a send)

    def wait(self) -> None:
        self.flush()
        if self.work is not None:
            self.work.wait()
            self.work = None
            if self.landed is not None:  # a receive staged through host memory: copy it in
                self.landed()
            self.message.end = time.perf_counter()
            self.messages.append(self.message)


class DistComm(Comm):
    """torch.distributed point-to-point on `group` (None: the world), in group ranks.

    Messages are recorded in `self.messages` (seconds from perf_counter) for the traces.
    """

    def __init__(self, group: Optional[dist.ProcessGroup] = None, record: bool = True):
        self.group = group
        self.ranks = dist.get_process_group_ranks(group or dist.group.WORLD)
        self.rank = self.ranks.index(dist.get_rank())
        self.size = len(self.ranks)
        self.backend = str(dist.get_backend(group)).lower()
        self.record = record
        self.messages: List[Message] = []
        self._unposted: list = []  # (request, payload, peer) of sends not handed to torch yet

    def flush(self) -> None:
        """Hand every send not yet posted to torch (after the receives posted before it)."""
        if not self._unposted:
            return
        pending, self._unposted = self._unposted, []
        for request, payload, peer in pending:
            request.message.start = time.perf_counter()
            request.work = dist.isend(payload, self.ranks[peer], group=self.group)

    def _post(self, fn, tensor: torch.Tensor, peer: int, src: int, dst: int, chunk) -> _DistRequest:
        payload = as_bytes(tensor) if moves_as_bytes(self.backend, tensor.dtype, "send") else tensor
        landed = None
        if payload.is_cuda and self.backend != "nccl":
            # Gloo's send/recv take CPU tensors only (a CUDA one fails with "writev: Bad address"),
            # while its collectives stage CUDA tensors through host memory themselves: do the same.
            device_side, payload = payload, payload.cpu() if fn is dist.isend else torch.empty_like(payload, device="cpu")
            if fn is dist.irecv:
                def landed():
                    device_side.copy_(payload)
        message = Message(self.step, src, dst, tensor.numel() * tensor.element_size(), chunk, time.perf_counter(), 0.0)
        messages = self.messages if self.record else []
        if fn is dist.isend:  # posted at the first wait, after this step's receives
            request = _DistRequest(None, message, messages, landed, self.flush)
            self._unposted.append((request, payload, peer))
            return request
        return _DistRequest(fn(payload, self.ranks[peer], group=self.group), message, messages, landed, self.flush)

    def send(self, tensor, peer, chunk=None):
        return self._post(dist.isend, tensor, peer, self.rank, peer, chunk)

    def workspace(self, like, numel, slot="algorithm"):
        return process_workspace(like, numel, slot)

    def hosts(self) -> List[int]:
        """Every rank's host (by hostname), gathered once per group and kept: a collective on
        the group, so every rank of it must ask at the same point (an algorithm's first step)."""
        pg = self.group or dist.group.WORLD
        if pg not in _hosts_of:
            names = [None] * self.size
            dist.all_gather_object(names, socket.gethostname(), group=self.group)
            index = {}
            _hosts_of[pg] = [index.setdefault(name, len(index)) for name in names]
        return list(_hosts_of[pg])

    def recv(self, tensor, peer, chunk=None):
        return self._post(dist.irecv, tensor, peer, peer, self.rank, chunk)


def run_on_ranks(algorithm, comm: Comm, *args, **kwargs):
    """Drive `algorithm(comm, *args, **kwargs)` on this rank until it returns; its return value."""
    steps: Iterator = algorithm(comm, *args, **kwargs)
    wait_all = getattr(comm, "wait_all", None)  # a transport that moves its requests together
    try:
        while True:
            requests = next(steps)
            if wait_all is not None:
                wait_all(list(requests))
            else:
                for request in requests:
                    request.wait()
            comm.step += 1
    except StopIteration as done:
        flush = getattr(comm, "flush", None)
        if flush is not None:  # a send the algorithm never waited for still goes out
            flush()
        return done.value


def comm_for(group=None) -> Comm:
    """The transport for `group`: shared-memory mailboxes on an shm group, else DistComm."""
    pg = group or dist.group.WORLD
    if str(dist.get_backend(pg)).lower() == "shm":
        from ..shm import backend_of
        from ..shm.transport import ShmComm

        return ShmComm(backend_of(pg))
    return DistComm(group)
