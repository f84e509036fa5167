"""ddp_from_scratch/tensor_parallel/messages.py: the closed forms against the model they describe (its
parameters counted), the messages of each layout, and the break-even it states.

    pytest tests/tensor_parallel/test_tensor_parallel_messages.py -q
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from collectives.algorithms.cost import CostModel
from ddp_from_scratch.tensor_parallel.messages import (Shape, break_even_tokens, pipeline_break_even_tokens,
                                                   pipeline_messages, step_messages)
from ddp_from_scratch.workload.transformer import TinyTransformer


@settings(max_examples=20, deadline=None)
@given(vocab=st.integers(1, 40), hidden=st.sampled_from([4, 8, 12]), layers=st.integers(0, 3))
def test_the_parameter_count_is_the_models(vocab, hidden, layers):
    model = TinyTransformer(vocab, hidden, 4, layers)
    whole = sum(p.numel() for name, p in model.named_parameters()
                if "ln" in name or name.endswith(("attn.out.bias", "mlp.2.bias")))
    shape = Shape(vocab, hidden, 4, layers, tokens=1)
    assert shape.parameters() == sum(p.numel() for p in model.parameters())
    assert shape.whole_on_every_tp_rank() == whole


def test_each_layout_sends_its_closed_form():
    shape = Shape(vocab=256, hidden=64, heads=4, layers=2, tokens=512)
    p, bsh, bs = shape.parameters(), 512 * 64, 512
    dp = step_messages(shape, world_size=4, tp=1)
    assert dp.tp_messages == [] and dp.dp_messages == [(p, 4)]  # 0.5 MiB: one bucket
    tp = step_messages(shape, world_size=4, tp=4)
    assert tp.dp_messages == [] and tp.elements["tp"] == (4 * 2 + 2) * bsh + 3 * bs
    both = step_messages(shape, world_size=4, tp=2)
    whole = shape.whole_on_every_tp_rank()
    assert both.elements == {"tp": (4 * 2 + 2) * bsh // 2 + 3 * bs // 2, "dp": (p - whole) // 2 + whole, "pp": 0}
    assert all(group == 2 for _, group in both.tp_messages + both.dp_messages)


def test_buckets_split_the_gradients_into_messages_that_sum_to_them():
    shape = Shape(vocab=1000, hidden=512, heads=8, layers=4, tokens=64)
    msgs = step_messages(shape, world_size=2, tp=1, bucket_bytes=1 << 20).dp_messages
    assert len(msgs) == -(-shape.parameters() * 4 // (1 << 20)) and sum(n for n, _ in msgs) == shape.parameters()


def test_below_the_break_even_tp_sends_fewer_bytes_and_above_it_more():
    for shape in (Shape(256, 64, 4, 2, 1), Shape(512, 1024, 8, 4, 1)):
        t0 = break_even_tokens(shape)
        below, above = (Shape(shape.vocab, shape.hidden, shape.heads, shape.layers, int(t))
                        for t in (t0 * 0.9, t0 * 1.1 + 1))
        for s, tp_fewer in ((below, True), (above, False)):
            m = step_messages(s, 2, 2), step_messages(s, 2, 1)
            assert (m[0].elements["tp"] < m[1].elements["dp"]) == tp_fewer, (s, m)


def test_predicted_seconds_add_one_alpha_per_message_and_the_bytes():
    model = CostModel(alpha=1.0, beta=0.0, gamma=0.0)
    tp = step_messages(Shape(64, 16, 4, 3, 32), world_size=2, tp=2)
    assert tp.seconds(model)["tp"] == pytest.approx(2 * len(tp.tp_messages))  # a ring on 2: 2 (p - 1) alphas each
    assert tp.seconds(model)["dp"] == 0


def test_a_tp_size_that_does_not_divide_the_world_is_refused():
    with pytest.raises(ValueError, match="the TP size 3 must divide the world size 4"):
        step_messages(Shape(64, 16, 4, 1, 8), world_size=4, tp=3)


@settings(max_examples=50, deadline=None)
@given(pp=st.integers(1, 4), dp=st.integers(1, 3), m=st.integers(1, 6))
def test_a_pipeline_sends_a_microbatch_each_way_per_stage_boundary(pp, dp, m):
    """Per step: m sends of T h / (d m) elements for the first or last stage of two, 2m for an
    inner stage, and DP over the replicas of the stage's share of the parameters; the bubble
    (p-1)/(m+p-1); and the break-even is where those sends match a ring all_reduce of P."""
    shape = Shape(vocab=64, hidden=16, heads=4, layers=2, tokens=dp * m * 32)
    plan = pipeline_messages(shape, pp * dp, pp, m)
    sends = 0 if pp == 1 else m if pp == 2 else 2 * m
    assert plan.pp_messages == [32 * 16] * sends
    assert plan.elements["dp"] == (shape.parameters() // pp if dp > 1 else 0) and plan.elements["tp"] == 0
    assert plan.bubble == pytest.approx((pp - 1) / (m + pp - 1))
    model = CostModel(alpha=1e-5, beta=1e-9, gamma=0.0)
    assert plan.seconds(model)["pp"] == pytest.approx(sends * (1e-5 + 1e-9 * 32 * 16 * 4))
    t = pipeline_break_even_tokens(shape)
    assert 2 * t * shape.hidden == pytest.approx(2 * shape.parameters())
