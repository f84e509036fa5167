"""A shaped link's token bucket in the simulator (topology.py, sim.py): an idle host's bucket lets
`burst` bytes out at the fast (intra) beta before the link's rate binds, each host has its own
on its way out, a message takes the tokens it used, and idle time gives them back. Each time is
checked against the closed form in Topology.through_bucket's docstring.

    pytest tests/algorithms/test_token_bucket.py -q
"""

import pytest
import torch

from collectives.algorithms.cost import CostModel
from collectives.algorithms.sim import Simulator
from collectives.algorithms.topology import PAYLOAD_PER_FRAME, Topology, link_beta, link_burst
from collectives.rates import burst

FAST = CostModel(alpha=1e-5, beta=1e-10, gamma=2e-11)  # 10 GB/s within a host
SLOW = CostModel(alpha=4e-5, beta=8e-9, gamma=2e-11)  # 125 MB/s between hosts
BUCKET = 100_000  # bytes
# bytes an idle bucket lets out at the fast beta: it drains at 1/fast - 1/slow bytes per second
BURST_BYTES = BUCKET / (1 - FAST.beta / SLOW.beta)


def _sends(pairs, numel, steps=1):
    """Each (src, dst) in pairs sends numel float32 at once, `steps` times one after another."""
    def algorithm(comm, buf):
        for _ in range(steps):
            requests = [comm.send(buf, dst) for src, dst in pairs if src == comm.rank]
            requests += [comm.recv(buf, src) for src, dst in pairs if dst == comm.rank]
            if requests:
                yield requests
    return algorithm, [(torch.zeros(numel),) for _ in range(4)]


def _simulate(pairs, numel, steps=1, bucket=BUCKET):
    algorithm, args = _sends(pairs, numel, steps)
    return Simulator(4, Topology.two_level(2, 2, FAST, SLOW, burst=bucket)).run(algorithm, args)


def test_a_message_within_the_burst_goes_at_the_fast_beta():
    result = _simulate([(0, 2)], 10_000)  # 40 KB < BURST_BYTES
    assert result.time == pytest.approx(SLOW.alpha + 40_000 * FAST.beta, rel=1e-12)
    without = _simulate([(0, 2)], 10_000, bucket=0)
    assert without.time == pytest.approx(SLOW.alpha + 40_000 * SLOW.beta, rel=1e-12)


def test_a_longer_message_goes_at_the_rate_once_the_bucket_is_dry():
    n = 1_000_000
    result = _simulate([(0, 2)], n // 4)
    want = SLOW.alpha + BURST_BYTES * FAST.beta + (n - BURST_BYTES) * SLOW.beta
    assert result.time == pytest.approx(want, rel=1e-12)


def test_each_host_has_its_own_bucket_on_its_way_out():
    """Host 0 to host 1 and host 1 to host 0 at once: both burst (one shared bucket would make
    the second wait for the rate). A message within a host takes no tokens."""
    both = _simulate([(0, 2), (3, 1)], 15_000)  # 60 KB each: the two together are more than one burst
    assert [m.end for m in both.messages] == pytest.approx([SLOW.alpha + 60_000 * FAST.beta] * 2, rel=1e-12)
    after_local = _simulate([(0, 1), (1, 0)], 10_000, steps=1)
    assert after_local.time == pytest.approx(FAST.alpha + 40_000 * FAST.beta, rel=1e-12)


def test_a_message_takes_the_tokens_it_used():
    """Two 40 KB messages back to back fit in the burst; the third finds the bucket nearly dry:
    it sends what is left at the fast beta and the rest at the rate."""
    result = _simulate([(0, 2)], 10_000, steps=3)
    ends = [m.end for m in result.messages]
    one = SLOW.alpha + 40_000 * FAST.beta
    drain = 1 / FAST.beta - 1 / SLOW.beta
    left = BUCKET - 2 * 40_000 * FAST.beta * drain  # tokens after two messages (no idle time between)
    fast_bytes = left / drain / FAST.beta
    third = SLOW.alpha + fast_bytes * FAST.beta + (40_000 - fast_bytes) * SLOW.beta
    assert ends == pytest.approx([one, 2 * one, 2 * one + third], rel=1e-12)


def test_idle_time_fills_the_bucket_again():
    topo = Topology.two_level(2, 2, FAST, SLOW, burst=BUCKET)
    assert topo.refill(0.0, BUCKET * SLOW.beta) == pytest.approx(BUCKET)
    assert topo.refill(0.0, BUCKET * SLOW.beta / 4) == pytest.approx(BUCKET / 4)
    assert topo.refill(BUCKET / 2, 1.0) == BUCKET  # never more than it holds
    seconds, tokens = topo.through_bucket(BUCKET, 40_000)
    assert seconds == pytest.approx(SLOW.alpha + 40_000 * FAST.beta) and 0 < tokens < BUCKET


def test_the_clusters_bucket_in_payload_bytes_and_bad_buckets():
    assert link_burst("1gbit") == pytest.approx(burst("1gbit") * PAYLOAD_PER_FRAME)
    assert burst("1gbit") == 500_000  # 4 ms of 1 Gbit/s
    with pytest.raises(ValueError, match="burst is the bytes a token bucket holds"):
        Topology.two_level(2, 2, FAST, SLOW, burst=-1)
    # a bucket on a link no slower than the host's own speed changes nothing
    same = Topology.two_level(2, 2, FAST, CostModel(FAST.alpha, FAST.beta, FAST.gamma), burst=BUCKET)
    assert same.through_bucket(BUCKET, 4000) == (FAST.alpha + 4000 * FAST.beta, 0.0)
    assert link_beta("1gbit") == pytest.approx(8 / 1e9 / PAYLOAD_PER_FRAME)


def test_cost_model_sharing_cores_scales_every_cpu_cost():
    shared = FAST.sharing(2)
    assert (shared.alpha, shared.beta, shared.gamma) == (2 * FAST.alpha, 2 * FAST.beta, 2 * FAST.gamma)
    assert "x2 for 2 ranks per core" in shared.source and FAST.sharing(1) is FAST


@pytest.mark.parametrize("rate, shapes", [
    ("34gbit", True), ("35gbit", True), ("100gbit", True), ("1000gbit", True),  # past 2^32 bytes per second
    ("8589gbit", True), ("8589.9gbit", True),  # the burst, 4 ms of the rate, just fits 32 bits
    ("8590gbit", False), ("9tbit", False),  # it does not
])
def test_the_rate_bound_is_the_token_buckets_burst_at_its_edge(rate, shapes):
    """tc's limit is the burst (32 bits of bytes), not the rate: a bound planted on bytes per
    second refused every rate from 34.4gbit up and passed tests that tried only 4gbit and
    99999999gbit."""
    from collectives import rates

    assert (rates.burst(rate) <= rates.TBF_MAX_BURST) == shapes
    if shapes:
        assert rates.shapeable(rate) == rates.link_rate(rate)
    else:
        with pytest.raises(ValueError, match="more than tc's token bucket can shape"):
            rates.shapeable(rate)
