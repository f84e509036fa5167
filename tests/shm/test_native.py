"""The native path (C++) leaves the same bits as the Python path (python_path.py, the reference), for every
collective it takes and the calls it hands back to Python, and the two paths meet in one group.
collectives.shm.all_reduce (direct.py), which calls the engine without torch's dispatch, is one of
the collectives drawn.

A property test draws the collective, dtype, op, size (0 bytes to past a slot: slots are 4 KiB and
step 3's pieces 256 B here, so the small path, the pieces and the rounds all run), world size,
the round size and how many of a slot's regions the rounds use in turn (COLLECTIVES_SHM_ROUND_KB,
_REGIONS), root, a non-contiguous tensor (which the native path hands to Python) and whether the
call is queued for the worker thread or run in the caller. Each rank runs the same call with the
same inputs on three groups over the same ranks: every rank native, every rank Python, and even ranks
native with odd ranks Python; the outputs must be equal byte for byte.

    pytest tests/shm/test_native.py -q
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from hypothesis import example, given, settings
from hypothesis import strategies as st

import collectives.shm as shm
from collectives.errors import CollectiveError
from collectives.reduce_ops import TORCH_OPS, check_op_dtype
from collectives.shm import backend_of, new_group_with
from collectives.shm.native_setup import NATIVE_DTYPES
from collectives.shm.python_path import small_limit
from collectives.testing import kept_groups, run_on_ranks

SETTINGS = {"COLLECTIVES_SHM_SLOT_MB": str(4 / 1024), "COLLECTIVES_SHM_PIECE_KB": "0.25"}
SLOT_BYTES = 4096
# COLLECTIVES_SHM_ROUND_KB (half a slot here, or rounds of 1 KiB or 256 B), and after a slash
# COLLECTIVES_SHM_REGIONS (else 2, the default: the slot's two halves)
ROUNDS_KB = ("auto", "1", "0.25", "0.25/auto", "1/3")
# "direct all_reduce": collectives.shm.all_reduce, into the engine without torch's dispatch (direct.py);
# on the Python path's group it is dist.all_reduce, so the mixed group meets both in one call
COLLECTIVES = ("all_reduce", "direct all_reduce", "reduce", "broadcast", "all_gather_into_tensor",
               "reduce_scatter_tensor", "all_gather", "reduce_scatter",  # the last two: the list forms
               "gather", "scatter", "all_to_all_single", "uneven all_to_all_single", "all_to_all", "barrier")
MOVING = ("broadcast", "all_gather_into_tensor", "all_gather", "gather", "scatter", "all_to_all_single",
          "uneven all_to_all_single", "all_to_all")  # no op: every dtype
REDUCING = ("all_reduce", "direct all_reduce", "reduce", "reduce_scatter_tensor", "reduce_scatter")
ONE_TENSOR = ("all_reduce", "direct all_reduce", "reduce", "broadcast")
DTYPE_NAMES = [str(d).replace("torch.", "") for d in NATIVE_DTYPES]


def _made(rank: int, queued: bool, round_kb: str = "auto") -> dict:
    """The three groups (native, python, mixed) of this rank, made once per pool for this module:
    in the same order on every rank, each with its settings in the environment while it is made."""
    def make():
        made = {}
        for variant in ("native", "python", "mixed"):
            path = variant if variant != "mixed" else ("native" if rank % 2 == 0 else "python")
            round_size, _, regions = round_kb.partition("/")
            made[variant] = new_group_with({**SETTINGS, "COLLECTIVES_SHM_PATH": path,
                                            "COLLECTIVES_SHM_INLINE_BYTES": "0" if queued else "65536",
                                            "COLLECTIVES_SHM_ROUND_KB": round_size,
                                            "COLLECTIVES_SHM_REGIONS": regions or "2"})
            assert backend_of(made[variant]).path == path, (variant, backend_of(made[variant]).path)
        return made

    return kept_groups((queued, round_kb), make)


def _values(seed: int, rank: int, numel: int, dtype: torch.dtype, op: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 1009 + rank)
    if dtype == torch.bool:
        return torch.randint(0, 2, (numel,), generator=g).bool()
    if dtype.is_floating_point and dtype.itemsize > 1:
        scale = 1.5 if op == "product" else 100.0  # products of 4 ranks stay finite in float16
        return (torch.randn(numel, generator=g, dtype=torch.float64) * scale).to(dtype)
    if dtype.is_complex:
        return torch.randn(numel, generator=g, dtype=dtype)
    if dtype.is_floating_point:  # float8: moved, never reduced
        return torch.randn(numel, generator=g).to(dtype)
    info = torch.iinfo(dtype)
    low, high = max(info.min, -1000), min(info.max, 1000)
    return torch.randint(low, high, (numel,), generator=g, dtype=torch.int64).to(dtype)


def _call(group, collective: str, x: torch.Tensor, op: str, root: int, noncontiguous: bool, queued: bool):
    """Run one call on `group`; the tensor it wrote, as bytes. Queued: issued with async_op=True and
    then waited for (the native path runs a call its caller waits for at once in the caller)."""
    size = dist.get_world_size(group)
    root = dist.get_global_rank(group, root)
    rop = TORCH_OPS[op] if op else None
    if collective == "barrier":
        work, out = dist.barrier(group=group, async_op=queued), None
    elif collective in ONE_TENSOR:
        t = x.clone()
        if noncontiguous:  # every other element of a buffer twice as long: the Python path takes it
            buf = torch.zeros(2 * t.numel(), dtype=t.dtype)
            buf[::2] = t
            t = buf[::2]
        if collective == "all_reduce":
            work = dist.all_reduce(t, op=rop, group=group, async_op=queued)
        elif collective == "direct all_reduce":  # waited for at once: never queued behind nothing
            work = shm.all_reduce(t, rop, group)
        elif collective == "reduce":
            work = dist.reduce(t, dst=root, op=rop, group=group, async_op=queued)
        else:
            work = dist.broadcast(t, src=root, group=group, async_op=queued)
        out = t
    elif collective == "all_gather_into_tensor":
        out = torch.empty(size * x.numel(), dtype=x.dtype)
        work = dist.all_gather_into_tensor(out, x, group=group, async_op=queued)
    elif collective == "all_gather":  # one output per rank, shaped unlike the input: only the numel must match
        outs = [torch.empty(x.numel(), 1, dtype=x.dtype) for _ in range(size)]
        work = dist.all_gather(outs, x, group=group, async_op=queued)
        if work is not None:
            work.wait()
        work, out = None, torch.cat([o.view(-1) for o in outs])
    elif collective == "reduce_scatter":  # one input per rank, each its own tensor
        out = torch.empty(x.numel() // size, dtype=x.dtype)
        work = dist.reduce_scatter(out, [c.clone() for c in x.chunk(size)], op=rop, group=group, async_op=queued)
    elif collective == "gather":  # rank q's x on the root, one tensor per rank; nothing elsewhere
        me = dist.get_rank()
        outs = [torch.empty_like(x) for _ in range(size)] if me == root else None
        work = dist.gather(x, outs, dst=root, group=group, async_op=queued)
        if work is not None:
            work.wait()
        work, out = None, torch.cat(outs) if outs is not None else None
    elif collective == "scatter":  # the root's x, cut in one chunk per rank (even, or the last shorter)
        me, k = dist.get_rank(), x.numel() // size
        out = torch.empty(k, dtype=x.dtype)
        chunks = [x[q * k:(q + 1) * k].clone() for q in range(size)] if me == root else None
        work = dist.scatter(out, chunks, src=root, group=group, async_op=queued)
    elif collective in ("all_to_all_single", "uneven all_to_all_single"):
        per_rank = x.numel() // size if collective == "all_to_all_single" else x.numel()
        rows = x.view(-1, 2) if per_rank % 2 == 0 else x.view(-1, 1)  # rows of 2 elements where they fit
        if collective == "all_to_all_single":  # evenly: x is drawn as size x numel elements
            out, sends, expects = torch.empty_like(rows), None, None
        else:  # rank q sends table[q][d] rows to rank d; every rank computes the same table
            n_rows, me = rows.shape[0], dist.get_group_rank(group, dist.get_rank())
            table = [[(n_rows + 3 * q + 5 * d) % (n_rows // size + 1) for d in range(size - 1)] for q in range(size)]
            table = [row + [n_rows - sum(row)] for row in table]  # the rest to the last rank: never negative
            sends, expects = table[me], [table[q][me] for q in range(size)]
            out = rows.new_empty((sum(expects),) + tuple(rows.shape[1:]))
        work = dist.all_to_all_single(out, rows, expects, sends, group=group, async_op=queued)
    elif collective == "all_to_all":  # the list form: rank r sends its chunk q (of uneven lengths) to rank q
        lengths = [(x.numel() + q) // size for q in range(size)]  # every rank the same list
        ins = list(x[:sum(lengths)].split(lengths))
        outs = [torch.empty(lengths[dist.get_group_rank(group, dist.get_rank())], dtype=x.dtype) for _ in range(size)]
        work = dist.all_to_all(outs, [t.clone() for t in ins], group=group, async_op=queued)
        if work is not None:
            work.wait()
        work, out = None, torch.cat(outs)
    else:
        out = torch.empty(x.numel() // size, dtype=x.dtype)
        work = dist.reduce_scatter_tensor(out, x, op=rop, group=group, async_op=queued)
    if work is not None:
        work.wait()
    if out is None:
        return torch.empty(0, dtype=torch.uint8)
    out = out.clone(memory_format=torch.contiguous_format)  # a 1-element view of stride 2 is "contiguous" too
    return out.view(torch.uint8) if out.numel() else torch.empty(0, dtype=torch.uint8)


def _same_on_every_variant(env, case):
    collective, dtype_name, op, numel, root, seed, noncontiguous, queued, round_kb = case
    dtype = getattr(torch, dtype_name)
    groups = _made(env.rank, queued, round_kb)
    n = numel * env.world_size if collective in ("reduce_scatter_tensor", "reduce_scatter", "scatter",
                                                 "all_to_all_single") else numel
    x = _values(seed, env.rank, n, dtype, op)
    got = {variant: _call(g, collective, x, op, root % env.world_size, noncontiguous, queued)
           for variant, g in groups.items()}
    return {variant: bool(torch.equal(got["python"], out)) for variant, out in got.items()}


@st.composite
def cases(draw):
    collective = draw(st.sampled_from(COLLECTIVES))
    dtype = draw(st.sampled_from(DTYPE_NAMES))
    op = ""
    if collective in REDUCING:
        ops = [o for o in TORCH_OPS if _allowed(o, getattr(torch, dtype))]
        if not ops:  # float8: moved, never reduced
            collective = draw(st.sampled_from(MOVING))
        else:
            op = draw(st.sampled_from(ops))
    itemsize = getattr(torch, dtype).itemsize
    numel = draw(st.integers(0, 3 * SLOT_BYTES // itemsize))  # 0 bytes to 3 slots
    return (collective, dtype, op, numel, draw(st.integers(0, 3)), draw(st.integers(0, 2 ** 16)),
            draw(st.booleans()) and collective in ONE_TENSOR, draw(st.booleans()),
            draw(st.sampled_from(ROUNDS_KB)))


def _allowed(op: str, dtype: torch.dtype) -> bool:
    try:
        check_op_dtype(op, dtype, "all_reduce")
    except CollectiveError:
        return False
    return True


@pytest.mark.parametrize("world_size", [2, 3, 4])
@settings(max_examples=25, deadline=None)
@given(case=cases())
@example(case=("all_reduce", "float32", "sum", 2, 0, 1, False, False, "auto"))          # 8 bytes, the small path
@example(case=("all_reduce", "float32", "sum", 2000, 0, 1, False, True, "auto"))       # the pieces and two rounds, queued
@example(case=("reduce", "bfloat16", "avg", 3000, 1, 2, False, False, "1"))          # ATen's kernel, root 1's division
@example(case=("reduce_scatter_tensor", "int64", "product", 700, 0, 3, False, False, "0.25"))
@example(case=("all_reduce", "uint32", "sum", 100, 0, 4, False, False, "auto"))         # widened: Python on both
@example(case=("broadcast", "float8_e4m3fn", "", 5000, 2, 5, True, True, "1"))      # rounds, non-contiguous
@example(case=("all_gather_into_tensor", "bool", "", 0, 0, 6, False, False, "auto"))    # 0 bytes
@example(case=("all_reduce", "float32", "sum", 3000, 0, 7, False, True, "0.25"))   # 256 B rounds, queued
@example(case=("all_gather_into_tensor", "int32", "", 900, 0, 8, False, False, "1/3"))  # 3 regions in turn
@example(case=("direct all_reduce", "float32", "sum", 2, 0, 9, False, False, "auto"))   # without torch's dispatch
@example(case=("direct all_reduce", "bfloat16", "avg", 3000, 0, 10, False, True, "0.25"))  # queued, in rounds
@example(case=("all_gather", "float16", "", 1500, 0, 11, False, True, "0.25"))         # the list form, in rounds
@example(case=("reduce_scatter", "float32", "avg", 700, 0, 12, False, False, "auto"))  # the list form's division
@example(case=("gather", "int16", "", 1100, 1, 13, False, True, "0.25"))               # rounds to root 1
@example(case=("scatter", "float64", "", 300, 2, 14, False, False, "1/3"))             # from root 2, regions in turn
@example(case=("uneven all_to_all_single", "float32", "", 900, 0, 15, False, True, "0.25"))
@example(case=("all_to_all", "bool", "", 37, 0, 16, False, False, "auto"))
def test_the_native_path_leaves_the_python_paths_bits(world_size, case):
    for rank, same in enumerate(run_on_ranks(_same_on_every_variant, world_size, args=(case,), backend="gloo")):
        assert all(same.values()), f"rank {rank} of {world_size}, {case}: equal to the Python path's bytes: {same}"


def _coalesced_on_every_variant(env, case):
    """Several all_reduces, all_gathers or reduce_scatters in torch's coalescing manager (one
    allreduce_coalesced, allgather_into_tensor_coalesced or reduce_scatter_tensor_coalesced call
    to the backend), or one dist.all_gather_coalesced, on the native, Python and mixed groups:
    whether each left the Python path's bytes. A pair with a non-contiguous output sends the whole
    call to the Python path on a native rank. Queued: the groups run every call on their worker
    thread, none in the caller."""
    from collectives.compat import all_gather_single, reduce_scatter_single

    kind, op, pairs, noncontiguous_at, round_kb, seed, queued = case
    p = env.world_size
    got = {}
    for variant, group in _made(env.rank, queued, round_kb).items():
        outs = []
        if kind == "all_gather_coalesced":  # the list form: rank q's input i lands in lists[q][i]
            ins = [_values(seed + i, env.rank, numel, getattr(torch, d), op) for i, (d, numel) in enumerate(pairs)]
            lists = [[torch.zeros(2 * numel, dtype=x.dtype)[::2] if (i, q) == (noncontiguous_at, 0) else torch.empty_like(x)
                      for i, (x, (_, numel)) in enumerate(zip(ins, pairs))] for q in range(p)]
            work = dist.all_gather_coalesced(lists, ins, group=group, async_op=queued)
            if queued:
                work.wait()
            got[variant] = [o.clone(memory_format=torch.contiguous_format).view(torch.uint8) for outs in lists for o in outs]
            continue
        with dist._coalescing_manager(group, async_ops=True) as cm:
            for i, (dtype_name, numel) in enumerate(pairs):
                dtype = getattr(torch, dtype_name)
                x = _values(seed + i, env.rank, numel * (p if kind == "reduce_scatter" else 1), dtype, op)
                n = numel * (p if kind == "all_gather" else 1)
                out = torch.zeros(2 * n, dtype=dtype)[::2] if i == noncontiguous_at else torch.empty(n, dtype=dtype)
                if kind == "all_reduce":  # in place, one dtype for every pair (as Gloo's allreduce_coalesced)
                    out.copy_(x)
                    dist.all_reduce(out, op=TORCH_OPS[op], group=group)
                elif kind == "all_gather":
                    all_gather_single(out, x, group=group)
                else:
                    reduce_scatter_single(out, x, op=TORCH_OPS[op], group=group)
                outs.append(out)
        cm.wait()
        # a 1-element view of stride 2 counts as contiguous: clone it into a fresh buffer first
        got[variant] = [o.clone(memory_format=torch.contiguous_format).view(torch.uint8) for o in outs]
    return {variant: all(torch.equal(a, b) for a, b in zip(got["python"], outs)) for variant, outs in got.items()}


@st.composite
def coalesced_cases(draw):
    kind = draw(st.sampled_from(["all_gather", "reduce_scatter", "all_reduce", "all_gather_coalesced"]))
    op = draw(st.sampled_from(["sum", "avg", "max"])) if not kind.startswith("all_gather") else ""
    dtypes = ["float32", "float64", "bfloat16"] + (["int32", "bool"] if op != "avg" and kind.startswith("all_gather") else
                                                   ["int32"] if op != "avg" and kind == "all_reduce" else [])
    if kind in ("all_reduce", "all_gather_coalesced"):  # one dtype for every pair (torch refuses more)
        dtypes = [draw(st.sampled_from(dtypes))]
    pairs = draw(st.lists(st.tuples(st.sampled_from(dtypes), st.integers(0, 1500)), min_size=1, max_size=4))
    noncontiguous_at = draw(st.one_of(st.none(), st.integers(0, len(pairs) - 1)))
    return (kind, op, pairs, noncontiguous_at, draw(st.sampled_from(ROUNDS_KB)), draw(st.integers(0, 2 ** 16)),
            draw(st.booleans()))


@pytest.mark.parametrize("world_size", [2, 3])
@settings(max_examples=10, deadline=None)
@given(case=coalesced_cases())
@example(case=("all_gather", "", [("float32", 1000), ("bfloat16", 3), ("float64", 0)], None, "0.25", 1, False))
@example(case=("reduce_scatter", "avg", [("float32", 700), ("float64", 5)], 1, "auto", 2, False))  # the Python path for all
@example(case=("all_reduce", "avg", [("bfloat16", 900), ("bfloat16", 1), ("bfloat16", 0)], None, "0.25", 3, True))  # rounds
@example(case=("all_reduce", "sum", [("float32", 2), ("float32", 3)], 0, "auto", 4, False))  # non-contiguous: Python
@example(case=("all_gather_coalesced", "", [("bfloat16", 1000), ("bfloat16", 3), ("bfloat16", 0)], None, "0.25", 5, True))
@example(case=("all_gather_coalesced", "", [("bool", 2), ("bool", 3)], 1, "auto", 6, False))  # non-contiguous: Python
def test_coalesced_calls_leave_the_python_paths_bits(world_size, case):
    """The coalesced forms (DTensor's redistributions and the functional collectives use them):
    several pairs of mixed dtypes and sizes, one call a pair in order on either path; and
    dist.all_gather_coalesced, the list form, one call for all its inputs."""
    for rank, same in enumerate(run_on_ranks(_coalesced_on_every_variant, world_size, args=(case,), backend="gloo")):
        assert all(same.values()), f"rank {rank} of {world_size}, {case}: equal to the Python path's bytes: {same}"


def _monitored_barrier_on_every_variant(env):
    """The group's monitored_barrier that every rank reaches, then an all_reduce, on the native,
    Python and mixed groups: the two paths' call words for it must agree rank by rank."""
    from datetime import timedelta

    said = {}
    for variant, group in _made(env.rank, False).items():
        group.monitored_barrier(timedelta(seconds=30), True)
        t = torch.ones(1)
        dist.all_reduce(t, group=group)
        said[variant] = t.item()
    return said


@pytest.mark.parametrize("world_size", [2, 3])
def test_monitored_barrier_meets_on_either_path_and_in_a_mixed_group(world_size):
    for said in run_on_ranks(_monitored_barrier_on_every_variant, world_size, backend="gloo"):
        assert said == {"native": world_size, "python": world_size, "mixed": world_size}, said


def _coalesced_disagreeing(env):
    """Three coalesced all_gathers, the second one element longer on rank 1, on each variant:
    what each rank raised (type and text), and an all_reduce after."""
    from collectives.compat import all_gather_single

    said = {}
    for variant, group in _made(env.rank, False).items():
        try:
            with dist._coalescing_manager(group, async_ops=True) as cm:
                for i, n in enumerate((4, 3 + (env.rank == 1), 2)):
                    all_gather_single(torch.empty(env.world_size * n), torch.ones(n), group=group)
            cm.wait()
            said[variant] = ("no error", "")
        except Exception as exc:  # noqa: BLE001
            said[variant] = (type(exc).__name__, str(exc))
        t = torch.ones(1)
        dist.all_reduce(t, group=group)
        said[variant + " after"] = t.item()
    return said


def test_a_coalesced_call_that_disagrees_raises_the_mismatch_on_every_rank():
    """The pair the ranks disagree on raises CollectiveMismatchError naming both calls, on every
    rank and either path (a callback's error would reach the caller as a RuntimeError), and the
    group still works."""
    for rank, said in enumerate(run_on_ranks(_coalesced_disagreeing, 3, backend="gloo")):
        for variant in ("native", "python", "mixed"):
            kind, text = said[variant]
            assert kind == "CollectiveMismatchError", (rank, variant, kind, text)
            assert "rank 1: all_gather of 4 float32" in text and "all_gather of 3 float32" in text, (rank, variant, text)
            assert said[variant + " after"] == 3.0, (rank, variant)


# -- queued calls waited in any order -------------------------------------------------------------
def _queued_group(path: str):
    # every call queued for the worker thread (or run by its waiter)
    return kept_groups(("queued-only", path), lambda: new_group_with({**SETTINGS, "COLLECTIVES_SHM_INLINE_BYTES": "0",
                                                                     "COLLECTIVES_SHM_PATH": path}))


def _waited_in_any_order(env, path, calls, orders, callback_at):
    """Issue `calls` with async_op=True, attach a callback that all-reduces again to call
    `callback_at` (as torch's PowerSGD hook does), then wait for them in this rank's order: a wait
    runs the calls queued up to its own in the waiting thread, and the callback's collective at
    once, so every rank runs them in the order they were issued. True where the closed form holds."""
    group, p, r = _queued_group(path), env.world_size, env.rank
    works, checks = [], []
    for i, (kind, numel) in enumerate(calls):
        if kind == "all_reduce":  # the native path
            t = torch.full((numel,), float(r + 1 + i))
            works.append(dist.all_reduce(t, group=group, async_op=True))
            checks.append(lambda t=t, i=i: bool((t == p * (p + 1) / 2 + p * i).all()))
        else:  # the list form: a Python job in the same queue
            outs = [torch.empty(numel) for _ in range(p)]
            works.append(dist.all_gather(outs, torch.full((numel,), float(10 * r + i)), group=group, async_op=True))
            checks.append(lambda outs=outs, i=i: all(bool((o == 10 * q + i).all()) for q, o in enumerate(outs)))
        if i == callback_at:
            def again(fut, i=i):
                t = torch.full((3,), float(r + i))
                dist.all_reduce(t, group=group)  # issued by the thread that completes call i
                return t
            chained = works[-1].get_future().then(again)
    for i in orders[r % len(orders)]:
        works[i].wait()
    again_ok = bool((chained.wait() == p * (p - 1) / 2 + p * callback_at).all())
    return [check() for check in checks] + [again_ok]


@st.composite
def queued_cases(draw):
    n = draw(st.integers(1, 6))
    calls = draw(st.lists(st.tuples(st.sampled_from(["all_reduce", "all_gather"]), st.integers(0, 3000)),
                          min_size=n, max_size=n))
    orders = draw(st.lists(st.permutations(range(n)), min_size=1, max_size=3))
    return calls, orders, draw(st.integers(0, n - 1))


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("path", ["native", "python"])
@settings(max_examples=15, deadline=None)
@given(case=queued_cases())
@example(case=([("all_reduce", 2000)] * 4, [[3, 2, 1, 0], [0, 1, 2, 3]], 1))  # the last one first on rank 0
# a Python job's callback (the list form's), issuing a native call: it must see the counters the job left
@example(case=([("all_reduce", 100), ("all_gather", 5)], [[1, 0]], 1))
def test_queued_calls_waited_in_any_order_run_in_the_order_issued(path, world_size, case):
    calls, orders, callback_at = case
    for rank, ok in enumerate(run_on_ranks(_waited_in_any_order, world_size, args=(path, calls, orders, callback_at),
                                           backend="gloo", timeout=60)):
        assert all(ok), f"rank {rank} of {world_size}, {case}: the closed form held for {ok}"


def _left_queued_after_a_wait(env, path):
    """Up to 200 times: three queued all_reduces; this rank waits for the second (on the native
    path the waiting thread runs the calls up to it itself, when the worker thread has not taken
    them first: a race, so many times), then only watches the third. Nobody waits on that one,
    so the worker thread must run it. The first time the third was not done 5 s after the second
    (None: never; then it is waited for, so the group is left clean), and whether every sum was
    right."""
    group, p, r = _queued_group(path), env.world_size, env.rank
    right = True
    for attempt in range(200):
        tensors = [torch.full((100,), float(r + 1 + i)) for i in range(3)]
        works = [dist.all_reduce(t, group=group, async_op=True) for t in tensors]
        works[1].wait()
        start = time.perf_counter()
        while not works[2].is_completed() and time.perf_counter() - start < 5:
            time.sleep(0.0002)
        stuck = not works[2].is_completed()
        works[2].wait()
        right = right and all(bool((t == p * (p + 1) / 2 + p * i).all()) for i, t in enumerate(tensors))
        if stuck:
            return attempt, right
    return None, right


@pytest.mark.parametrize("path", ["native", "python"])
def test_a_queued_call_nobody_waits_for_still_runs(path):
    """A Work that is polled, or whose Future only has callbacks (a comm hook's `then`), is never
    waited on: its call runs only if the worker thread is woken for it, also after a waiting
    caller ran the calls before it and left it queued. Without that wake it waits forever (the
    property test above catches it only at its timeout, then again for each shrink)."""
    for rank, (stuck_at, right) in enumerate(run_on_ranks(_left_queued_after_a_wait, 2, args=(path,),
                                                          backend="gloo", timeout=60)):
        assert stuck_at is None, f"rank {rank}, attempt {stuck_at}: the third all_reduce was not done 5 s after the second"
        assert right, rank


def _worker_nice_values(env):
    """The nice value of each of this process's threads, after a group with COLLECTIVES_SHM_WORKER_NICE=7 is made."""
    import os

    def nices():
        found = []
        for tid in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{tid}/stat") as f:
                    found.append(int(f.read().rsplit(")", 1)[1].split()[16]))  # field 19, nice
            except FileNotFoundError:  # a thread that ended after the listing
                continue
        return found

    before = nices()
    group = new_group_with({"COLLECTIVES_SHM_WORKER_NICE": "7"})
    t = torch.ones(1 << 16)  # 256 KiB: queued for the worker thread
    dist.all_reduce(t, group=group, async_op=True).wait()
    return before, nices(), bool((t == env.world_size).all())


def test_the_engines_worker_thread_takes_the_worker_nice_setting():
    """A queued call yields to computing threads: the engine's worker runs at the nice value the
    setting gives (19 by default), the rank's own threads stay at 0."""
    for rank, (before, after, right) in enumerate(run_on_ranks(_worker_nice_values, 2, backend="gloo")):
        assert right, rank
        assert 7 not in before and after.count(7) == 1, (rank, before, after)
        assert 0 in after, (rank, after)  # the main thread is left as it was


# -- the small path's limit grows as the ranks get fewer (ops.small_limit) ------------------------
def _around_the_small_limit(env):
    """float32 all_reduces just under and just over small_limit on a native, a Python and a mixed
    group with a slot large enough for it, and the direct call on the native one; the bytes each
    leaves, and the path each side chose."""
    key = ("small limit", env.world_size)
    groups = kept_groups(key, lambda: {
        variant: new_group_with({"COLLECTIVES_SHM_SLOT_MB": "0.5", "COLLECTIVES_SHM_PATH": path})
        for variant, path in (("native", "native"), ("python", "python"), ("mixed", "native" if env.rank % 2 == 0 else "python"))})
    limit = small_limit(env.world_size)
    found = {}
    for numel in (limit // 4, limit // 4 + 1):
        x = _values(numel, env.rank, numel, torch.float32, "sum")
        outs = {}
        for variant, g in groups.items():
            t = x.clone()
            dist.all_reduce(t, group=g)
            outs[variant] = t
        outs["direct"] = x.clone()  # collectives.shm.all_reduce on the native group: the same path
        shm.all_reduce(outs["direct"], group=groups["native"])
        found[numel] = ({v: bool(torch.equal(outs["python"], t)) for v, t in outs.items()},
                        backend_of(groups["native"]).state.collectives.all_reduce_path(4 * numel))
    return limit, found


@pytest.mark.parametrize("world_size", [2, 3])
def test_both_paths_take_the_small_path_up_to_the_same_world_size_dependent_limit(world_size):
    """On 3 ranks the small path adds every slot in rank order and the other path adds a slice's
    owner first, so a native engine given another limit than the Python path leaves other bits."""
    for rank, (limit, found) in enumerate(run_on_ranks(_around_the_small_limit, world_size, backend="gloo")):
        assert limit == {2: 64 << 10, 3: (128 << 10) // 3}[world_size]
        (under, (same_under, path_under)), (over, (same_over, path_over)) = sorted(found.items())
        assert (path_under, path_over) == ("small", "whole"), (rank, found)
        assert all(same_under.values()) and all(same_over.values()), (rank, found)
