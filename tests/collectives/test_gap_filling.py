"""The gaps the wrappers fill. NCCL has no bitwise reductions, so the wrappers gather and fold;
that code path is exercised here on Gloo by declaring the op unsupported, against closed forms.

    pytest tests/collectives/test_gap_filling.py -q
"""

import functools

import torch

import collectives as C
from collectives import ops, reduce_ops
from collectives.testing import distributed


@distributed(world_size=3)
def test_bitwise_ops_by_gather_and_fold(env):
    real = reduce_ops.backend_supports
    reduce_ops.backend_supports = lambda backend, name: name not in reduce_ops.BITWISE
    ops._all_reduce_ready.clear()  # earlier tests in this pool may have cached the native path
    try:
        r, n = env.rank, env.world_size
        for op, fn in [("band", int.__and__), ("bor", int.__or__), ("bxor", int.__xor__)]:
            want = functools.reduce(fn, [(1 << i) | 8 for i in range(n)])
            t = torch.full((6,), (1 << r) | 8, dtype=torch.int32)
            assert C.all_reduce(t, op=op).tolist() == [want] * 6, op
            t = torch.full((6,), (1 << r) | 8, dtype=torch.int64)
            C.reduce(t, dst=1, op=op)
            assert r != 1 or t.tolist() == [want] * 6, op
            got = C.reduce_scatter(torch.full((6,), (1 << r) | 8, dtype=torch.int32), op=op, async_op=True).wait()
            assert got.tolist() == [want] * 2, op
        flags = torch.tensor([r == 0, True, False])
        assert C.all_reduce(flags, op="bor").tolist() == [True, True, False]
    finally:
        reduce_ops.backend_supports = real
        ops._all_reduce_ready.clear()


@distributed(world_size=2)
def test_reduce_op_values_and_names_are_the_same(env):
    import torch.distributed as dist

    for op in ["max", "MAX", dist.ReduceOp.MAX, dist.ReduceOp(dist.ReduceOp.MAX)]:
        assert C.all_reduce(torch.tensor([env.rank + 1.0]), op=op).item() == 2.0
