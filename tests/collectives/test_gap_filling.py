"""The gaps the wrappers fill. NCCL has no bitwise reductions, so the wrappers all_gather and
fold locally; that path is forced here on Gloo for every op (not only the bitwise ones), every
dtype and world sizes 2-4, for all_reduce, reduce and reduce_scatter, and inside a subgroup whose
group ranks differ from the global ones, all against closed forms.

    pytest tests/collectives/test_gap_filling.py -q
"""

import contextlib

import pytest
import torch

import collectives as C
from collectives import ops, reduce_ops
from collectives.testing import distributed, run_on_ranks

from .test_ops import DTYPES, GAP_DTYPES, _reductions_body, contribution, expected, valid_ops


@contextlib.contextmanager
def gather_and_fold_only():
    """Declare every op unsupported by the backend, so every reduction takes the fold path."""
    real = reduce_ops.backend_supports
    reduce_ops.backend_supports = lambda backend, name: False
    ops._all_reduce_ready.clear()  # earlier tests in this pool may have cached the native path
    try:
        yield
    finally:
        reduce_ops.backend_supports = real
        ops._all_reduce_ready.clear()


def _folded(env, dtype):
    with gather_and_fold_only():
        for collective in ("all_reduce", "reduce", "reduce_scatter"):
            _reductions_body(env, collective, dtype)


@pytest.mark.parametrize("dtype", DTYPES + GAP_DTYPES, ids=str)
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_every_op_by_gather_and_fold(world_size, dtype):
    run_on_ranks(_folded, world_size, args=(dtype,))


@distributed(world_size=4)
def test_fold_path_inside_a_subgroup(env):
    """Group [1, 2, 3]: global rank 3 is group rank 2. Roots and chunks must follow group ranks."""
    trio = C.split([[1, 2, 3]])
    if env.rank == 0:
        return
    g, n = env.rank - 1, 3  # group rank, group size
    with gather_and_fold_only():
        for op in valid_ops(torch.int32):
            t = contribution(g, op, torch.int32, 2 * n)
            C.reduce(t, dst=3, op=op, group=trio)
            if env.rank == 3:
                assert torch.equal(t, expected(op, torch.int32, n, 2 * n)), op
            got = C.reduce_scatter(contribution(g, op, torch.int32, 2 * n), op=op, group=trio)
            assert torch.equal(got, expected(op, torch.int32, n, 2 * n)[2 * g:2 * g + 2]), op


@distributed(world_size=3)
def test_bitwise_ops_by_gather_and_fold(env):
    with gather_and_fold_only():
        flags = torch.tensor([env.rank == 0, True, False])
        assert C.all_reduce(flags, op="bor").tolist() == [True, True, False]
        assert C.all_reduce(torch.tensor([env.rank == 0, True, False]), op="band").tolist() == [False, True, False]


@distributed(world_size=2)
def test_reduce_op_values_and_names_are_the_same(env):
    import torch.distributed as dist

    for op in ["max", "MAX", dist.ReduceOp.MAX, dist.ReduceOp(dist.ReduceOp.MAX)]:
        assert C.all_reduce(torch.tensor([env.rank + 1.0]), op=op).item() == 2.0
