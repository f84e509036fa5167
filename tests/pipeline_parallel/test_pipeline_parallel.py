"""Pipeline parallelism (ddp_from_scratch/pipeline_parallel/): stages cut as asked, schedules that
run every microbatch's forward before its backward, and one executor whose losses and gradients
are bit for bit torch.distributed.pipelining's ScheduleGPipe, Schedule1F1B,
ScheduleInterleaved1F1B and ScheduleInterleavedZeroBubble on the same stages and data, on Gloo and on shm, at 2 and 4 stages, with as many microbatches as stages, twice as
many and an odd count; and bit for bit the one-rank model accumulating the same microbatches.

    pytest tests/pipeline_parallel/test_pipeline_parallel.py -q
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
from ddp_from_scratch.pipeline_parallel.schedule import (CHUNKED, SCHEDULES, Action, bubble, check, chunks_of, gpipe,
                                                         make, interleaved, one_f_one_b, peak_in_flight, rounds_of,
                                                         simulate, table, zero_bubble)
from ddp_from_scratch.pipeline_parallel import parity
from ddp_from_scratch.pipeline_parallel.split import balanced_sizes, split
from ddp_from_scratch.pipeline_parallel.stage import Stage

_against_torch, _against_one_rank = parity.against_torch, parity.against_one_rank
mlp = parity.mlp


@pytest.mark.parametrize("backend", ["gloo", "shm"])
@pytest.mark.parametrize("name,chunks", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zero-bubble", 1),
                                         ("zero-bubble", 2)])
@pytest.mark.parametrize("p", [2, 4])
def test_bitwise_torchs_schedule(p, name, chunks, backend):
    """Interleaved and zero bubble: 2 chunks a rank, 4 or 8 stages in all (zero bubble also one);
    their odd count is 3 (p=2) or 5 (p=4), the microbatches running in rounds of about p that must
    divide them (torch's rule too)."""
    counts = (p, 2 * p, parity.odd_count(name, p))
    for rank, per_count in enumerate(run_on_ranks(_against_torch, p, args=(name, counts, 4, chunks), backend=backend,
                                                  timeout=120)):
        for m, (grads, same_losses, n_losses) in per_count.items():
            assert grads and all(same for _, same in grads), (name, backend, p, m, rank, grads)
            if rank == p - 1:
                assert n_losses == m and same_losses == [True] * m, (name, backend, p, m, same_losses)


@settings(max_examples=12, deadline=None)
@given(p=st.integers(2, 4), extra=st.integers(0, 5), depth=st.integers(3, 6),
       name=st.sampled_from(sorted(SCHEDULES)), chunks=st.integers(1, 3), balanced=st.booleans(),
       count_saved=st.booleans(), data=st.data())
def test_property_bitwise_the_one_rank_model_over_stages_microbatches_chunks_and_depth(p, extra, depth, name, chunks,
                                                                                        balanced, count_saved, data):
    """The same arithmetic as one rank accumulating gradients over the microbatches: a stage's
    backward gets the same output gradient the whole model's autograd would, and a parameter's
    gradient adds the microbatches in the same order; so bit for bit, for any cut, any schedule,
    with the saved activations counted or not."""
    m = p + extra
    chunks = chunks if name in CHUNKED else 1
    if name in CHUNKED and m % rounds_of(p, m):
        m -= m % rounds_of(p, m)
    layers, n = 2 * depth + 1, p * chunks
    if n > layers:
        depth, layers = n, 2 * n + 1
    sizes = None
    if not balanced:
        cuts = sorted(data.draw(st.lists(st.integers(1, layers - 1), min_size=n - 1, max_size=n - 1, unique=True)))
        sizes = [b - a for a, b in zip([0] + cuts, cuts + [layers])]
    for rank, (grads, losses, in_flight) in enumerate(run_on_ranks(_against_one_rank, p,
                                                                   args=(name, m, depth, sizes, chunks, count_saved),
                                                                   backend="gloo", timeout=120)):
        assert all(grads), (rank, name, p, m, depth, sizes, grads)
        assert all(losses) and len(losses) == (m if rank == p - 1 else 0), (rank, losses)
        if name not in CHUNKED:
            assert in_flight == (m if name == "gpipe" else min(m, p - rank)), (rank, name, in_flight)
        else:
            assert in_flight == peak_in_flight(make(name, p, m, chunks)[rank]), (rank, name, in_flight)


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


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 8), st.integers(0, 24), st.integers(1, 4), st.sampled_from(sorted(SCHEDULES)))
def test_every_schedule_runs_each_forward_before_its_backward_once_and_cannot_deadlock(p, extra, v, name):
    m = p + extra
    if name in CHUNKED and m % rounds_of(p, m):
        return  # refused (the next test)
    actions = make(name, p, m, v)
    check(actions, m)  # every (microbatch, chunk) once each way, and the simulation finishes
    for s, acts in enumerate(actions):
        for c in range(chunks_of(actions)):
            for kind in ("BW" if name != "zero-bubble" else "IW"):  # a whole backward, or a split one's parts
                order = [a.microbatch for a in acts if a.kind == kind and a.chunk == c]
                assert order == (list(range(m)) if kind != "W" or name == "zero-bubble" else []), (name, s, c, order)
        if name not in CHUNKED:
            assert peak_in_flight(acts) == (m if name == "gpipe" else min(m, p - s))


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 8), st.integers(0, 24), st.integers(1, 4), st.sampled_from(sorted(SCHEDULES)))
def test_the_simulated_bubble_is_the_closed_form(p, extra, v, name):
    """With every forward and backward the same length and messages free, each rank idles
    (p-1)/(m+p-1) of the step under GPipe and 1F1B, and (p-1)/(v m+p-1) interleaved; zero bubble,
    with a forward, an I and a W each as long, (p-1)/(3 v m+p-1)."""
    m = p + extra
    if name in CHUNKED and m % rounds_of(p, m):
        return
    split = name == "zero-bubble"
    idle = simulate(make(name, p, m, v), forward=1, backward=2 if split else 1, weight=1 if split else None)
    want = bubble(p, m, v if name in CHUNKED else 1, split=split)
    assert idle == pytest.approx([want] * p, abs=1e-12), (name, p, m, v, idle, want)


def test_zero_bubble_is_torchs_zb1p_order_and_fills_1f1bs_bubble_with_weight_gradients():
    assert table(zero_bubble(2, 4)) == ("rank 0: F0 F1 I0 W0 F2 I1 W1 F3 I2 W2 I3 W3\n"
                                        "rank 1: F0 I0 F1 I1 W0 F2 I2 W1 F3 I3 W2 W3")
    assert table(zero_bubble(2, 3)) == "rank 0: F0 F1 I0 W0 F2 I1 W1 I2 W2\nrank 1: F0 I0 F1 I1 W0 F2 I2 W1 W2"
    assert " ".join(map(str, zero_bubble(2, 4, 2)[1])) == (  # torch's pipeline_order for rank 1, chunks 2
        "F0 F1 F0:1 I0:1 F1:1 I1:1 W0:1 F2 I0 W1:1 F3 I1 W0 F2:1 I2:1 W1 F3:1 I3:1 W2:1 I2 W3:1 I3 W2 W3")
    with pytest.raises(ValueError, match="zero bubble runs the microbatches in rounds of about one a stage: 5"):
        zero_bubble(2, 5)
    with pytest.raises(ValueError, match="rank 0: W0 comes before its I"):
        check([[Action("F", 0), Action("W", 0), Action("I", 0)]], 1)
    with pytest.raises(ValueError, match="rank 0 mixes whole backwards with split ones"):
        check([[Action("F", 0), Action("F", 1), Action("B", 0), Action("I", 1), Action("W", 1)]], 2)


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


def _held_after(env, name, chunks, m):
    p, r = env.world_size, env.rank
    stages = parity._stages(p, chunks, 4)
    stage = Stage([stages[c * p + r] for c in range(chunks)], r, p, loss_fn=F.cross_entropy)
    x, y = parity.data(m)
    xs, ys = list(x.tensor_split(m)), list(y.tensor_split(m))
    stage.agree_shapes(xs[0] if r == 0 else None)
    peaks = []
    for _ in range(3):  # a step's activations are all freed by its end, so the next step's peak is the same
        result = stage.run(make(name, p, m, chunks), xs if r == 0 else None, ys if r == p - 1 else None)
        peaks.append(result.peak_saved_bytes)
    uncounted = stage.run(make(name, p, m, chunks), xs if r == 0 else None, ys if r == p - 1 else None,
                          count_saved=False)  # no hooks: nothing counted, nothing left from the count before
    uncounted = (uncounted.peak_saved_bytes, stage.saved.peak)
    again = stage.run(make(name, p, m, chunks), xs if r == 0 else None, ys if r == p - 1 else None)
    return stage.saved.live, peaks + [again.peak_saved_bytes], result.peak_in_flight, uncounted


@pytest.mark.parametrize("name,chunks", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zero-bubble", 1),
                                         ("zero-bubble", 2)])
def test_every_activation_a_step_saved_is_freed_by_its_end(name, chunks):
    """Counted as autograd frees them: none left after a step (a split backward's I keeps the
    graph for its W, which must not keep it beyond), and each step's peak the same; a step run
    with count_saved=False counts nothing, and the next counted step counts as before."""
    for rank, (left, peaks, in_flight, uncounted) in enumerate(run_on_ranks(_held_after, 2, args=(name, chunks, 4),
                                                                            backend="gloo")):
        assert left == 0 and peaks[0] > 0 and len(set(peaks)) == 1, (rank, left, peaks)
        assert uncounted == (None, 0), (rank, uncounted)
        assert in_flight == peak_in_flight(make(name, 2, 4, chunks)[rank])


@settings(max_examples=150, deadline=None)
@given(st.integers(1, 6), st.integers(0, 12), st.integers(1, 3), st.sampled_from(sorted(SCHEDULES)))
def test_every_schedule_with_its_messages_receives_each_in_its_senders_order(p, extra, v, name):
    """The sends and receives placed in each rank's list: one send for every message a rank needs
    from another, one receive for it, every receive first in line from its sender when it comes
    (check_messages), each action's own receives before it; the timings are the plain schedule's."""
    from ddp_from_scratch.pipeline_parallel import messages
    from ddp_from_scratch.pipeline_parallel.messages import RECV, SEND, Message, check_messages, needs, with_messages

    m = p + extra
    if name in CHUNKED and m % rounds_of(p, m):
        return
    actions = make(name, p, m, v)
    lowered = with_messages(actions)
    check_messages(lowered)
    stages = p * chunks_of(actions)
    for r, steps in enumerate(lowered):
        assert [a for a in steps if not isinstance(a, Message)] == actions[r]
        got = set()
        for a in steps:
            if isinstance(a, Message) and a.direction == RECV:
                got.add(a.key)
            elif not isinstance(a, Message) and needs(a, r, p, stages):
                assert needs(a, r, p, stages)[0] in got, (r, a)
    sends = sorted((r, a.peer, a.key) for r, steps in enumerate(lowered) for a in steps
                   if isinstance(a, Message) and a.direction == SEND)
    receives = sorted((a.peer, r, a.key) for r, steps in enumerate(lowered) for a in steps
                      if isinstance(a, Message) and a.direction == RECV)
    assert sends == receives
    assert messages.simulate(lowered) == simulate(actions)


def test_a_receive_out_of_its_senders_order_and_a_message_deadlock_are_refused():
    from ddp_from_scratch.pipeline_parallel.messages import check_messages, with_messages

    lowered = with_messages(gpipe(2, 2))
    assert table(lowered) == ("rank 0:   F0 F0>1   F1 F1>1 B0<1   B0 B1<1   B1\n"
                              "rank 1: F0<0   F0 F1<0   F1   B0 B0>0   B1 B1>0")
    swapped = [list(lowered[0]), list(lowered[1])]
    swapped[1][0], swapped[1][2] = swapped[1][2], swapped[1][0]  # rank 1 receives F1 before F0
    with pytest.raises(ValueError, match="rank 1 receives F1 of stage 0 from rank 0, which sent F0 of stage 0 first"):
        check_messages(swapped)
    stuck = [list(lowered[0]), list(lowered[1])]
    stuck[0].insert(0, stuck[0].pop(4))  # rank 0 waits for B0's gradient before it sends anything
    with pytest.raises(ValueError, match="the messages deadlock: rank 0 at B0<1, rank 1 at F0<0"):
        check_messages(stuck)
