"""The one-rank mixture-of-experts layer (ddp_from_scratch/expert_parallel/moe.py), the reference
the expert-parallel layer is proven against, checked against what it claims: each token's output
is its chosen experts' outputs weighted by the router's probabilities (against a token-by-token
loop), the balance loss's closed forms, the capacity's drops counted in closed form and in
priority order, and bad sizes refused by name.

    pytest tests/expert_parallel/test_moe.py -q
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ddp_from_scratch.expert_parallel.moe import MoE
from ddp_from_scratch.expert_parallel.router import blocked_linear
from ddp_from_scratch.expert_parallel.routing import capacity_of, load_balancing_loss, make_plan

H = 8


@settings(max_examples=25, deadline=None)
@given(tokens=st.integers(1, 12), experts=st.integers(1, 6), top_k=st.integers(1, 3), seed=st.integers(0, 99))
def test_each_token_is_its_chosen_experts_weighted_by_the_router(tokens, experts, top_k, seed):
    """Without a capacity: y_t = sum_k p_k(t) x expert_{e_k(t)}(x_t), token by token (the layer
    multiplies every expert's rows at once, so the bits may differ: within float32 rounding)."""
    top_k = min(top_k, experts)
    torch.manual_seed(seed)
    moe = MoE(H, experts, top_k, ffn=16)
    x = torch.randn(tokens, H)
    y, aux = moe(x)
    probs = (x @ moe.router.weight.t()).softmax(-1)
    for t in range(tokens):
        p, chosen = probs[t].topk(top_k)
        want = sum(p[i] * moe.experts[int(e)](x[t:t + 1])[0] for i, e in enumerate(chosen))
        torch.testing.assert_close(y[t], want, rtol=1e-5, atol=1e-6)
    assert int(moe.last.dropped.sum()) == 0 and int(moe.last.routed.sum()) == tokens * top_k
    assert aux.shape == (1,)


def test_the_balance_loss_is_1_when_uniform_and_e_when_one_expert_takes_all():
    """aux = E x sum_e f_e P_e: a uniform router (P_e = 1/E) gives 1 whatever it picks; a router
    that sends every token to expert 0 with probability ~1 gives E."""
    torch.manual_seed(0)
    for experts in (2, 4, 5):
        moe = MoE(H, experts, top_k=1)
        with torch.no_grad():
            moe.router.weight.zero_()
        _, aux = moe(torch.randn(2, 6, H))
        torch.testing.assert_close(aux, torch.ones(2))
        moe.router.skew.copy_(torch.tensor([50.0] + [0.0] * (experts - 1)))
        _, aux = moe(torch.randn(2, 6, H))
        torch.testing.assert_close(aux, torch.full((2,), float(experts)))


def test_the_balance_loss_gradient_reaches_the_router():
    torch.manual_seed(0)
    moe = MoE(H, 4, top_k=2)
    _, aux = moe(torch.randn(3, 5, H))
    aux.sum().backward()
    assert moe.router.weight.grad is not None and moe.router.weight.grad.abs().sum() > 0
    assert all(p.grad is None for p in moe.experts.parameters())  # aux does not reach the experts


@pytest.mark.parametrize("factor", [0.25, 0.5, 1.0, 2.0])
def test_the_capacity_drops_past_c_in_closed_form_first_choices_first(factor):
    """Every token picks expert 0 first and expert 1 second (a skewed router): in each group of T
    tokens expert 0 keeps its first C = ceil(factor x T x 2 / E) tokens and drops T - C, expert 1
    the same; the kept first choices are the group's first C tokens, and a dropped slot adds
    nothing to its token's output."""
    torch.manual_seed(0)
    experts, groups, per = 4, 3, 8
    moe = MoE(H, experts, top_k=2, capacity_factor=factor)
    moe.router.skew.copy_(torch.tensor([60.0, 30.0, 0.0, 0.0]))
    x = torch.randn(groups, per, H)
    y, _ = moe(x)
    c = math.ceil(factor * per * 2 / experts)
    assert capacity_of(per, 2, experts, factor) == c
    kept = min(c, per)
    assert moe.last.routed.tolist() == [groups * per, groups * per, 0, 0]
    assert moe.last.dropped.tolist() == [groups * (per - kept), groups * (per - kept), 0, 0]
    p = (x @ moe.router.weight.t() + moe.router.skew).softmax(-1)
    for t in range(per):
        want = p[:, t, 0:1] * moe.experts[0](x[:, t]) + p[:, t, 1:2] * moe.experts[1](x[:, t]) if t < kept \
            else torch.zeros(groups, H)
        torch.testing.assert_close(y[:, t], want, rtol=1e-5, atol=1e-6)


def test_second_choices_wait_for_every_first_choice():
    """Priority is by choice, then token: with room for 3 pairs, expert 1 (the first choice of
    tokens 2 and 3, the second of tokens 0 and 1) keeps tokens 2 and 3 first, then token 0."""
    chosen = torch.tensor([[0, 1], [0, 1], [1, 0], [1, 0]])
    plan = make_plan(chosen, experts=2, capacity_factor=0.75)  # C = ceil(0.75 x 4 x 2 / 2) = 3
    assert plan.capacity == 3
    kept = {(int(i) // 2, int(i) % 2) for i in plan.order}  # (token, slot)
    assert kept == {(0, 0), (1, 0), (2, 1), (2, 0), (3, 0), (0, 1)}
    assert plan.dropped.tolist() == [1, 1]
    assert plan.counts.tolist() == [3, 3] and plan.tokens_of_rows.tolist() == [0, 1, 2, 0, 2, 3]


def test_blocked_linear_is_the_product_and_adds_the_blocks_gradients_in_order():
    torch.manual_seed(0)
    x, w = torch.randn(12, 5, requires_grad=True), torch.randn(3, 5, requires_grad=True)
    g = torch.randn(12, 3)
    blocked_linear(x, w, 4).backward(g)
    want = g[0:3].t() @ x[0:3].detach()
    for b in range(1, 4):
        want = want + g[3 * b:3 * b + 3].t() @ x[3 * b:3 * b + 3].detach()
    assert torch.equal(w.grad, want)
    torch.testing.assert_close(x.grad, g @ w.detach())
    with pytest.raises(ValueError, match="12 tokens do not cut into 5 equal blocks"):
        blocked_linear(x, w, 5)


def test_bad_sizes_are_refused_by_name():
    with pytest.raises(ValueError, match="top_k 3 must be between 1 and the 2 experts"):
        MoE(H, 2, top_k=3)
    with pytest.raises(ValueError, match="capacity_factor must be above 0"):
        MoE(H, 2, capacity_factor=0)
    with pytest.raises(ValueError, match="7 tokens do not make 2 equal groups"):
        make_plan(torch.zeros(7, 1, dtype=torch.long), experts=2, groups=2)
    with pytest.raises(ValueError, match="7 tokens do not make 2 equal groups"):
        load_balancing_loss(torch.ones(7, 2) / 2, torch.zeros(7, 1, dtype=torch.long), experts=2, groups=2)
