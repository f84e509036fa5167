"""How the algorithms race predicts its times: the ranks' topology (one host: the fitted cost
model's closed forms; several: a two-level topology with the link between hosts as a token
bucket), the ranks' share of the cores, and the predicted seconds of one call.

    topology = topology_of(hosts, CostModel.load(), "1gbit", share=cpu_share())
    seconds = predict("all_reduce", "ring", count, n, torch.float32, model, topology)

Read by benchmarks.algorithms (beside each measured time) and benchmarks.studies.race_ablation (the same
measurements predicted with parts of the model left out).
"""

from __future__ import annotations

import socket

import torch
import torch.distributed as dist

import collectives.algorithms as A
from collectives.machine import cpus
from collectives.algorithms.cost import CostModel
from collectives.algorithms.topology import Topology, link_beta, link_burst


def cpu_share() -> float:
    """Ranks per core on this rank's machine, at least 1: ranks that share one kernel (the same
    boot_id: the cluster's namespace hosts are one machine) share its cores. A collective."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            machine = f.read().strip()
    except OSError:
        machine = socket.gethostname()
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, machine)
    cores = cpus()
    return max(1.0, everyone.count(machine) / cores)


def topology_of(hosts, model: CostModel, link, burst=None, share: float = 1.0):
    """The two-level topology of these ranks (None on one host: the closed forms apply): the
    model within a host, and between hosts the link's rate through a token bucket of `burst`
    bytes of payload (None: the cluster's bucket at that rate); alpha, beta and gamma scaled for
    `share` ranks per core (CostModel.sharing; the link's rate is not CPU time)."""
    if len(set(hosts)) == 1:
        if link is not None:
            raise SystemExit(f"benchmarks.algorithms: --link {link} is the rate between hosts, but all {len(hosts)} ranks "
                             "are on one host: leave --link out (or start the ranks on several hosts)")
        return None
    if link is None:
        raise SystemExit(f"benchmarks.algorithms: the ranks are on {len(set(hosts))} hosts; give --link RATE (the "
                         "rate of the link between them, e.g. 1gbit) so that the predictions can model it")
    intra = model.sharing(share)
    inter = CostModel(intra.alpha, link_beta(link), intra.gamma, f"link {link} between hosts")
    return Topology.of_hosts(hosts, intra, inter, link_burst(link) if burst is None else burst)


def refill_seconds(topology) -> float:
    """How long a call waits after the barrier, across hosts: long enough for an emptied token
    bucket to fill again (1 ms more), so every call starts with it full, as the simulator does."""
    if topology is None or not topology.burst:
        return 0.0
    return topology.burst * topology.inter.beta + 0.001


def predict(collective: str, algorithm: str, count: int, n: int, dtype, model: CostModel, topology) -> float:
    """Predicted seconds for `count` elements (the buffer_count) on n ranks: the closed form on
    one host; on several, the simulated time on the topology (root 0, as the cases use)."""
    if topology is None:
        return model.predict(collective, algorithm, count * dtype.itemsize, n)
    inputs = [torch.zeros(count // n if collective == "all_gather" else count, dtype=dtype) for _ in range(n)]
    return A.simulate(collective, algorithm, inputs, model=topology)[1].time
