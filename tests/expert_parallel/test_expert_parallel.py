"""Expert parallelism (ddp_from_scratch/expert_parallel): the layer with its experts over 2 and 4
ranks, on Gloo and on the shm backend's native path, against the one-rank layer on the same
tokens, bit for bit: outputs, the balance loss of every group, the input's gradient, the router's
gradient (summed in rank order) and every expert's gradient. A property test draws the tokens,
the groups, E = N or 2N, top-1 or top-2, the capacity (none, tight, loose) and the router (plain,
or skewed so that every token picks one expert and the others get none).

    pytest tests/expert_parallel/test_expert_parallel.py -q
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from hypothesis import example, given, settings
from hypothesis import strategies as st

from collectives.testing import distributed, kept_groups
from ddp_from_scratch.expert_parallel.layer import ExpertParallelMoE
from ddp_from_scratch.expert_parallel.moe import MoE

H = 8


def _layer(experts: int, top_k: int, capacity_factor, skewed: bool) -> MoE:
    torch.manual_seed(0)
    moe = MoE(H, experts, top_k, ffn=12, capacity_factor=capacity_factor)
    if skewed:  # every token's first choice is expert 0, its second expert 1: the others get nothing
        moe.router.skew.copy_(torch.tensor([60.0, 30.0] + [0.0] * (experts - 2)))
    return moe


def _group(backend: str):
    if backend != "shm":
        return None
    from collectives.shm import new_group_with
    return kept_groups("native", lambda: new_group_with({"COLLECTIVES_SHM_PATH": "native"}))


def _compare(env, backend, tokens, groups, per_rank_experts, top_k, capacity_factor, skewed):
    """Rank r's tokens are rows r x G x T ... of the global tokens; the one-rank layer runs all of
    them with blocks=N (its router's product cut as the ranks cut it)."""
    n, r = env.world_size, env.rank
    experts = per_rank_experts * n
    top_k = min(top_k, experts)
    g = torch.Generator().manual_seed(tokens * 7 + groups)
    rows = n * groups * tokens
    x, dy = torch.randn(rows, H, generator=g), torch.randn(rows, H, generator=g)
    one = _layer(experts, top_k, capacity_factor, skewed)
    x_one = x.clone().requires_grad_(True)
    y_one, aux_one = one(x_one, groups=n * groups, blocks=n)
    torch.autograd.backward([y_one, aux_one], [dy, torch.ones_like(aux_one)])

    group = _group(backend)
    ep = ExpertParallelMoE(_layer(experts, top_k, capacity_factor, skewed), group)
    mine = slice(r * groups * tokens, (r + 1) * groups * tokens)
    x_ep = x[mine].clone().requires_grad_(True)
    y_ep, aux_ep = ep(x_ep, groups=groups)
    torch.autograd.backward([y_ep, aux_ep], [dy[mine], torch.ones_like(aux_ep)])
    ep.sync_router_grad()

    case = f"rank {r}: {backend} N={n} T={tokens} G={groups} E={experts} k={top_k} cf={capacity_factor} skew={skewed}"
    assert torch.equal(y_ep, y_one.detach()[mine]), case
    assert torch.equal(aux_ep, aux_one.detach()[r * groups:(r + 1) * groups]), case
    assert torch.equal(x_ep.grad, x_one.grad[mine]), case
    assert torch.equal(ep.router.weight.grad, one.router.weight.grad), case
    for local, expert in enumerate(ep.experts):
        theirs = one.experts[ep.first_expert + local]
        for (name, p), q in zip(expert.named_parameters(), theirs.parameters()):
            assert torch.equal(p.grad, q.grad), f"{case}: expert {ep.first_expert + local}'s {name}"
    # the drops: this rank's share of the one-rank layer's, counted on both
    routed_everywhere = torch.stack([t for t in _gathered(ep.last.routed, group)]).sum(0)
    dropped_everywhere = torch.stack([t for t in _gathered(ep.last.dropped, group)]).sum(0)
    assert torch.equal(routed_everywhere, one.last.routed) and torch.equal(dropped_everywhere, one.last.dropped), case
    if capacity_factor is None:
        assert int(one.last.dropped.sum()) == 0, case
    if skewed:  # experts 2 ... get no token, and their gradients are zeros on both
        assert int(one.last.routed[2:].sum()) == 0 and int(one.last.routed[0]) == rows, case
    if backend == "shm":
        from collectives.shm import backend_of
        assert backend_of(group).fallbacks() == {}, f"{case}: calls left the native path"


def _gathered(t, group):
    out = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, t, group=group)
    return out


CASES = dict(tokens=st.integers(1, 6), groups=st.integers(1, 3), per_rank_experts=st.sampled_from([1, 2]),
             top_k=st.sampled_from([1, 2]), capacity_factor=st.sampled_from([None, 0.5, 1.0, 1.5]),
             skewed=st.booleans())


# named cases first, then drawn ones: top-1 on E = N; top-2 on E = 2N with drops; every token to
# expert 0 first (expert 1 second), a tight capacity, and experts that get no token
NAMED = [dict(tokens=5, groups=2, per_rank_experts=1, top_k=1, capacity_factor=None, skewed=False),
         dict(tokens=6, groups=1, per_rank_experts=2, top_k=2, capacity_factor=1.0, skewed=False),
         dict(tokens=4, groups=3, per_rank_experts=2, top_k=2, capacity_factor=0.5, skewed=True)]


def _named(test):
    for case in reversed(NAMED):
        test = example(**case)(test)
    return test


@pytest.mark.parametrize("backend", ["gloo", "shm"])
@settings(max_examples=12, deadline=None)
@_named
@given(**CASES)
@distributed(world_size=2)
def test_expert_parallel_is_the_one_rank_layer_bit_for_bit_on_2_ranks(env, backend, tokens, groups, per_rank_experts,
                                                                       top_k, capacity_factor, skewed):
    _compare(env, backend, tokens, groups, per_rank_experts, top_k, capacity_factor, skewed)


@pytest.mark.parametrize("backend", ["gloo", "shm"])
@settings(max_examples=5, deadline=None)
@_named
@given(**CASES)
@distributed(world_size=4)
def test_expert_parallel_is_the_one_rank_layer_bit_for_bit_on_4_ranks(env, backend, tokens, groups, per_rank_experts,
                                                                       top_k, capacity_factor, skewed):
    _compare(env, backend, tokens, groups, per_rank_experts, top_k, capacity_factor, skewed)


@distributed(world_size=2)
def test_experts_that_do_not_spread_over_the_ranks_are_refused_by_name(env):
    with pytest.raises(ValueError, match="3 experts do not spread evenly over the 2 ranks"):
        ExpertParallelMoE(_layer(3, 1, None, False), None)
    ep = ExpertParallelMoE(_layer(2, 1, None, False), None)  # the group still works afterwards
    with pytest.raises(RuntimeError, match="no gradient yet"):
        ep.sync_router_grad()
    y, _ = ep(torch.ones(3, H))
    assert y.shape == (3, H)


@distributed(world_size=2)
def test_the_ranks_experts_put_together_are_the_one_rank_models(env):
    """expert_state names each rank's experts by their index in the whole layer: the union over
    ranks is the one-rank model's experts, each held by exactly one rank."""
    from ddp_from_scratch.expert_parallel.model import MoETransformer, expert_parallel, expert_state

    torch.manual_seed(0)
    full = MoETransformer(vocab=16, hidden=8, heads=2, layers=2, experts=4, top_k=2)
    mine = expert_state(expert_parallel(full, None))
    everyone = [None] * env.world_size
    dist.all_gather_object(everyone, mine)
    merged = {}
    for state in everyone:
        assert not set(state) & set(merged)  # no expert on two ranks
        merged.update(state)
    want = expert_state(full)
    assert sorted(merged) == sorted(want) and all(torch.equal(merged[k], want[k]) for k in want)
    assert len(mine) == len(want) // env.world_size


@settings(max_examples=3, deadline=None)
@_named
@given(**CASES)
@distributed(world_size=3)
def test_expert_parallel_is_the_one_rank_layer_bit_for_bit_on_3_ranks(env, tokens, groups, per_rank_experts, top_k,
                                                                       capacity_factor, skewed):
    """An odd world size: 3 or 6 experts, the router's gradients added over 3 ranks in rank order."""
    _compare(env, "gloo", tokens, groups, per_rank_experts, top_k, capacity_factor, skewed)
