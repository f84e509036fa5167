"""Our PowerSGD (ddp_from_scratch/powersgd.py) against torch's powerSGD_hook on the same model,
data and seeds, every parameter and gradient compared bit for bit after every step, across the
start iteration (plain DDP, then compressed), at 2, 3 and 4 ranks, on Gloo and on shm; that the
compression is real (the gradients are the rank-r approximation, the elements all-reduced are the
closed form's); the batched form against torch's batched_powerSGD_hook with its orthogonalization
of a single matrix fixed (torch 2.13's raises AssertionError); and the orthogonalization itself.

    pytest tests/ddp/test_powersgd.py -q
"""

import copy

import pytest
import torch
import torch.nn.functional as F
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from ddp_from_scratch.compare import train_side_by_side
from ddp_from_scratch.models import MODELS, batch
from ddp_from_scratch.powersgd import PowerSGD, compressed_numel, orthogonalize
from ddp_from_scratch.wrap import wrap

STEPS = 5
CONFIGS = {
    "rank 1 (Gram-Schmidt), error feedback, warm start": dict(matrix_approximation_rank=1, start_powerSGD_iter=2),
    "rank 3 (QR), no warm start": dict(matrix_approximation_rank=3, start_powerSGD_iter=3, warm_start=False),
    "rank 2, neither error feedback nor warm start, every matrix compressed": dict(
        matrix_approximation_rank=2, start_powerSGD_iter=2, use_error_feedback=False, warm_start=False,
        min_compression_rate=1),
    "rank 4, same shapes batched, epsilon 1e-8": dict(matrix_approximation_rank=4, start_powerSGD_iter=2,
                                                        batch_tensors_with_same_shape=True,
                                                        orthogonalization_epsilon=1e-8),
    "rank 2, plain DDP through step 3 then compressed": dict(matrix_approximation_rank=2, start_powerSGD_iter=4,
                                                              random_seed=7),
}


def _torch_side(options):
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as P

    state = P.PowerSGDState(process_group=None, **{k: v for k, v in options.items() if k != "batched"})
    return state, (P.batched_powerSGD_hook if options.get("batched") else P.powerSGD_hook)


def _side_by_side(env, options, steps=STEPS):
    checks = train_side_by_side(env, "bucketed", steps, model="small", torch_comm_hook=_torch_side(options),
                                ours_kwargs={"compress": PowerSGD(**options)}, ddp_kwargs={"bucket_cap_mb": 0.01})
    return [c.params and c.loss for c in checks], max(c.largest_diff for c in checks)


@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("label", list(CONFIGS))
def test_bitwise_torchs_powersgd_hook_every_step(label, world_size, dist_run):
    for bitwise, largest in dist_run(_side_by_side, world_size, args=(CONFIGS[label],), timeout=120):
        assert bitwise == [True] * STEPS, (label, bitwise, largest)


def test_bitwise_on_shm_too(dist_run):
    options = CONFIGS["rank 1 (Gram-Schmidt), error feedback, warm start"]
    for bitwise, largest in dist_run(_side_by_side, 3, args=(options,), backend="shm", timeout=120):
        assert bitwise == [True] * STEPS, (bitwise, largest)


def _batched_against_torchs_fixed(env, options):
    """torch 2.13's batched_powerSGD_hook hands a 2-D Q to _orthogonalize, which takes batches of
    matrices only: AssertionError at the first compressed step. With that one call given a batch
    of one (what the hook means), the rest is torch's, and ours must match it bit for bit."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as P

    original = P._orthogonalize
    P._orthogonalize = lambda m, epsilon=0: original(m.unsqueeze(0) if m.dim() == 2 else m, epsilon)
    try:
        return _side_by_side(env, {**options, "batched": True})
    finally:
        P._orthogonalize = original


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("options", [dict(matrix_approximation_rank=1, start_powerSGD_iter=2),
                                     dict(matrix_approximation_rank=3, start_powerSGD_iter=3, warm_start=False,
                                          use_error_feedback=False)], ids=["rank 1", "rank 3, no memories"])
def test_batched_bitwise_torchs_batched_hook_with_its_orthogonalization_fixed(options, world_size, dist_run):
    for bitwise, largest in dist_run(_batched_against_torchs_fixed, world_size, args=(options,), timeout=120):
        assert bitwise == [True] * STEPS, (bitwise, largest)


def _torchs_batched_hook_as_it_is(env):
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as P

    fixed = P._orthogonalize
    P._orthogonalize = getattr(fixed, "original", fixed)  # torch's own, if an earlier case in this rank fixed it
    try:
        _side_by_side(env, {"matrix_approximation_rank": 1, "start_powerSGD_iter": 2, "batched": True}, steps=3)
    except AssertionError as exc:
        return "_orthogonalize" in "".join(__import__("traceback").format_tb(exc.__traceback__))
    finally:
        P._orthogonalize = fixed
    return "ran"


def test_torchs_own_batched_hook_fails_at_its_first_compressed_step(dist_run):
    """Why the batched row compares against a fixed hook: if torch fixes it, this fails, and the
    row can compare against torch's own."""
    assert dist_run(_torchs_batched_hook_as_it_is, 2, timeout=120) == [True, True]


def _approximation_and_bytes(env, options):
    """Ours against plain DDP on the same inputs: equal before start_powerSGD_iter, different
    after; the elements all-reduced per compressed step are the closed form's."""
    torch.manual_seed(100 + env.rank)
    base = MODELS["small"]()
    plain = wrap(copy.deepcopy(base), "bucketed", bucket_cap_mb=0.01)
    ours = wrap(base, "bucketed", bucket_cap_mb=0.01, compress=PowerSGD(**options))
    same, per_step = [], []
    for step in range(4):
        x, y = batch(step, env.rank, 4, 12)
        before = ours.compress.numel_all_reduced
        for m in (plain, ours):
            m.zero_grad()
            F.cross_entropy(m(x), y).backward()
        per_step.append(ours.compress.numel_all_reduced - before)
        same.append(all(torch.equal(a.grad, b.grad) for a, b in zip(plain.parameters(), ours.parameters())))
    rank = options["matrix_approximation_rank"]
    expected = 0
    for b in ours.buckets:
        for v in b.views:
            rows, cols = v.shape[0], v[0].numel()
            r = min(rows, cols, rank)
            expected += compressed_numel(rows, cols, rank) if (rows + cols) * r * 2 < rows * cols else v.numel()
    total = sum(p.numel() for p in ours.parameters())
    return same, per_step, expected, total


def test_compression_is_real_and_moves_the_closed_forms_elements(dist_run):
    options = dict(matrix_approximation_rank=1, start_powerSGD_iter=2, use_error_feedback=False, warm_start=False)
    same, per_step, expected, total = dist_run(_approximation_and_bytes, 2, args=(options,))[0]
    assert same == [True, True, False, False], same  # plain DDP for 2 steps, then the rank-1 approximation
    assert per_step == [total, total, expected, expected], (per_step, expected, total)
    assert expected < total / 4  # the small CNN's convolutions and linear layers shrink by far more than that


@pytest.mark.parametrize("options, says", [
    (dict(matrix_approximation_rank=0), "matrix_approximation_rank must be a whole number >= 1, got 0"),
    (dict(matrix_approximation_rank=1.5), "matrix_approximation_rank must be a whole number >= 1, got 1.5"),
    (dict(start_powerSGD_iter=1), "start_powerSGD_iter must be at least 2 with error feedback or warm start"),
])
def test_bad_options_are_named(options, says):
    with pytest.raises(ValueError, match=says):
        PowerSGD(**options)
    PowerSGD(start_powerSGD_iter=1, use_error_feedback=False, warm_start=False)  # torch allows this one too


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 3), st.integers(1, 40), st.integers(1, 6), st.integers(0, 2**31 - 1),
       st.sampled_from([0.0, 1e-8]))
def test_orthogonalize_gives_orthonormal_columns(batch_size, rows, rank, seed, epsilon):
    rank = min(rank, rows)
    m = torch.randn(batch_size, rows, rank, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    # with an epsilon a column comes out of norm n / (n + epsilon): unit within 1e-7 where no
    # column's norm (along the way) falls under 0.1, which the smallest singular value bounds
    assume(epsilon == 0 or torch.linalg.svdvals(m).min() >= 0.1)
    orthogonalize(m, epsilon)
    eye = torch.eye(rank, dtype=torch.float64).expand(batch_size, rank, rank)
    torch.testing.assert_close(m.transpose(1, 2) @ m, eye, atol=1e-6, rtol=0)


def test_orthogonalize_refuses_what_is_not_a_batch_of_tall_matrices():
    for shape in [(4, 2), (1, 2, 3)]:
        with pytest.raises(ValueError, match="a batch of matrices with no more columns than rows"):
            orthogonalize(torch.ones(shape))
