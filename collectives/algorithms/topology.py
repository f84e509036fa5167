"""A two-level topology for the simulator: fast links within a host, a slower one between hosts.

One cost model (cost.CostModel) gives every pair of ranks the same alpha and beta; a cluster is
not like that. Here each rank lives on a host, a message between two ranks of one host costs the
`intra` model's alpha + n beta, and one between hosts the `inter` model's; every host also has
one network port each way, so messages leaving (or entering) one host take turns on it, as they
share its link (the ranks' own ports are busy as well, as on one host). Local reductions cost the
intra model's gamma.

    intra = CostModel.load()                                   # fitted on one host
    inter = CostModel(alpha=intra.alpha, beta=link_beta("1gbit"), gamma=intra.gamma)
    topo = Topology.two_level(nodes=2, ranks_per_node=2, intra=intra, inter=inter)
    Simulator(4, topo)                                         # ranks 0, 1 on host 0; 2, 3 on host 1

`link_beta(rate)` turns a link rate in tc's units into seconds per byte of payload: a TCP
segment carries 1448 bytes (MTU 1500 less 52 of IP and TCP headers with timestamps) in a frame
of 1514 that the shaper counts (the Ethernet header too), so payload moves at 1448/1514 of it.

A shaped link is a token bucket (tc tbf), not a pipe of one rate: a bucket that has filled while
the link was idle lets `burst` bytes through at the host's own speed before the rate binds.
`Topology(..., burst=B)` models that on each host's way out (the simulator keeps each host's
tokens); with the cluster's bucket (4 ms of the rate) a 1 MiB message across an idle 1 Gbit/s
link takes about 5 ms, not the 8.8 ms that the rate alone gives.

    Topology.two_level(2, 2, intra, inter, burst=link_burst("1gbit"))
"""

from __future__ import annotations

import dataclasses
from typing import Sequence, Tuple

from ..rates import burst, link_rate
from .cost import CostModel

PAYLOAD_PER_FRAME = 1448 / 1514  # TCP payload per Ethernet frame at MTU 1500 (timestamps on)


def link_beta(rate: str) -> float:
    """Seconds per byte of payload over a link shaped to `rate` (see the module docstring)."""
    return 8 / (link_rate(rate) * PAYLOAD_PER_FRAME)


def link_burst(rate: str) -> float:
    """Bytes of payload that the cluster's token bucket at `rate` lets through at once
    (rates.burst counts frames' bytes)."""
    return burst(rate) * PAYLOAD_PER_FRAME


@dataclasses.dataclass(frozen=True)
class Topology:
    """Which host each rank is on, and what a message costs within a host and between hosts."""

    hosts: Tuple[int, ...]  # host index of each rank
    intra: CostModel
    inter: CostModel
    burst: float = 0.0  # bytes of payload a host's idle link lets out at the intra beta (0: the rate alone)

    def __post_init__(self):
        if not self.hosts or any(not isinstance(h, int) or h < 0 for h in self.hosts):
            raise ValueError(f"hosts must list a host index (an int >= 0) for every rank, got {self.hosts!r}")
        if not self.burst >= 0:
            raise ValueError(f"burst is the bytes a token bucket holds (>= 0), got {self.burst!r}")

    @classmethod
    def flat(cls, size: int, model: CostModel) -> "Topology":
        """Every rank on one host: the single cost model."""
        return cls((0,) * size, model, model)

    @classmethod
    def two_level(cls, nodes: int, ranks_per_node: int, intra: CostModel, inter: CostModel,
                  burst: float = 0.0) -> "Topology":
        """Ranks in blocks of ranks_per_node per host, as torchrun and srun number them."""
        if nodes < 1 or ranks_per_node < 1:
            raise ValueError(f"a topology needs at least 1 node and 1 rank per node, got {nodes} x {ranks_per_node}")
        return cls(tuple(r // ranks_per_node for r in range(nodes * ranks_per_node)), intra, inter, burst)

    @classmethod
    def of_hosts(cls, hosts: Sequence[int], intra: CostModel, inter: CostModel, burst: float = 0.0) -> "Topology":
        return cls(tuple(hosts), intra, inter, burst)

    @property
    def size(self) -> int:
        return len(self.hosts)

    @property
    def gamma(self) -> float:
        return self.intra.gamma

    def crosses(self, src: int, dst: int) -> bool:
        """Whether a message from src to dst leaves its host."""
        return self.hosts[src] != self.hosts[dst]

    def seconds(self, src: int, dst: int, nbytes: int) -> float:
        """alpha + n beta of the link between the two ranks (the rate alone: no bucket)."""
        model = self.inter if self.crosses(src, dst) else self.intra
        return model.alpha + model.beta * nbytes

    def through_bucket(self, tokens: float, nbytes: int) -> Tuple[float, float]:
        """(seconds, tokens left) for a message of nbytes leaving a host whose bucket holds
        `tokens` bytes: while tokens last the bytes go at the intra beta and the bucket drains at
        that speed less the rate's; the rest goes at the rate (the inter beta). alpha on top."""
        fast, slow = self.intra.beta, self.inter.beta
        if tokens <= 0 or fast >= slow:
            return self.inter.alpha + slow * nbytes, 0.0
        drain = 1 / fast - 1 / slow  # bytes per second the bucket loses while bursting
        burst_bytes = tokens / drain / fast  # bytes sent before it runs dry
        if nbytes <= burst_bytes:
            return self.inter.alpha + fast * nbytes, tokens - nbytes * fast * drain
        return self.inter.alpha + fast * burst_bytes + slow * (nbytes - burst_bytes), 0.0

    def refill(self, tokens: float, seconds: float) -> float:
        """A bucket's tokens after `seconds` idle: the rate's bytes back, up to burst."""
        return min(self.burst, tokens + seconds / self.inter.beta)
