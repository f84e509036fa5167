"""The pipeline's Python API at its edges: each plain mistake a user can make building their own
pipeline is a one-line ValueError naming it, raised before any message is sent; a model whose
train and eval modes differ trains in train mode; a stage known to wait for its messages shows
that wait as idle time, in its share and in the Chrome trace.

    pytest tests/pipeline_parallel/test_pipeline_mistakes.py -q
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from collectives.testing import run_on_ranks
from ddp_from_scratch.pipeline_parallel import parity
from ddp_from_scratch.pipeline_parallel.schedule import (SCHEDULES, Action, gpipe, interleaved, make, one_f_one_b,
                                                         zero_bubble)
from ddp_from_scratch.pipeline_parallel.split import split
from ddp_from_scratch.pipeline_parallel.stage import Stage
from ddp_from_scratch.pipeline_parallel.timeline import chrome_trace_events

WIDTH = parity.WIDTH


class Residual(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        return x + self.b(torch.tanh(self.a(x)))


class Twice(nn.Sequential):
    def forward(self, x):  # an nn.Sequential whose forward is not its layers in turn
        return super().forward(super().forward(x))


def test_split_refuses_a_model_whose_forward_is_not_its_layers_in_turn():
    for model in (Residual(), Twice(nn.Linear(4, 4), nn.Linear(4, 4))):
        with pytest.raises(ValueError, match=f"{type(model).__name__} is not one .or overrides its forward."):
            split(model, 2)


def test_split_refuses_a_layer_with_parameters_held_twice_and_takes_one_without():
    a, b = nn.Linear(4, 4), nn.Linear(4, 4)
    with pytest.raises(ValueError, match=r"layer 2 of the nn.Sequential is layer 0 again \(Linear\)"):
        split(nn.Sequential(a, b, a), 2)
    bn = nn.BatchNorm1d(4, affine=False)  # buffers only: still state the stages would share
    with pytest.raises(ValueError, match=r"layer 3 of the nn.Sequential is layer 1 again \(BatchNorm1d\)"):
        split(nn.Sequential(a, bn, b, bn), 2)
    relu = nn.ReLU()
    stages = split(nn.Sequential(a, relu, b, relu), 2, sizes=[2, 2])
    assert [list(s) for s in stages] == [[a, relu], [b, relu]]  # every place kept, none dropped
    x = torch.randn(3, 4)
    torch.testing.assert_close(stages[1](stages[0](x)), relu(b(relu(a(x)))), rtol=0, atol=0)


@pytest.mark.parametrize("sizes", [[2.5, 2.5], [2.0, 3], [True, 4], ["2", "3"]])
def test_split_refuses_sizes_that_are_not_whole_numbers_with_a_value_error(sizes):
    with pytest.raises(ValueError, match="must be whole numbers of layers"):
        split(parity.mlp(2), 2, sizes=sizes)


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(sorted(SCHEDULES)), st.integers(-3, 3), st.integers(-3, 3), st.integers(-3, 3))
def test_every_schedule_refuses_a_count_below_one_naming_it(name, p, m, v):
    if p >= 1 and m >= 1 and (v >= 1 or name not in ("interleaved", "zero-bubble")):
        return  # a valid count (or chunks a schedule without them ignores)
    with pytest.raises(ValueError, match="at least 1 (stage|chunk)"):
        make(name, p, m, v)


def test_chunks_of_zero_or_below_is_refused_by_the_chunked_schedules():
    for fn in (interleaved, zero_bubble):
        for v in (0, -1):
            with pytest.raises(ValueError, match=f"at least 1 chunk a rank, got {v}"):
                fn(2, 4, v)


class _Pair(nn.Module):
    def forward(self, x):
        return x, x.sum()


class _Ints(nn.Module):
    def forward(self, x):
        return (x * 10).long()


def _mistake(env, what):
    """Rank 0 holds stage 0, rank 1 the last; each builds what `what` names and reports the error
    its first call raised (or None), then both ranks all_reduce to show the group still works. A
    mistake only one rank can see is made with the other rank standing aside (it would wait for a
    message the failed rank never sends: the launcher ends such a run, naming the failed rank)."""
    r, p = env.rank, env.world_size
    torch.manual_seed(0)
    layers = {"tuple": [_Pair(), nn.Linear(WIDTH, 3)], "ints": [_Ints(), nn.Linear(WIDTH, 3)]}.get(what)
    stages = split(nn.Sequential(*layers), 2) if layers else split(parity.mlp(2), 2)
    stage = Stage(stages[r], r, p, loss_fn=F.cross_entropy)
    x, y = parity.data(4)
    inputs, targets, schedule = list(x.tensor_split(4)), list(y.tensor_split(4)), one_f_one_b(2, 4)
    if what == "fewer microbatches":
        inputs, targets = inputs[:2], targets[:2]
    elif what == "no targets":
        targets = None
    elif what == "deadlock":  # each rank's list is whole, but rank 1 waits for F1 while rank 0 waits for B0
        schedule = [[Action("F", 0), Action("B", 0), Action("F", 1), Action("B", 1)],
                    [Action("F", 0), Action("F", 1), Action("B", 0), Action("B", 1)]]
        inputs, targets = inputs[:2], targets[:2]
    elif what == "uneven":  # 5 rows into 2 microbatches: 3 and 2
        inputs, targets, schedule = list(torch.randn(5, WIDTH).tensor_split(2)), list(y[:5].tensor_split(2)), gpipe(2, 2)
    elif what == "schedule's ranks":
        schedule = gpipe(3, 4)
    aside = {"tuple": 1, "ints": 1, "uneven": 1, "no targets": 0}.get(what)
    said = None
    try:
        if r == 0 or what not in ("tuple", "ints"):  # those two are stage 0's mistakes in agree_shapes itself
            stage.agree_shapes(inputs[0] if r == 0 else None)
        if r != aside:
            stage.run(schedule, inputs if r == 0 else None, targets if r == 1 else None)
    except ValueError as exc:
        said = str(exc)
    return said, _still_works()


def _still_works():
    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()


@pytest.mark.parametrize("what, rank0, rank1", [
    ("tuple", "stage 0 returned a tuple: a stage that passes its output on must return one tensor", None),
    ("ints", "stage 0's output is torch.int64: the output a stage passes on must be floating point", None),
    ("fewer microbatches", "the schedule runs 4 microbatches; run() got 2 inputs",
     "the schedule runs 4 microbatches; run() got 2 targets"),
    ("no targets", None, "this rank holds the last stage: run() needs its targets, one a microbatch"),
    ("deadlock", "the schedule deadlocks: rank 0 at B0, rank 1 at F1", "the schedule deadlocks: rank 0 at B0"),
    ("uneven", f"microbatch 1 is torch.float32 (2, {WIDTH}), but agree_shapes() was given torch.float32 (3, {WIDTH})",
     None),
    ("schedule's ranks", "the schedule has 3 ranks' actions; this pipeline has 2 ranks",
     "the schedule has 3 ranks' actions"),
])
def test_a_plain_mistake_is_a_one_line_error_before_any_message(what, rank0, rank1):
    results = run_on_ranks(_mistake, 2, args=(what,), backend="gloo", timeout=60)
    for rank, ((said, after), want) in enumerate(zip(results, (rank0, rank1))):
        if want is None:
            assert said is None, (rank, said)
        else:
            assert said is not None and said.startswith(want) and "\n" not in said, (rank, said)
        assert after == 2.0, "the group still works after the error"


def _with_batchnorm(env, m):
    """A Linear, BatchNorm1d and Linear on 2 stages (training mode) against the same model on one
    rank, microbatch by microbatch: (losses same bits (last rank), gradients same bits, the chunk's
    training flags after agree_shapes)."""
    r, p = env.rank, env.world_size

    def model():
        torch.manual_seed(3)
        return nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Dropout(0.0), nn.Linear(8, 3))

    whole, mine = model(), split(model(), 2, sizes=[2, 2])[r]
    x = torch.randn(4 * m, 8, generator=torch.Generator().manual_seed(5))
    y = torch.randint(0, 3, (4 * m,), generator=torch.Generator().manual_seed(6))
    want = []
    for xi, yi in zip(x.tensor_split(m), y.tensor_split(m)):
        loss = F.cross_entropy(whole(xi), yi)
        loss.backward()
        want.append(loss.detach())
    for q in whole.parameters():
        q.grad.div_(m)
    stage = Stage(mine, r, p, loss_fn=F.cross_entropy)
    xs, ys = list(x.tensor_split(m)), list(y.tensor_split(m))
    stage.agree_shapes(xs[0] if r == 0 else None)
    modes = [mod.training for mod in mine.modules()]
    result = stage.run(one_f_one_b(p, m), xs if r == 0 else None, ys if r == 1 else None)
    part = split(whole, 2, sizes=[2, 2])[r]
    grads = [torch.equal(a.grad, b.grad) for a, b in zip(mine.parameters(), part.parameters())]
    stats = [torch.equal(a, b) for a, b in zip(mine.buffers(), part.buffers())]
    losses = [torch.equal(result.losses[i], want[i]) for i in range(m)] if r == 1 else []
    return losses, grads, stats, modes


def test_a_model_with_batchnorm_trains_in_train_mode_bit_for_bit_the_one_rank_model():
    for rank, (losses, grads, stats, modes) in enumerate(run_on_ranks(_with_batchnorm, 2, args=(3,), backend="gloo")):
        assert all(modes), (rank, modes)  # agree_shapes ran the chunk in eval mode, and gave its modes back
        assert all(grads) and all(stats) and all(losses), (rank, losses, grads, stats)
        assert len(stats) == (3 if rank == 0 else 0) and len(losses) == (3 if rank == 1 else 0)


class _Slow(nn.Module):
    """Sleeps `seconds` in its forward: the stage after it is known to wait for each message."""

    def __init__(self, seconds):
        super().__init__()
        self.seconds, self.layer = seconds, nn.Linear(4, 4)

    def forward(self, x):
        time.sleep(self.seconds)
        return self.layer(x)


def _waiting(env, seconds, m):
    r, p = env.rank, env.world_size
    torch.manual_seed(0)
    stages = [nn.Sequential(_Slow(seconds)), nn.Sequential(nn.Linear(4, 3))]
    stage = Stage(stages[r], r, p, loss_fn=F.cross_entropy)
    xs = list(torch.randn(2 * m, 4).tensor_split(m))
    ys = list(torch.zeros(2 * m).long().tensor_split(m))
    stage.agree_shapes(xs[0] if r == 0 else None)
    if r == 0:
        time.sleep(0.2)  # rank 0's step starts 0.2 s after rank 1's: the trace must place it so
    return stage.run(gpipe(p, m), xs if r == 0 else None, ys if r == 1 else None)


def test_a_stage_that_waits_for_its_messages_counts_the_wait_as_idle_and_the_trace_shows_it():
    seconds, m = 0.05, 4
    results = run_on_ranks(_waiting, 2, args=(seconds, m), backend="gloo", timeout=60)
    first, last = results
    # rank 0 sleeps m times in its forwards, which are compute; rank 1 waits for each of them
    assert first.compute_s >= m * seconds and first.idle_share < 0.5, (first.compute_s, first.step_s)
    waits = [began - waited for a, waited, began, _ in last.timeline if a.kind == "F"]
    assert sum(waits) >= (m - 1) * seconds * 0.9, waits
    assert last.compute_s <= last.step_s - sum(waits) + 1e-6, "a wait for a message is not compute"
    assert last.idle_share >= sum(waits) / last.step_s - 1e-6 and last.idle_share > 0.5, last.idle_share
    # the Chrome trace, in microseconds: each rank's events end within its step, which it spans
    events = chrome_trace_events(results)
    t0 = min(res.started for res in results)
    for rank, res in enumerate(results):
        mine = [e for e in events if e["pid"] == rank]
        start = min(e["ts"] for e in mine) / 1e6 + t0
        end = max(e["ts"] + e["dur"] for e in mine) / 1e6 + t0
        assert res.started - 1e-6 <= start and end <= res.started + res.step_s + 1e-6, (rank, start, end)
        assert end - start >= 0.5 * res.step_s, (rank, end - start, res.step_s)  # the trace spans its step
        computing = sorted((e["ts"], e["dur"]) for e in mine if e["tid"] == "compute")
        assert sum(d for _, d in computing) == pytest.approx(res.compute_s * 1e6, rel=1e-6)
        assert all(a + da <= b + 1e-3 for (a, da), (b, _) in zip(computing, computing[1:])), "one action at a time"
    assert results[0].started - results[1].started >= 0.15
    waited = sum(e["dur"] for e in events if e["pid"] == 1 and e["name"].startswith("wait for F"))
    assert waited == pytest.approx(sum(waits) * 1e6, rel=1e-6)
