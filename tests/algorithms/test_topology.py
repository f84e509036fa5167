"""The two-level topology on the simulator (fast links within a host, a slow one between hosts,
one network port per host) and hierarchical all_reduce: its results on any host layout, the
messages that cross between hosts, and the simulated time against the closed forms in
hierarchical.py's docstring and ring.py's.

    pytest tests/algorithms/test_topology.py -q
"""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import collectives.algorithms as A
from collectives.algorithms.cost import CostModel
from collectives.algorithms.sim import Simulator
from collectives.algorithms.topology import PAYLOAD_PER_FRAME, Topology, link_beta, link_rate
from collectives.errors import CollectiveError

from .reference import expected, inputs_for

INTRA = CostModel(alpha=1e-5, beta=1e-10, gamma=2e-11, source="test intra")
INTER = CostModel(alpha=4e-5, beta=8e-9, gamma=2e-11, source="test inter")


def test_link_rates_in_tcs_units():
    assert link_rate("1gbit") == 1e9 and link_rate("100mbit") == 1e8 and link_rate("2.5Gbit") == 2.5e9
    assert link_beta("1gbit") == pytest.approx(8 / 1e9 / PAYLOAD_PER_FRAME)
    for bad in ("1gb", "fast", "0gbit", "-1gbit", ""):
        with pytest.raises(ValueError, match="not one"):
            link_rate(bad)


def _one_message(comm, buf, dst):
    if comm.rank == 0:
        yield (comm.send(buf, dst),)
    elif comm.rank == dst:
        yield (comm.recv(buf, 0),)


@pytest.mark.parametrize("dst, model", [(1, INTRA), (2, INTER)])
def test_a_message_costs_its_links_alpha_and_beta(dst, model):
    topo = Topology.two_level(2, 2, INTRA, INTER)
    result = Simulator(4, topo).run(_one_message, [(torch.zeros(1000), dst)] * 4)
    assert result.time == pytest.approx(model.alpha + 4000 * model.beta, rel=1e-12)


def _both_ranks_of_host0_send_across(comm, buf):
    if comm.rank in (0, 1):
        yield (comm.send(buf, comm.rank + 2),)
    else:
        yield (comm.recv(buf, comm.rank - 2),)


def test_a_hosts_ranks_share_its_network_port():
    """Two messages leaving one host at once take turns on its link: the second ends at twice
    the time of one. On one host (separate ports) both end at once."""
    one = INTER.alpha + 4000 * INTER.beta
    shared = Simulator(4, Topology.two_level(2, 2, INTRA, INTER)).run(_both_ranks_of_host0_send_across,
                                                                         [(torch.zeros(1000),)] * 4)
    assert sorted(m.end for m in shared.messages) == pytest.approx([one, 2 * one], rel=1e-12)
    flat = Simulator(4, Topology.flat(4, INTER)).run(_both_ranks_of_host0_send_across, [(torch.zeros(1000),)] * 4)
    assert [m.end for m in flat.messages] == pytest.approx([one, one], rel=1e-12)


def _two_hosts_send_into_host0(comm, buf):
    if comm.rank in (2, 4):  # from host 1 and host 2, to ranks 0 and 1 of host 0
        yield (comm.send(buf, comm.rank // 2 - 1),)
    elif comm.rank in (0, 1):
        yield (comm.recv(buf, 2 * comm.rank + 2),)


def test_a_hosts_ranks_share_its_network_port_coming_in_too():
    """Two messages from two hosts into one take turns on its incoming port (a simulator that
    shared only the outgoing one let both end at once)."""
    one = INTER.alpha + 4000 * INTER.beta
    shared = Simulator(6, Topology.two_level(3, 2, INTRA, INTER)).run(_two_hosts_send_into_host0,
                                                                         [(torch.zeros(1000),)] * 6)
    assert sorted(m.end for m in shared.messages) == pytest.approx([one, 2 * one], rel=1e-12)


def test_a_topology_of_another_size_is_refused():
    with pytest.raises(ValueError, match="places 4 ranks, the simulator has 3"):
        Simulator(3, Topology.two_level(2, 2, INTRA, INTER))
    with pytest.raises(ValueError, match="host index"):
        Topology.of_hosts([0, -1], INTRA, INTER)
    with pytest.raises(CollectiveError, match="name the algorithm"):
        A.simulate("all_reduce", "auto", [torch.ones(4)] * 4, model=Topology.two_level(2, 2, INTRA, INTER))


def _run(algorithm, hosts, numel, dtype=torch.int64, op="sum", seed=0):
    inputs = inputs_for("all_reduce", len(hosts), numel, dtype, seed, op)
    outs, result = A.simulate("all_reduce", algorithm, inputs, op=op, model=Topology.of_hosts(hosts, INTRA, INTER))
    want = expected("all_reduce", inputs, op)
    for r, (got, w) in enumerate(zip(outs, want)):
        assert torch.equal(got, w), f"{algorithm} hosts={hosts} numel={numel} op={op}: rank {r}: {got} != {w}"
    return result


@settings(max_examples=120, deadline=None)
@given(hosts=st.lists(st.integers(0, 4), min_size=1, max_size=12), numel=st.integers(0, 50),
       dtype=st.sampled_from([torch.int64, torch.int32, torch.uint8]),
       op=st.sampled_from(["sum", "min", "max", "product", "bxor"]), seed=st.integers(0, 99))
def test_hierarchical_on_any_host_layout(hosts, numel, dtype, op, seed):
    """Hosts of different sizes, ranks of a host not adjacent, host indices with gaps."""
    result = _run("hierarchical", hosts, numel, dtype, op, seed)
    leaders = {min(r for r in range(len(hosts)) if hosts[r] == h) for h in hosts}
    for m in result.messages:  # only the leaders talk across hosts
        if hosts[m.src] != hosts[m.dst]:
            assert m.src in leaders and m.dst in leaders, (hosts, m)


def test_hierarchical_floats_are_the_same_bits_on_every_rank():
    g = torch.Generator().manual_seed(0)
    inputs = [torch.randn(333, generator=g) * 1e3 for _ in range(6)]
    outs, _ = A.simulate("all_reduce", "hierarchical", inputs, model=Topology.of_hosts([0, 1, 1, 0, 2, 1], INTRA, INTER))
    for out in outs[1:]:
        assert torch.equal(out.view(torch.int32), outs[0].view(torch.int32))
    torch.testing.assert_close(outs[0], torch.stack(inputs).sum(0), rtol=1e-5, atol=1e-3)


@pytest.mark.parametrize("hosts", [[0, 1], [0, 1, 1, 0], []], ids=["shorter", "longer", "empty"])
def test_hierarchical_refuses_a_host_list_of_another_length(hosts):
    with pytest.raises(CollectiveError, match=rf"hosts={hosts!r}".replace("[", r"\[").replace("]", r"\]")
                       + r" must give a host index .* each of the 3 ranks"):
        A.simulate("all_reduce", "hierarchical", [torch.ones(4)] * 3, model=INTRA, hosts=hosts)


@pytest.mark.parametrize("nodes, per_node", [(2, 2), (2, 4), (3, 2), (4, 2), (2, 1)])
def test_simulated_times_are_the_closed_forms(nodes, per_node):
    """Equal chunks (numel divisible by every rank count): ring's steps each wait for the slow
    link, 2(p-1)(alpha_e + n/p beta_e) + (p-1)/p n gamma; hierarchical's, as its docstring."""
    p, h, k = nodes * per_node, nodes, per_node
    numel = 64 * p * h
    n = numel * 8  # int64
    topo_hosts = [r // per_node for r in range(p)]
    a_i, b_i, a_e, b_e, g = INTRA.alpha, INTRA.beta, INTER.alpha, INTER.beta, INTRA.gamma
    lg = math.log2(k)
    want = {
        "ring": 2 * (p - 1) * (a_e + n / p * b_e) + (p - 1) / p * n * g,
        "hierarchical": lg * (a_i + n * b_i + n * g) + 2 * (h - 1) * (a_e + n / h * b_e) + (h - 1) / h * n * g
        + lg * (a_i + n * b_i),
    }
    for algorithm, seconds in want.items():
        assert _run(algorithm, topo_hosts, numel).time == pytest.approx(seconds, rel=1e-9), algorithm


def test_hierarchical_beats_the_ring_when_the_link_between_hosts_is_slow_and_not_when_it_is_not():
    """Why it exists, on the model: 2 hosts x 2 ranks, 16 MiB. Over a slow link it sends 1.5x
    less across; over one as fast as the host's own links, the ring's shorter steps win."""
    n = 4 << 20  # float32 elements
    inputs = [torch.zeros(n) for _ in range(4)]
    slow = {a: A.simulate("all_reduce", a, inputs, model=Topology.two_level(2, 2, INTRA, INTER))[1].time
            for a in ("ring", "hierarchical")}
    assert 1.3 < slow["ring"] / slow["hierarchical"] < 1.5
    fast = {a: A.simulate("all_reduce", a, inputs, model=Topology.two_level(2, 2, INTRA, INTRA))[1].time
            for a in ("ring", "hierarchical")}
    assert fast["ring"] < fast["hierarchical"]
