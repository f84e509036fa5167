"""Which calls leave the native path: every collective in its out-of-place and in-place forms, with
every dtype and op the native path claims to reduce (native_setup.reducible), run on a native
group whose fallbacks() count the calls its engine handed to the Python path. Each must count
none, and leave the closed-form result. The forms docs/shm.md lists as refused must count one each,
and the flight record must name the path each call ran on.

    pytest tests/shm/test_fallbacks.py -q

An in-place reduce_scatter (the output this rank's own chunk of the input: nccl-tests' in-place
column, Megatron's distributed optimizer) once ran in Python at 2.4x to 7x the out-of-place time,
with no word; so did anything else that leaves the native path.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from collectives.shm import backend_of, new_group_with
from collectives.shm.native_setup import _REDUCED, reducible
from collectives.shm.protocol import OPS
from collectives.testing import run_on_ranks

TORCH_OPS = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG, "product": dist.ReduceOp.PRODUCT,
             "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX, "band": dist.ReduceOp.BAND,
             "bor": dist.ReduceOp.BOR, "bxor": dist.ReduceOp.BXOR}
N = 3  # elements per rank's chunk


def _claimed():
    """(op name, dtype) pairs the native path reduces itself, avg on floating and complex dtypes."""
    pairs = [(OPS[i], d) for i, d in reducible()]
    pairs += [("avg", d) for d in _REDUCED if d.is_floating_point or d.is_complex]
    return pairs


def _values(rank: int, numel: int, dtype, op: str) -> torch.Tensor:
    """Rank r's input: small values that no op overflows or rounds (bool: alternating)."""
    base = torch.arange(numel) + rank + 1
    if dtype == torch.bool:
        return (base % 2).bool()
    if op == "product":
        base = base % 2 + 1  # 1s and 2s: products of a few ranks stay exact
    return base.to(dtype)


def _reduced(op: str, tensors):
    stacked = torch.stack(tensors)
    if stacked.dtype == torch.bool:
        kind = {"sum": "max", "max": "max", "bor": "max", "min": "min", "product": "min", "band": "min"}.get(op, op)
        if kind == "bxor":
            return stacked.to(torch.int64).sum(0).remainder(2).bool()
        return stacked.amax(0) if kind == "max" else stacked.amin(0)
    if op in ("sum", "avg"):
        total = stacked.sum(0, dtype=stacked.dtype) if not stacked.dtype.is_floating_point else stacked.double().sum(0)
        return (total / len(tensors)).to(stacked.dtype) if op == "avg" else total.to(stacked.dtype)
    if op == "product":
        return stacked.prod(0).to(stacked.dtype)
    if op == "min":
        return stacked.amin(0)
    if op == "max":
        return stacked.amax(0)
    fold = {"band": torch.bitwise_and, "bor": torch.bitwise_or, "bxor": torch.bitwise_xor}[op]
    out = stacked[0]
    for t in stacked[1:]:
        out = fold(out, t)
    return out


def _every_form(env):
    """Each collective and form, on a fresh native group: (name, the result, the closed form)
    and the group's fallbacks after all of them."""
    group = new_group_with({"COLLECTIVES_SHM_PATH": "native"})
    impl = backend_of(group)
    assert impl.path == "native"
    p, r = env.world_size, env.rank
    got = []

    def check(name, out, want):
        got.append((name, out.clone(), want.clone()))

    for op, dtype in _claimed():
        rop = TORCH_OPS[op]
        everyone = [_values(q, p * N, dtype, op) for q in range(p)]  # every rank's whole input
        whole = _reduced(op, everyone)
        t = everyone[r].clone()
        dist.all_reduce(t, op=rop, group=group)
        check(f"all_reduce {op} {dtype}", t, whole)
        t = everyone[r].clone()
        dist.reduce(t, dst=1, op=rop, group=group)
        check(f"reduce {op} {dtype}", t, whole if r == 1 else everyone[r])
        mine = whole[r * N:(r + 1) * N]
        out = torch.empty(N, dtype=dtype)
        dist.reduce_scatter_tensor(out, everyone[r].clone(), op=rop, group=group)
        check(f"reduce_scatter {op} {dtype} out of place", out, mine)
        inp = everyone[r].clone()
        dist.reduce_scatter_tensor(inp[r * N:(r + 1) * N], inp, op=rop, group=group)  # in place
        check(f"reduce_scatter {op} {dtype} in place", inp[r * N:(r + 1) * N], mine)
        ins = [everyone[r][q * N:(q + 1) * N].clone() for q in range(p)]
        out = torch.empty(N, dtype=dtype)
        dist.reduce_scatter(out, ins, op=rop, group=group)
        check(f"reduce_scatter list {op} {dtype} out of place", out, mine)
        dist.reduce_scatter(ins[r], ins, op=rop, group=group)  # in place: the output is this rank's input
        check(f"reduce_scatter list {op} {dtype} in place", ins[r], mine)
    for dtype in _REDUCED:
        chunks = [_values(q, N, dtype, "sum") for q in range(p)]
        joined = torch.cat(chunks)
        out = torch.empty(p * N, dtype=dtype)
        dist.all_gather_into_tensor(out, chunks[r].clone(), group=group)
        check(f"all_gather {dtype} out of place", out, joined)
        out = torch.zeros(p * N, dtype=dtype)
        out[r * N:(r + 1) * N] = chunks[r]
        dist.all_gather_into_tensor(out, out[r * N:(r + 1) * N], group=group)  # in place
        check(f"all_gather {dtype} in place", out, joined)
        outs = [torch.empty(N, dtype=dtype) for _ in range(p)]
        dist.all_gather(outs, chunks[r].clone(), group=group)
        check(f"all_gather list {dtype} out of place", torch.cat(outs), joined)
        outs[r] = chunks[r].clone()
        dist.all_gather(outs, outs[r], group=group)  # in place: the input is this rank's output
        check(f"all_gather list {dtype} in place", torch.cat(outs), joined)
        t = chunks[r].clone()
        dist.broadcast(t, src=p - 1, group=group)
        check(f"broadcast {dtype}", t, chunks[p - 1])
        sends = torch.cat([_values(r * p + q, N, dtype, "sum") for q in range(p)])  # rank r's piece for rank q
        want = torch.cat([_values(q * p + r, N, dtype, "sum") for q in range(p)])
        out = torch.empty(p * N, dtype=dtype)
        dist.all_to_all_single(out, sends.clone(), group=group)
        check(f"all_to_all {dtype} out of place", out, want)
        pieces = [torch.empty(N, dtype=dtype) for _ in range(p)]
        dist.all_to_all(pieces, list(sends.clone().split(N)), group=group)
        check(f"all_to_all list {dtype} out of place", torch.cat(pieces), want)
        gathered = [torch.empty(N, dtype=dtype) for _ in range(p)] if r == 0 else None
        if r == 0:
            gathered[0] = chunks[0].clone()
        dist.gather(gathered[0] if r == 0 else chunks[r].clone(), gathered, dst=0, group=group)  # in place at dst
        if r == 0:
            check(f"gather {dtype} in place", torch.cat(gathered), joined)
        scattered = list(joined.clone().split(N)) if r == 0 else None
        out = scattered[0] if r == 0 else torch.empty(N, dtype=dtype)
        dist.scatter(out, scattered, src=0, group=group)  # in place at src
        check(f"scatter {dtype} in place", out, chunks[r])
    dist.barrier(group=group)
    return got, impl.fallbacks()


@pytest.mark.parametrize("world_size", [2, 3])
def test_every_collective_in_both_forms_runs_natively_and_right(world_size):
    for rank, (got, fallbacks) in enumerate(run_on_ranks(_every_form, world_size, timeout=300)):
        for name, out, want in got:
            assert torch.equal(out, want), f"rank {rank} of {world_size}, {name}: {out} != {want}"
        assert fallbacks == {}, f"rank {rank} of {world_size}: calls that left the native path: {fallbacks}"
        assert len(got) > 300


def _refused_forms(env):
    """What docs/shm.md lists as refused, one call each, and the flight record's path words."""
    from collectives.flight_recorder import dump

    group = new_group_with({"COLLECTIVES_SHM_PATH": "native"})
    impl = backend_of(group)
    counts = {}
    dist.all_reduce(torch.ones(4, 2)[:, 0], group=group)  # not contiguous
    counts["non-contiguous"] = impl.fallbacks()
    dist.all_reduce(torch.ones(4, dtype=torch.uint32), group=group)  # a dtype the engine does not reduce
    counts["uint32 sum"] = impl.fallbacks()
    whole = torch.arange(2.0 * env.world_size + 1)
    dist.reduce_scatter_tensor(whole[1:3], whole[:2 * env.world_size], group=group)  # overlaps, not its own chunk
    counts["overlapping reduce_scatter"] = impl.fallbacks()
    dist.reduce_scatter_tensor(torch.empty(2), torch.ones(2 * env.world_size), group=group)  # native again
    counts["after"] = impl.fallbacks()
    return counts, [(e["profiling_name"], e.get("collectives_path")) for e in dump()["entries"]]


def test_calls_that_leave_the_native_path_are_counted_and_named_in_the_record():
    for rank, (counts, entries) in enumerate(run_on_ranks(_refused_forms, 2, timeout=120)):
        assert counts["non-contiguous"] == {"all_reduce": 1}, (rank, counts)
        assert counts["uint32 sum"] == {"all_reduce": 2}, (rank, counts)
        assert counts["overlapping reduce_scatter"] == {"all_reduce": 2, "reduce_scatter": 1}, (rank, counts)
        assert counts["after"] == counts["overlapping reduce_scatter"], (rank, counts)
        shm_entries = [(name, path) for name, path in entries if name.startswith("shm:")]
        assert shm_entries[-4:] == [("shm:all_reduce", "python"), ("shm:all_reduce", "python"),
                                    ("shm:reduce_scatter", "python"), ("shm:reduce_scatter", "native")], \
            (rank, shm_entries)


def _predicate_against_the_engine(env):
    """For tensors of every dtype the engine knows, each op, contiguous or not, small or past the
    cross-memory-attach size: what takes_all_reduce says, and whether a dist.all_reduce of the
    same tensor then left the native path."""
    from collectives.shm import takes_all_reduce

    group = new_group_with({"COLLECTIVES_SHM_PATH": "native", "COLLECTIVES_SHM_CMA": "1",
                            "COLLECTIVES_SHM_CMA_MIN_KB": "4"})
    impl = backend_of(group)
    rows = []
    dtypes = sorted({d for _, d in _claimed()} | {torch.uint32, torch.complex64}, key=str)
    for dtype in dtypes:
        for name, op in TORCH_OPS.items():
            for contiguous in (True, False):
                for numel in (8, 2048):  # 2048 elements of 4 bytes or more: past the 4 KiB cma size
                    whole = _values(env.rank, 2 * numel, dtype, name).view(numel, 2)
                    t = whole[:, 0].contiguous() if contiguous else whole[:, 0]
                    says = takes_all_reduce(t, op, group)
                    before = sum(impl.fallbacks().values())
                    try:
                        dist.all_reduce(t, op=op, group=group)
                    except (RuntimeError, ValueError, TypeError):
                        continue  # an op torch itself refuses for the dtype: no native call to compare
                    left = sum(impl.fallbacks().values()) - before
                    rows.append((str(dtype), name, contiguous, numel, says, left))
    return rows


def test_the_engines_predicate_is_what_the_engine_does():
    """One answer to "does the native path take this call?": takes_all_reduce (the engine's own
    predicate, asked from Python) is True exactly where a dist.all_reduce of the same tensor stays
    on the native path, over dtypes, ops, contiguity and size. A complex tensor is the exception
    by design: dist.all_reduce hands the backend its real view, the direct call does not."""
    for rank, rows in enumerate(run_on_ranks(_predicate_against_the_engine, 2, timeout=300)):
        assert len(rows) > 100 and any(r[4] for r in rows) and not all(r[4] for r in rows), (rank, len(rows))
        for dtype, op, contiguous, numel, says, left in rows:
            if "complex" in dtype:
                assert not says, (rank, dtype, op)
                continue
            assert says == (left == 0), (rank, dtype, op, contiguous, numel, says, left)


def test_a_group_on_the_python_path_counts_no_fallbacks():
    """Where every call runs in Python by choice, nothing 'fell' off the native path."""
    for counts in run_on_ranks(_python_group_counts, 2, timeout=120):
        assert counts == {}, counts


def _python_group_counts(env):
    group = new_group_with({"COLLECTIVES_SHM_PATH": "python"})
    assert backend_of(group).path == "python"
    dist.all_reduce(torch.ones(4, 2)[:, 0], group=group)
    return backend_of(group).fallbacks()


def _in_place_across_rounds(env):
    """In-place reduce_scatters on a native group with 1 KiB rounds, so a chunk takes many rounds
    (the in-place form is safe only if no round reads what an earlier one wrote), against the
    Python path's out-of-place call on the same inputs; and two in place in one coalesced call."""
    settings = {"COLLECTIVES_SHM_ROUND_KB": "1"}
    native = new_group_with({**settings, "COLLECTIVES_SHM_PATH": "native"})
    python = new_group_with({**settings, "COLLECTIVES_SHM_PATH": "python"})
    p, r = env.world_size, env.rank
    same = {}
    for n in (1, 63, 64, 65, 1000, 4099):  # elements a chunk: within a round, at its edge, past it, many rounds
        for op in ("sum", "avg", "max"):
            g = torch.Generator().manual_seed(n)
            inputs = [torch.randn(p * n, generator=g) for _ in range(p)]  # every rank's, drawn alike everywhere
            t = inputs[r].clone()
            dist.reduce_scatter_tensor(t[r * n:(r + 1) * n], t, op=TORCH_OPS[op], group=native)
            want = torch.empty(n)
            dist.reduce_scatter_tensor(want, inputs[r].clone(), op=TORCH_OPS[op], group=python)
            same[f"{n} {op}"] = torch.equal(t[r * n:(r + 1) * n], want)
    a, b = torch.arange(2.0 * p * 700) + r, torch.arange(3.0 * p * 300) - r
    with dist._coalescing_manager(group=native):
        dist.reduce_scatter_tensor(a[r * 1400:(r + 1) * 1400], a, group=native)
        dist.reduce_scatter_tensor(b[r * 900:(r + 1) * 900], b, group=native)
    same["coalesced"] = bool(torch.equal(a[r * 1400:(r + 1) * 1400],
                                         sum(torch.arange(2.0 * p * 700)[r * 1400:(r + 1) * 1400] + q for q in range(p)))
                             and torch.equal(b[r * 900:(r + 1) * 900],
                                             sum(torch.arange(3.0 * p * 300)[r * 900:(r + 1) * 900] - q
                                                 for q in range(p))))
    return same, backend_of(native).fallbacks()


@pytest.mark.parametrize("world_size", [2, 3])
def test_an_in_place_reduce_scatter_over_many_rounds_is_the_python_paths_bits(world_size):
    for rank, (same, fallbacks) in enumerate(run_on_ranks(_in_place_across_rounds, world_size, timeout=120)):
        assert all(same.values()), (rank, world_size, {k: v for k, v in same.items() if not v})
        assert fallbacks == {}, (rank, world_size, fallbacks)


def _messages_and_refusals(env):
    """On a native group: a send and recv the native messages take (plain tensors), then a pair
    handed to the Python path as the C++ Backend hands a message its engine declines (the
    backend's own send and recv, which forward.cpp calls then: on a CPU the dispatcher resolves
    the views the engine's plain() declines before they reach it), then calls refused
    outright (an op the dtype has no meaning for, a send to this rank itself): the fall-off counts
    after each, and what arrived."""
    group = new_group_with({"COLLECTIVES_SHM_PATH": "native"})
    impl = backend_of(group)
    counts, arrived = {}, {}
    plain = torch.arange(4.0) if env.rank == 0 else torch.zeros(4)
    (dist.send if env.rank == 0 else dist.recv)(plain, 1 - env.rank, group=group)
    arrived["plain"] = plain.tolist()
    counts["plain"] = impl.fallbacks()
    if env.rank == 0:
        impl.send([torch.tensor([1.0, -2.0])], 1, 0).wait()
    else:
        got = torch.zeros(2)
        impl.recv([got], 0, 0).wait()
        arrived["handed to Python"] = got.tolist()
    counts["handed to Python"] = impl.fallbacks()
    refused = []
    for call in (lambda: dist.all_reduce(torch.ones(2), op=dist.ReduceOp.BAND, group=group),
                 lambda: dist.send(torch.ones(2), env.rank, group=group)):
        try:
            call()
        except (RuntimeError, ValueError) as exc:
            refused.append(type(exc).__name__)
    counts["refused"] = impl.fallbacks()
    t = torch.ones(2)
    dist.all_reduce(t, group=group)  # the group still works, natively
    counts["after"] = impl.fallbacks()
    return counts, arrived, refused, t.tolist()


def test_messages_left_to_python_are_counted_and_refused_calls_are_not():
    """fallbacks() counts a send or recv the native messages did not take, as it counts
    collectives; a call refused for its arguments ran on no path, so it counts nowhere."""
    for rank, (counts, arrived, refused, after) in enumerate(run_on_ranks(_messages_and_refusals, 2, timeout=120)):
        kind = "send" if rank == 0 else "recv"
        assert counts["plain"] == {}, (rank, counts)
        assert counts["handed to Python"] == {kind: 1}, (rank, counts)
        assert len(refused) == 2, (rank, refused)
        assert counts["refused"] == counts["after"] == {kind: 1}, (rank, counts)
        assert after == [2.0, 2.0]
        if rank == 1:
            assert arrived == {"plain": [0.0, 1.0, 2.0, 3.0], "handed to Python": [1.0, -2.0]}, arrived
