"""Hierarchical all-reduce: reduce within each host, all-reduce across hosts, broadcast within.

On a cluster the links within a host are fast and the one between hosts slow. A ring over all
ranks sends 2(p-1)/p n bytes out of every rank, and with k ranks per host each step crosses
between hosts; here only one rank per host (its leader, the lowest rank on it) talks across,
and only once the host's data is one buffer. With 2 hosts of 2 ranks (r0, r1 | r2, r3):

    1. reduce within each host (binomial tree to the leader):   r1 -> r0        r3 -> r2
    2. all-reduce across the leaders (ring):                    r0 <-> r2      (n/2 each way, twice)
    3. broadcast within each host (binomial tree):              r0 -> r1        r2 -> r3

Costs, h hosts of k ranks (intra: alpha_i, beta_i; between hosts: alpha_e, beta_e):
    lg k (alpha_i + n beta_i + n gamma)                                    reduce within
    + 2(h-1) alpha_e + 2(h-1)/h n beta_e + (h-1)/h n gamma                 ring across
    + lg k (alpha_i + n beta_i)                                            broadcast within
against the flat ring's 2(p-1) (alpha_e + n/p beta_e) + ... when each step waits for the slow
link: with beta_e >> beta_i the hierarchy sends 2(h-1)/h n across instead of 2(p-1)/p n, 1.5x
less for 2 hosts of 2 ranks, and fewer latencies of the slow link. On one host it is a binomial
reduce then broadcast.

Which host a rank is on comes from comm.hosts() (DistComm: the ranks' hostnames, gathered once
per group; the simulator: its topology), or `hosts=[...]` (a host index per rank) to impose one:

    A.all_reduce(t, algorithm="hierarchical")                       # hosts by hostname
    A.simulate("all_reduce", "hierarchical", inputs, model=Topology.two_level(2, 2, fast, slow))
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import torch

from ..errors import CollectiveError
from ..p2p import Comm
from . import ring, tree


class SubComm(Comm):
    """The ranks `members` of `comm` (in that order) as a world of their own: rank i here is
    comm's rank members[i]. Messages go through `comm`, so they are recorded in its ranks and
    counted in its steps."""

    def __init__(self, comm: Comm, members: Sequence[int]):
        self.comm, self.members = comm, list(members)
        self.rank, self.size = self.members.index(comm.rank), len(self.members)

    @property
    def step(self) -> int:
        return self.comm.step

    def send(self, tensor, peer, chunk=None):
        return self.comm.send(tensor, self.members[peer], chunk)

    def recv(self, tensor, peer, chunk=None):
        return self.comm.recv(tensor, self.members[peer], chunk)

    def reduce(self, dst, src, op):
        self.comm.reduce(dst, src, op)

    def workspace(self, like, numel, slot="algorithm"):
        return self.comm.workspace(like, numel, slot)


def _check_hosts(hosts: Sequence[int], size: int) -> List[int]:
    if len(hosts) != size or any(not isinstance(h, int) or isinstance(h, bool) or h < 0 for h in hosts):
        raise CollectiveError(f"all_reduce (algorithm 'hierarchical'): hosts={list(hosts)!r} must give a host index "
                              f"(an int >= 0) for each of the {size} ranks")
    return list(hosts)


def all_reduce(comm, buf: torch.Tensor, op: str, hosts: Optional[Sequence[int]] = None):
    """Every rank's buf ends with the reduction: within, across, within (module docstring).

    Args:
        hosts: the host index of each rank (default: comm.hosts()); ranks of a host need not be
            adjacent, and hosts may hold different numbers of ranks.
    """
    hosts = _check_hosts(comm.hosts() if hosts is None else hosts, comm.size)
    mine = [r for r in range(comm.size) if hosts[r] == hosts[comm.rank]]
    leaders = list(dict.fromkeys(min(r for r in range(comm.size) if hosts[r] == h) for h in hosts))
    local = SubComm(comm, mine)
    yield from tree.reduce_binomial(local, buf, op, 0)  # the host's sum on its leader (its rank 0)
    if comm.rank == mine[0]:
        yield from ring.all_reduce(SubComm(comm, leaders), buf, op)
    yield from tree.broadcast_binomial(local, buf, 0)
