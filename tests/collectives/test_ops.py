"""Every collective x op x dtype x world size 1-4 on Gloo, against closed-form expectations.

Rank r contributes values built from r + 1, so every expected result is a formula in r and n
(sum n(n+1)/2, product n!, ...), never a second run of the code under test. Integer-valued
inputs keep every float sum exact in any order, so comparisons are torch.equal.

    pytest tests/collectives/test_ops.py -q
"""

import functools
import math

import pytest
import torch

import collectives as C
from collectives.errors import CollectiveError
from collectives.reduce_ops import OP_NAMES, check_op_dtype
from collectives.testing import distributed, run_on_ranks

WORLD_SIZES = [1, 2, 3, 4]
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64, torch.bool]
# Gloo fails on these with "Invalid scalar type" (complex: in gather only); the wrappers carry them
# as bytes or in a wider integer type (collectives/dtypes.py). float8 moves, and its reductions are refused.
GAP_DTYPES = [torch.int8, torch.uint8, torch.int16, torch.uint16, torch.uint32, torch.uint64, torch.complex64,
              torch.float8_e4m3fn]
REDUCTIONS = ["all_reduce", "reduce", "reduce_scatter"]
MOVES = ["broadcast", "all_gather", "gather", "scatter", "all_to_all"]


def valid_ops(dtype):
    ops = []
    for op in OP_NAMES:
        try:
            check_op_dtype(op, dtype, "test")
            ops.append(op)
        except CollectiveError:
            pass
    return ops


def contribution(rank: int, op: str, dtype: torch.dtype, rows: int) -> torch.Tensor:
    """Rank r's input, shape (rows, 3): bool r even; bit r+1 set for bitwise; else r + 1 (+ row % 3)."""
    if dtype == torch.bool:
        return torch.full((rows, 3), rank % 2 == 0)
    if op in ("band", "bor", "bxor"):
        return torch.full((rows, 3), (1 << rank) | 1, dtype=dtype)  # bit 0 everywhere, bit r only here
    base = torch.full((rows, 3), rank + 1.0)
    if op != "product":
        base += (torch.arange(rows) % 3).unsqueeze(1)  # catches rows landing in the wrong place
    return base.to(dtype)


def expected(op: str, dtype: torch.dtype, n: int, rows: int) -> torch.Tensor:
    """The closed form of op over ranks 0..n-1 of `contribution`."""
    offset = (torch.arange(rows) % 3).unsqueeze(1).expand(rows, 3).double()
    if dtype == torch.bool:
        evens = (n + 1) // 2
        value = {"band": evens == n, "min": evens == n, "bor": True, "max": True, "bxor": evens % 2 == 1}[op]
        return torch.full((rows, 3), value)
    if op in ("band", "bor", "bxor"):
        bits = [(1 << r) | 1 for r in range(n)]
        fn = {"band": lambda a, b: a & b, "bor": lambda a, b: a | b, "bxor": lambda a, b: a ^ b}[op]
        return torch.full((rows, 3), functools.reduce(fn, bits), dtype=dtype)
    closed = {
        "sum": n * (n + 1) / 2 + n * offset,
        "avg": (n + 1) / 2 + offset,
        "min": 1 + offset,
        "max": n + offset,
        "product": torch.full((rows, 3), float(math.factorial(n))),
    }[op]
    return closed.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES + GAP_DTYPES, ids=str)
@pytest.mark.parametrize("collective", REDUCTIONS + MOVES)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_collective(world_size, collective, dtype):
    body = _reductions_body if collective in REDUCTIONS else _movement_body
    run_on_ranks(body, world_size, args=(collective, dtype))


def _reductions_body(env, collective, dtype):
    n, r = env.world_size, env.rank
    rows = 2 * n  # divisible, for reduce_scatter
    for op in valid_ops(dtype):
        for async_op in (False, True):
            want = expected(op, dtype, n, rows)
            t = contribution(r, op, dtype, rows)
            tag = f"{collective} op={op} dtype={dtype} n={n} rank={r} async={async_op}"
            if collective == "all_reduce":
                out = C.all_reduce(t, op=op, async_op=async_op)
                got = out.wait() if async_op else out
                assert got is t, tag  # in place, and returns the tensor
                assert torch.equal(got, want), f"{tag}: {got} != {want}"
            elif collective == "reduce":
                dst = n - 1
                out = C.reduce(t, dst=dst, op=op, async_op=async_op)
                got = out.wait() if async_op else out
                if r == dst:
                    assert torch.equal(got, want), f"{tag}: {got} != {want}"
            else:
                out = C.reduce_scatter(t, op=op, async_op=async_op)
                got = out.wait() if async_op else out
                assert torch.equal(got, want[2 * r : 2 * r + 2]), f"{tag}: {got}"


def _movement_body(env, collective, dtype):
    n, r = env.world_size, env.rank

    def filled(value, rows):  # (rows, 2): row i holds value + i (bool: parity)
        t = (torch.arange(rows).unsqueeze(1) + value).expand(rows, 2).contiguous()
        return (t % 2 == 1) if dtype == torch.bool else t.to(dtype)

    for async_op in (False, True):
        tag = f"{collective} dtype={dtype} n={n} rank={r} async={async_op}"
        wait = (lambda x: x.wait()) if async_op else (lambda x: x)
        if collective == "broadcast":
            for src in sorted({0, n - 1}):
                t = filled(10 * r, 3)
                got = wait(C.broadcast(t, src=src, async_op=async_op))
                assert got is t and torch.equal(got, filled(10 * src, 3)), tag
        elif collective in ("all_gather", "gather"):
            t = filled(10 * r, r + 1)  # uneven: rank r sends r + 1 rows
            want = torch.cat([filled(10 * i, i + 1) for i in range(n)])
            if collective == "all_gather":
                assert torch.equal(wait(C.all_gather(t, async_op=async_op)), want), tag
            else:
                got = wait(C.gather(t, dst=n - 1, async_op=async_op))
                assert (got is None) if r != n - 1 else torch.equal(got, want), tag
        elif collective == "scatter":
            src = n - 1
            t = filled(0, 2 * n) if r == src else torch.zeros((2 * n, 2), dtype=dtype)
            got = wait(C.scatter(t, src=src, async_op=async_op))
            assert torch.equal(got, filled(0, 2 * n)[2 * r : 2 * r + 2]), tag
        elif collective == "all_to_all":
            # chunk j of rank r holds 10 r + j; after the exchange, chunk i holds 10 i + r
            if dtype == torch.bool:  # rank r's row j is j's parity, so every row it gets is r's parity
                t, want = filled(0, n), torch.full((n, 2), r % 2 == 1)
            else:
                t = torch.tensor([[10 * r + j] * 2 for j in range(n)]).to(dtype)
                want = torch.tensor([[10 * i + r] * 2 for i in range(n)]).to(dtype)
            assert torch.equal(wait(C.all_to_all(t, async_op=async_op)), want), tag


@distributed(world_size=3)
def test_barrier_waits_for_the_slowest_rank(env, tmp_path):
    import time

    marker = tmp_path / "rank0-was-here"
    if env.rank == 0:
        time.sleep(0.3)
        marker.write_text("x")
    C.barrier()
    assert marker.exists(), f"rank {env.rank} left the barrier before rank 0 reached it"
    C.barrier(async_op=True).wait()
