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
"""

from __future__ import annotations

import dataclasses
from typing import Sequence, Tuple

from ..rates import link_rate
from .cost import CostModel

PAYLOAD_PER_FRAME = 1448 / 1514  # TCP payload per Ethernet frame at MTU 1500 (timestamps on)


def link_beta(rate: str) -> float:
    """Seconds per byte of payload over a link shaped to `rate` (see the module docstring)."""
    return 8 / (link_rate(rate) * PAYLOAD_PER_FRAME)


@dataclasses.dataclass(frozen=True)
class Topology:
    """Which host each rank is on, and what a message costs within a host and between hosts."""

    hosts: Tuple[int, ...]  # host index of each rank
    intra: CostModel
    inter: CostModel

    def __post_init__(self):
        if not self.hosts or any(not isinstance(h, int) or h < 0 for h in self.hosts):
            raise ValueError(f"hosts must list a host index (an int >= 0) for every rank, got {self.hosts!r}")

    @classmethod
    def flat(cls, size: int, model: CostModel) -> "Topology":
        """Every rank on one host: the single cost model."""
        return cls((0,) * size, model, model)

    @classmethod
    def two_level(cls, nodes: int, ranks_per_node: int, intra: CostModel, inter: CostModel) -> "Topology":
        """Ranks in blocks of ranks_per_node per host, as torchrun and srun number them."""
        if nodes < 1 or ranks_per_node < 1:
            raise ValueError(f"a topology needs at least 1 node and 1 rank per node, got {nodes} x {ranks_per_node}")
        return cls(tuple(r // ranks_per_node for r in range(nodes * ranks_per_node)), intra, inter)

    @classmethod
    def of_hosts(cls, hosts: Sequence[int], intra: CostModel, inter: CostModel) -> "Topology":
        return cls(tuple(hosts), intra, inter)

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
        """alpha + n beta of the link between the two ranks."""
        model = self.inter if self.crosses(src, dst) else self.intra
        return model.alpha + model.beta * nbytes
