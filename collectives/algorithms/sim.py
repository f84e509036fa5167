"""Run any algorithm on many simulated ranks in one process, on a virtual clock.

Every rank runs the very same generator as on real processes (comm.py), with real tensors, so
the data really moves and the result can be checked; only time is modelled (alpha-beta-gamma):

- a message of n bytes takes alpha + n beta once both ends have posted it and the sender's
  outgoing port and the receiver's incoming port are free (each rank sends one message and
  receives one at a time: full duplex, one port);
- comm.reduce(dst, src) costs its rank gamma * bytes of dst.

Given a topology.Topology instead of one model, a message costs the alpha and beta of its link
(within a host or between hosts), and a message between hosts also waits for its hosts' network
ports (one each way per host, shared by the host's ranks), and, where the topology has a
burst, goes through its host's token bucket (topology.py); comm.hosts() tells the algorithms
which host each rank is on.

    sim = Simulator(64, CostModel(alpha=5e-6, beta=1e-10, gamma=2e-10))
    sim = Simulator(4, Topology.two_level(2, 2, intra=fast, inter=slow))     # two hosts of 2 ranks
    result = sim.run(ring.all_reduce, [(buf_of(r), "sum") for r in range(64)])
    result.time, result.messages            # seconds, and every message (step, src, dst, bytes, chunk, start, end)

A send without a matching receive (or the reverse) ends in `SimulationError` naming every
stuck rank and what it waits for, where real processes would hang; a receive of another size
than what was sent names both ends.
"""

from __future__ import annotations

import heapq
from collections import deque
from typing import Callable, Dict, List, NamedTuple, Optional, Sequence


from ..p2p import Comm, Message
from ..reduce_ops import local_reduce
from .topology import Topology


class SimulationError(RuntimeError):
    """The simulated ranks deadlocked, or a message's two ends disagree on its size."""


class _Request:
    __slots__ = ("kind", "rank", "peer", "tensor", "chunk", "step", "posted", "order", "done", "end")

    def __init__(self, kind, rank, peer, tensor, chunk, step, posted, order):
        self.kind, self.rank, self.peer, self.tensor, self.chunk = kind, rank, peer, tensor, chunk
        self.step, self.posted, self.order, self.done, self.end = step, posted, order, False, posted

    def describe(self) -> str:
        what = f"send to rank {self.peer}" if self.kind == "send" else f"receive from rank {self.peer}"
        return f"{what} ({self.tensor.numel() * self.tensor.element_size()} bytes, chunk {self.chunk}, step {self.step})"


class Compute(NamedTuple):
    """A local reduction on one rank, for the traces."""

    rank: int
    step: int
    nbytes: int
    start: float
    end: float


class SimComm(Comm):
    """One simulated rank's end."""

    def __init__(self, sim: "Simulator", rank: int):
        self.sim, self.rank, self.size, self.step = sim, rank, sim.size, 0

    def send(self, tensor, peer, chunk=None):
        return self.sim._post("send", self.rank, peer, tensor, chunk)

    def recv(self, tensor, peer, chunk=None):
        return self.sim._post("recv", self.rank, peer, tensor, chunk)

    def reduce(self, dst, src, op):
        local_reduce(dst, src, op)
        start = self.sim.clock[self.rank]
        self.sim.clock[self.rank] = start + self.sim.topology.gamma * dst.numel() * dst.element_size()
        self.sim.computes.append(Compute(self.rank, self.step, dst.numel() * dst.element_size(), start,
                                         self.sim.clock[self.rank]))

    def hosts(self):
        return list(self.sim.topology.hosts)


class SimResult(NamedTuple):
    time: float  # when the last rank finished, seconds
    clocks: List[float]  # when each rank finished
    messages: List[Message]
    computes: List[Compute]
    snapshots: Dict[int, List[object]]  # rank -> watch(rank) at the start and after each of its steps
    returns: List[object]  # each rank's generator's return value


class Simulator:
    """`size` simulated ranks under a cost model (cost.CostModel: alpha, beta, gamma), or a
    topology.Topology (a model within hosts, another between them)."""

    def __init__(self, size: int, model):
        if isinstance(model, Topology):
            if model.size != size:
                raise ValueError(f"the topology places {model.size} ranks, the simulator has {size}")
            self.topology = model
        else:
            self.topology = Topology.flat(size, model)
        self.size, self.model = size, model

    def _post(self, kind, rank, peer, tensor, chunk):
        if not 0 <= peer < self.size or peer == rank:
            raise SimulationError(f"rank {rank} posted a {kind} with peer {peer} (world size {self.size})")
        self._posts += 1
        request = _Request(kind, rank, peer, tensor, chunk, self.comms[rank].step, self.clock[rank], self._posts)
        if tensor.numel() == 0:  # an empty message is not sent at all (both ends agree on sizes)
            request.done = True
            return request
        key = (rank, peer) if kind == "send" else (peer, rank)  # (src, dst)
        mine, theirs = (self.sends, self.recvs) if kind == "send" else (self.recvs, self.sends)
        if theirs[key]:
            other = theirs[key].popleft()
            send, recv = (request, other) if kind == "send" else (other, request)
            # ties go to the send posted first: a rank's port takes its messages in the order it posted them
            heapq.heappush(self.ready, (max(send.posted, recv.posted), send.order, send, recv))
        else:
            mine[key].append(request)
        return request

    def run(self, algorithm: Callable, per_rank_args: Sequence[tuple], watch: Optional[Callable[[int], object]] = None,
            **kwargs) -> SimResult:
        """Run `algorithm(comm, *per_rank_args[r], **kwargs)` on every simulated rank to the end.

        Args:
            algorithm: a generator function written against comm.Comm.
            per_rank_args: one tuple of arguments per rank (its buffers, op, root, ...).
            watch: called with the rank after each of that rank's steps; what it returns is kept
                in result.snapshots (the step table summarises the rank's buffer this way).
        """
        p = self.size
        self.clock = [0.0] * p
        self.comms = [SimComm(self, r) for r in range(p)]
        self.sends, self.recvs = _Lazy(), _Lazy()  # (src, dst) -> posted requests not yet matched, in order
        self.ready, self._posts = [], 0
        self.computes: List[Compute] = []
        self._messages: List[Message] = []
        self._out_free, self._in_free = [0.0] * p, [0.0] * p  # when each rank's link is free to send, to receive
        hosts = max(self.topology.hosts) + 1
        self._nic_out, self._nic_in = [0.0] * hosts, [0.0] * hosts  # the same for each host's network port
        self._tokens = [self.topology.burst] * hosts  # each host's token bucket on its way out, at _nic_out's time
        self._gens = [algorithm(self.comms[r], *per_rank_args[r], **kwargs) for r in range(p)]
        self._waiting: List[Optional[list]] = [None] * p
        self._returns: List[object] = [None] * p
        self._watch = watch
        self._snapshots: Dict[int, List[object]] = {r: [] for r in range(p)} if watch is not None else {}
        self._finished = 0
        runnable = deque(range(p))
        while True:
            while runnable:
                self._advance(runnable.popleft())
            if not self.ready:
                break
            runnable.extend(self._deliver_next())
        if self._finished < p:
            stuck = [f"  rank {r} waits for: " + "; ".join(q.describe() for q in self._waiting[r] if not q.done)
                     for r in range(p) if self._waiting[r] is not None]
            raise SimulationError(f"deadlock: {p - self._finished} of {p} rank(s) can never go on (on real processes "
                                  "they would hang):\n" + "\n".join(stuck))
        return SimResult(max(self.clock), list(self.clock), self._messages, self.computes, self._snapshots,
                         self._returns)

    def _advance(self, r: int) -> None:
        """Run rank r until it waits for something not yet done, or returns."""
        while True:
            try:
                requests = list(next(self._gens[r]))
            except StopIteration as stop:
                self._returns[r] = stop.value
                self._finished += 1
                if self._watch is not None:
                    self._snapshots[r].append(self._watch(r))
                return
            if self._watch is not None:  # the state after the previous step's local work (first: the start)
                self._snapshots[r].append(self._watch(r))
            if all(q.done for q in requests):
                self._resume(r, requests)
                continue
            self._waiting[r] = requests
            return

    def _deliver_next(self) -> List[int]:
        """Deliver the message that can start first (both sides posted, both links free); the ranks
        it lets go on."""
        ready, _, send, recv = heapq.heappop(self.ready)
        src, dst = send.rank, recv.rank
        nbytes = send.tensor.numel() * send.tensor.element_size()
        if recv.tensor.numel() * recv.tensor.element_size() != nbytes or recv.tensor.dtype != send.tensor.dtype:
            raise SimulationError(f"rank {src} sent {nbytes} bytes of {send.tensor.dtype} to rank {dst} (chunk "
                                  f"{send.chunk}, step {send.step}), which posted a receive of "
                                  f"{recv.tensor.numel() * recv.tensor.element_size()} bytes of {recv.tensor.dtype} "
                                  f"(chunk {recv.chunk}, step {recv.step})")
        start = max(ready, self._out_free[src], self._in_free[dst])
        crosses = self.topology.crosses(src, dst)
        if crosses:
            out_host, in_host = self.topology.hosts[src], self.topology.hosts[dst]
            start = max(start, self._nic_out[out_host], self._nic_in[in_host])
        if crosses and self.topology.burst:
            tokens = self.topology.refill(self._tokens[out_host], start - self._nic_out[out_host])
            seconds, self._tokens[out_host] = self.topology.through_bucket(tokens, nbytes)
        else:
            seconds = self.topology.seconds(src, dst, nbytes)
        end = start + seconds
        self._out_free[src] = self._in_free[dst] = end
        if crosses:
            self._nic_out[out_host] = self._nic_in[in_host] = end
        recv.tensor.copy_(send.tensor)
        send.done = recv.done = True
        send.end = recv.end = end
        self._messages.append(Message(send.step, src, dst, nbytes, send.chunk, start, end))
        woken = []
        for rank in (src, dst):
            if self._waiting[rank] is not None and all(q.done for q in self._waiting[rank]):
                self._resume(rank, self._waiting[rank])
                self._waiting[rank] = None
                woken.append(rank)
        return woken

    def _resume(self, rank, requests):
        if requests:
            self.clock[rank] = max([self.clock[rank]] + [q.end for q in requests])
        self.comms[rank].step += 1


class _Lazy(dict):
    """A dict of deques made on first use (p*p empty deques would cost too much at 1024 ranks)."""

    def __missing__(self, key):
        value = self[key] = deque()
        return value
