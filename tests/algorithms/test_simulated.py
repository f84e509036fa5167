"""Every from-scratch algorithm on the simulator: world sizes 1-64, element counts that do not
divide (and fewer elements than ranks), every op, against closed forms; identical bits on every
rank for all_reduce; the simulated time equal to the closed-form cost where the formula is exact;
and planted faults (a chunk off by one, a wrong peer, a skipped step) turning the checks red.

    pytest tests/algorithms/test_simulated.py -q
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from collectives.algorithms import ALGORITHMS, simulate
from collectives.algorithms import ring
from collectives.algorithms.cost import CostModel
from collectives.algorithms.fold import Fold
from collectives.chunks import bounds
from collectives.algorithms.sim import SimulationError, Simulator

from .reference import expected, inputs_for

MODEL = CostModel(alpha=1e-5, beta=1e-9, gamma=5e-10, source="test")
CASES = [(c, a) for c, algos in ALGORITHMS.items() for a in algos]
OPS = {"all_reduce", "reduce", "reduce_scatter"}


def check(collective, algorithm, p, numel, op="sum", root=0, dtype=torch.int64, seed=0, **kwargs):
    """Run on the simulator; assert every rank's output against the closed form."""
    inputs = inputs_for(collective, p, numel, dtype, seed, op)
    outs, result = simulate(collective, algorithm, inputs, op=op, root=root, model=MODEL, **kwargs)
    want = expected(collective, inputs, op, root)
    for r in range(p):
        if want[r] is None:
            continue
        assert outs[r] is not None and torch.equal(outs[r], want[r]), \
            f"{collective}/{algorithm}, p={p}, numel={numel}, op={op}, root={root}, rank {r}: {outs[r]} != {want[r]}"
    return result


@pytest.mark.parametrize("collective, algorithm", CASES)
@pytest.mark.parametrize("p", [1, 2, 3, 4, 5, 6, 7, 8, 12])
def test_every_algorithm_every_world_size(collective, algorithm, p):
    for numel in (0, 1, p - 1, 3 * p + 1, 40):  # fewer elements than ranks, and counts that do not divide
        for root in sorted({0, p - 1, p // 2}):
            check(collective, algorithm, p, max(numel, 0), root=root)


@pytest.mark.parametrize("collective, algorithm", [c for c in CASES if c[0] in OPS])
@pytest.mark.parametrize("op", ["sum", "min", "max", "product", "band", "bor", "bxor"])
def test_every_op(collective, algorithm, op):
    for p in (3, 4, 6):
        check(collective, algorithm, p, 17, op=op, root=p - 1)


@pytest.mark.parametrize("algorithm", list(ALGORITHMS["all_reduce"]))
def test_all_reduce_gives_every_rank_the_same_bits_in_float(algorithm):
    """Floats round differently in different orders: every rank must still hold identical bits
    (each element reduced once in one order, then copied), and they must be close to the sum."""
    for p in (3, 4, 5, 8):
        g = torch.Generator().manual_seed(p)
        inputs = [torch.randn(101, generator=g) * 10 ** torch.randint(-3, 4, (101,), generator=g) for _ in range(p)]
        outs, _ = simulate("all_reduce", algorithm, inputs, model=MODEL)
        for r in range(1, p):
            assert torch.equal(outs[r].view(torch.int32), outs[0].view(torch.int32)), (algorithm, p, r)
        torch.testing.assert_close(outs[0], torch.stack(inputs).sum(0), rtol=1e-5, atol=1e-4)


@settings(max_examples=150, deadline=None)
@given(case=st.sampled_from(CASES), p=st.integers(1, 64), numel=st.integers(0, 70), seed=st.integers(0, 999),
       dtype=st.sampled_from([torch.int32, torch.int64, torch.int16, torch.uint8]), root_at=st.floats(0, 0.999))
def test_property_any_world_size_count_and_dtype(case, p, numel, seed, dtype, root_at):
    collective, algorithm = case
    check(collective, algorithm, p, numel, root=int(root_at * p), dtype=dtype, seed=seed)


def test_many_ranks():
    """A learner can watch 1024 ranks without 1024 processes."""
    result = check("all_reduce", "rabenseifner", 1024, 2048)
    assert len(result.messages) == 1024 * 2 * 10
    check("broadcast", "binomial", 1024, 64, root=17)


# -- the simulated time against the closed forms ----------------------------------------------
@pytest.mark.parametrize("collective, algorithm", [
    ("all_reduce", "ring"), ("all_reduce", "recursive_doubling"), ("all_reduce", "rabenseifner"),
    ("reduce_scatter", "ring"), ("reduce_scatter", "recursive_halving"), ("reduce_scatter", "pairwise"),
    ("all_gather", "ring"), ("all_gather", "recursive_doubling"), ("all_gather", "bruck"),
    ("broadcast", "binomial"), ("reduce", "binomial"), ("gather", "binomial"), ("scatter", "binomial"),
    ("all_to_all", "pairwise"),
])
@pytest.mark.parametrize("p", [2, 4, 8])
def test_simulated_time_is_the_closed_form(collective, algorithm, p):
    """Powers of two and an element count that divides: there the formulas are exact."""
    numel = 64 * p
    result = check(collective, algorithm, p, numel)
    nbytes = numel * 8 * (p if collective in ("all_gather", "gather") else 1)
    predicted = MODEL.predict(collective, algorithm, nbytes, p)
    assert result.time == pytest.approx(predicted, rel=1e-9), (result.time, predicted)


# -- planted faults must be caught --------------------------------------------------------------
def ring_chunk_off_by_one(comm, buf, op):
    """Ring reduce-scatter that sends the chunk one too far along (r - s instead of r - s - 1)."""
    n, r = comm.size, comm.rank
    chunks = bounds(buf.numel(), n)
    tmp = buf.new_empty(max(b - a for a, b in chunks))
    for s in range(n - 1):
        out_chunk, in_chunk = (r - s) % n, (r - s - 1) % n
        a, b = chunks[out_chunk]
        c, d = chunks[in_chunk]
        yield comm.send(buf[a:b], (r + 1) % n), comm.recv(tmp[:d - c], (r - 1) % n)
        comm.reduce(buf[c:d], tmp[:d - c], op)
    yield from ring.all_gather(comm, buf)


def _ring_with_a_broken_all_gather(to_offset: int = 1, steps_short: int = 0):
    """A ring all-reduce whose all-gather sends to rank + to_offset (not + 1), or stops early."""
    def planted(comm, buf, op):
        yield from ring.reduce_scatter(comm, buf, op)
        n, r = comm.size, comm.rank
        chunks = bounds(buf.numel(), n)
        for s in range(n - 1 - steps_short):
            a, b = chunks[(r - s) % n]
            c, d = chunks[(r - s - 1) % n]
            yield comm.send(buf[a:b], (r + to_offset) % n), comm.recv(buf[c:d], (r - 1) % n)
    return planted


ring_wrong_peer = _ring_with_a_broken_all_gather(to_offset=2)
ring_skips_a_step = _ring_with_a_broken_all_gather(steps_short=1)


@pytest.mark.parametrize("planted", [ring_chunk_off_by_one, ring_wrong_peer, ring_skips_a_step])
def test_planted_faults_are_caught(planted, monkeypatch):
    monkeypatch.setitem(ALGORITHMS["all_reduce"], "planted", planted)
    caught = 0
    for p in (3, 4, 5):
        try:
            check("all_reduce", "planted", p, 4 * p + 1)
        except (AssertionError, SimulationError):
            caught += 1
    assert caught == 3, f"a planted fault passed on {3 - caught} world size(s)"


def test_a_deadlock_names_every_stuck_rank():
    def lonely(comm, buf, op):  # rank 0 waits for a message nobody sends
        if comm.rank == 0:
            yield (comm.recv(buf, 1, chunk=7),)

    with pytest.raises(SimulationError, match=r"rank 0 waits for: receive from rank 1 \(\d+ bytes, chunk 7, step 0\)"):
        Simulator(2, MODEL).run(lonely, [(torch.zeros(3), "sum")] * 2)


def test_fold():
    fold = Fold(6)  # p = 4: pairs (0, 1), (2, 3) fold; 4, 5 stay
    assert [fold.virtual(r) for r in range(6)] == [-1, 0, -1, 1, 2, 3]
    assert [fold.real(v) for v in range(4)] == [1, 3, 4, 5] and fold.members(1) == [2, 3]
    assert bounds(10, 4) == [(0, 3), (3, 6), (6, 8), (8, 10)] and bounds(2, 3) == [(0, 1), (1, 2), (2, 2)]


def test_show_without_a_table_simulates_past_62_ranks(capsys):
    """The step table names ranks by the bits of an int64 (62 at most); without it, show takes
    the simulator's full range: a 100-rank ring all_reduce is 2(p-1) steps of p messages."""
    from collectives.algorithms import show
    assert show.main(["all_reduce", "-n", "100", "--no-table", "-a", "ring", "--bytes", "8000"]) == 0
    out = capsys.readouterr().out
    assert "all_reduce, algorithm ring, 100 simulated ranks" in out, out
    assert f"{2 * 99 * 100} messages in {2 * 99} step(s)" in out, out
    with pytest.raises(SystemExit) as info:
        show.main(["all_reduce", "-n", "63"])
    assert info.value.code == 2 and "use --no-table above 62 ranks" in capsys.readouterr().err
