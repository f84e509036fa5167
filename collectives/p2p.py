"""The point-to-point interface every from-scratch algorithm is written against: `Comm`, one
rank's end of a transport, and `Message`, one message as the traces show it.

Its ends: DistComm (torch.distributed isend/irecv, collectives/algorithms/comm.py), ShmComm
(the shm backend's mailboxes, collectives/shm/transport.py) and the simulator's (algorithms/sim.py).
This file sits below all three, so the algorithms and the backends never import each other.

    class MyComm(Comm):
        def send(self, tensor, peer, chunk=None): ...   # post, return a request with wait()
        def recv(self, tensor, peer, chunk=None): ...
"""

from __future__ import annotations

import dataclasses
from typing import List

import torch

from .reduce_ops import local_reduce


@dataclasses.dataclass
class Message:
    """One point-to-point message, as the traces show it."""

    step: int
    src: int  # group ranks
    dst: int
    nbytes: int
    chunk: object
    start: float  # seconds: when both sides had posted it (simulated), or when the sender posted it (real)
    end: float


class Comm:
    """One rank's end of a transport. Subclasses provide send, recv and the clock."""

    rank: int
    size: int
    step: int = 0

    def send(self, tensor: torch.Tensor, peer: int, chunk=None):
        raise NotImplementedError

    def recv(self, tensor: torch.Tensor, peer: int, chunk=None):
        raise NotImplementedError

    def reduce(self, dst: torch.Tensor, src: torch.Tensor, op: str) -> None:
        """dst = dst op src, elementwise, on this rank (in dst's dtype, as the backends do)."""
        local_reduce(dst, src, op)

    def hosts(self) -> List[int]:
        """The host of each rank, as indices 0, 1, ... in order of first appearance (the
        hierarchical algorithms group ranks by it). A transport within one machine (the shm
        mailboxes) has every rank on host 0; DistComm asks the ranks, the simulator its topology."""
        return [0] * self.size

    def workspace(self, like: torch.Tensor, numel: int, slot: str = "algorithm") -> torch.Tensor:
        """Scratch space of `numel` elements like `like`. Algorithms use the default slot; the
        public calls keep their copy of the input in another, so the two never overlap. (The
        simulator: a new tensor each time, since its ranks share one process.)"""
        return like.new_empty(numel)


_workspaces = {}


def process_workspace(like: torch.Tensor, numel: int, slot: str) -> torch.Tensor:
    """A scratch 1-d tensor of `numel` elements, like `like`, reused from call to call (one
    process is one rank, so one buffer per dtype and device serves every call in turn).

    Measured here: a fresh 32 MiB receive buffer per call made a 64 MiB ring all_reduce 1.5x
    slower than Gloo's (the first write to each new page costs a page fault; torch hands large
    CPU blocks back to the system). One buffer per (dtype, device, slot) is kept and grown, so
    the memory is paid once, up to the largest size used.
    """
    key = (like.dtype, like.device, slot)
    buf = _workspaces.get(key)
    if buf is None or buf.numel() < numel:
        buf = _workspaces[key] = torch.empty(max(numel, 1), dtype=like.dtype, device=like.device)
    return buf[:numel]
