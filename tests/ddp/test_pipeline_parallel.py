"""Pipeline parallelism (ddp_from_scratch/pipeline_parallel/): stages cut as asked, schedules that
run every microbatch's forward before its backward, and one executor whose losses and gradients
are bit for bit torch.distributed.pipelining's ScheduleGPipe and Schedule1F1B on the same stages
and data, on Gloo and on shm, at 2 and 4 stages, with as many microbatches as stages, twice as
many and an odd count; and bit for bit the one-rank model accumulating the same microbatches.

    pytest tests/ddp/test_pipeline_parallel.py -q
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from collectives.testing import run_on_ranks
from ddp_from_scratch.pipeline_parallel.schedule import (Action, bubble, check, chunks_of, gpipe, make,
                                                         interleaved, one_f_one_b, peak_in_flight, rounds_of, simulate,
                                                         table)
from ddp_from_scratch.pipeline_parallel import parity
from ddp_from_scratch.pipeline_parallel.split import balanced_sizes, split
from ddp_from_scratch.pipeline_parallel.stage import Stage

_against_torch, _against_one_rank = parity.against_torch, parity.against_one_rank
mlp = parity.mlp


@pytest.mark.parametrize("backend", ["gloo", "shm"])
@pytest.mark.parametrize("name", ["gpipe", "1f1b", "interleaved"])
@pytest.mark.parametrize("p", [2, 4])
def test_bitwise_torchs_schedule(p, name, backend):
    """Interleaved: 2 chunks a rank, 4 or 8 stages in all; its odd count is 3 (p=2) or 5 (p=4),
    the microbatches running in rounds of about p that must divide them (torch's rule too)."""
    counts = (p, 2 * p, parity.odd_count(name, p))
    chunks = 2 if name == "interleaved" else 1
    for rank, per_count in enumerate(run_on_ranks(_against_torch, p, args=(name, counts, 4, chunks), backend=backend,
                                                  timeout=120)):
        for m, (grads, same_losses, n_losses) in per_count.items():
            assert grads and all(same for _, same in grads), (name, backend, p, m, rank, grads)
            if rank == p - 1:
                assert n_losses == m and same_losses == [True] * m, (name, backend, p, m, same_losses)


@settings(max_examples=12, deadline=None)
@given(p=st.integers(2, 4), extra=st.integers(0, 5), depth=st.integers(3, 6),
       name=st.sampled_from(["gpipe", "1f1b", "interleaved"]), chunks=st.integers(2, 3), balanced=st.booleans(),
       data=st.data())
def test_property_bitwise_the_one_rank_model_over_stages_microbatches_chunks_and_depth(p, extra, depth, name, chunks,
                                                                                        balanced, data):
    """The same arithmetic as one rank accumulating gradients over the microbatches: a stage's
    backward gets the same output gradient the whole model's autograd would, and a parameter's
    gradient adds the microbatches in the same order; so bit for bit, for any cut, any schedule."""
    m = p + extra
    chunks = chunks if name == "interleaved" else 1
    if name == "interleaved" and m % rounds_of(p, m):
        m -= m % rounds_of(p, m)
    layers, n = 2 * depth + 1, p * chunks
    if n > layers:
        depth, layers = n, 2 * n + 1
    sizes = None
    if not balanced:
        cuts = sorted(data.draw(st.lists(st.integers(1, layers - 1), min_size=n - 1, max_size=n - 1, unique=True)))
        sizes = [b - a for a, b in zip([0] + cuts, cuts + [layers])]
    for rank, (grads, losses, in_flight) in enumerate(run_on_ranks(_against_one_rank, p,
                                                                   args=(name, m, depth, sizes, chunks),
                                                                   backend="gloo", timeout=120)):
        assert all(grads), (rank, name, p, m, depth, sizes, grads)
        assert all(losses) and len(losses) == (m if rank == p - 1 else 0), (rank, losses)
        if name != "interleaved":
            assert in_flight == (m if name == "gpipe" else min(m, p - rank)), (rank, name, in_flight)


# -- the parts alone --------------------------------------------------------------------------------

@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 50), min_size=1, max_size=8), st.data())
def test_balanced_sizes_make_the_lightest_heaviest_stage(weights, data):
    stages = data.draw(st.integers(1, len(weights)))
    sizes = balanced_sizes(weights, stages)
    assert len(sizes) == stages and min(sizes) >= 1 and sum(sizes) == len(weights)

    def heaviest(cut):
        at, most = 0, 0
        for size in cut:
            most, at = max(most, sum(weights[at:at + size])), at + size
        return most
    best = min(heaviest([b - a for a, b in zip((0,) + c, c + (len(weights),))])
               for c in itertools.combinations(range(1, len(weights)), stages - 1))
    assert heaviest(sizes) == best, (weights, stages, sizes)


def test_split_keeps_the_models_modules_and_refuses_what_does_not_cover_it():
    model = mlp(2)  # 5 layers: Linear, Tanh, Linear, Tanh, Linear
    stages = split(model, 2, sizes=[2, 3])
    assert [len(s) for s in stages] == [2, 3] and stages[1][2] is model[4]
    for stages_, sizes, says in ((2, [2, 2], "add up to the model's 5 layers"), (2, [5, 0], "at least 1"),
                                 (3, [2, 3], "must be 3 whole numbers"), (6, None, "6 stages need at least 6 layers"),
                                 (0, None, "at least 1 stage")):
        with pytest.raises(ValueError, match=says):
            split(model, stages_, sizes)


@settings(max_examples=150, deadline=None)
@given(st.integers(1, 8), st.integers(0, 24), st.integers(1, 4), st.sampled_from(["gpipe", "1f1b", "interleaved"]))
def test_every_schedule_runs_each_forward_before_its_backward_once_and_cannot_deadlock(p, extra, v, name):
    m = p + extra
    if name == "interleaved" and m % rounds_of(p, m):
        return  # refused (the next test)
    actions = make(name, p, m, v)
    check(actions, m)  # every (microbatch, chunk) once each way, and the simulation finishes
    for s, acts in enumerate(actions):
        for c in range(chunks_of(actions)):
            backwards = [a.microbatch for a in acts if a.kind == "B" and a.chunk == c]
            assert backwards == list(range(m)), (name, s, c, backwards)  # gradients add up in microbatch order
        if name != "interleaved":
            assert peak_in_flight(acts) == (m if name == "gpipe" else min(m, p - s))


@settings(max_examples=150, deadline=None)
@given(st.integers(1, 8), st.integers(0, 24), st.integers(1, 4), st.sampled_from(["gpipe", "1f1b", "interleaved"]))
def test_the_simulated_bubble_is_the_closed_form(p, extra, v, name):
    """With every forward and backward the same length and messages free, each rank idles
    (p-1)/(m+p-1) of the step under GPipe and 1F1B, and (p-1)/(v m+p-1) interleaved."""
    m = p + extra
    if name == "interleaved" and m % rounds_of(p, m):
        return
    idle = simulate(make(name, p, m, v), forward=1, backward=1)
    want = bubble(p, m, v if name == "interleaved" else 1)
    assert idle == pytest.approx([want] * p, abs=1e-12), (name, p, m, v, idle, want)


def test_interleaved_refuses_microbatches_its_rounds_do_not_divide():
    with pytest.raises(ValueError, match="5 microbatches on 2 stages make 2 rounds, which must divide them"):
        interleaved(2, 5, 2)
    assert chunks_of(interleaved(4, 5, 3)) == 3  # fewer than a round each: one round of 5


def test_1f1b_is_torchs_order_and_refuses_fewer_microbatches_than_stages():
    assert table(one_f_one_b(2, 3)) == "rank 0: F0 F1 B0 F2 B1 B2\nrank 1: F0 B0 F1 B1 F2 B2"
    assert table(gpipe(2, 2)) == "rank 0: F0 F1 B0 B1\nrank 1: F0 F1 B0 B1"
    with pytest.raises(ValueError, match="1F1B needs at least as many microbatches as stages: 3 microbatches for 4"):
        one_f_one_b(4, 3)
    with pytest.raises(ValueError, match="rank 0: B0 comes before its forward"):
        check([[Action("B", 0), Action("F", 0)]], 1)


def _wrong_group(env):
    try:
        Stage(nn.Linear(2, 2), 0, 3, loss_fn=F.mse_loss)
    except ValueError as exc:
        said = str(exc)
    t = torch.ones(1)
    dist.all_reduce(t)
    return said, t.item()


def test_a_pipeline_whose_group_is_not_its_stage_count_is_refused():
    for said, after in run_on_ranks(_wrong_group, 2, backend="gloo"):
        assert said == "a pipeline over 3 ranks needs a group of 3 ranks, got 2" and after == 2.0
