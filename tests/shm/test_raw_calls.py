"""Raw torch.distributed calls on an shm group: every call does what Gloo does with the same
arguments (the same result, or an error), never writes outside its output, and a rank whose
arguments are wrong is named without any rank waiting for it.

    pytest tests/shm/test_raw_calls.py -q
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.distributed as dist

import collectives as C
import collectives.shm
from collectives.errors import CollectiveMismatchError
from collectives.shm.protocol import ShmArgumentError

from . import PATHS

SENTINEL = -7  # what the memory around every output holds; it must still hold it afterwards
CASES = 60


def _values(rng_seed: int, rank: int, numel: int, dtype) -> torch.Tensor:
    """Rank-dependent integers (exact in every dtype here, so sums do not depend on the order)."""
    g = torch.Generator().manual_seed(rng_seed * 31 + rank)
    return torch.randint(-50, 50, (numel,), generator=g).to(dtype)


def _placed(n: int, dtype, rng: random.Random):
    """An output of n elements inside a larger buffer of SENTINEL, at a random offset: (view, buffer)."""
    before, after = rng.randint(0, 5), rng.randint(0, 5)
    buf = torch.full((before + n + after,), SENTINEL, dtype=dtype)
    return buf[before:before + n], buf, (before, before + n)


def _one_case(case: int, rank: int, size: int, group):
    """Build case `case` (the same arguments on every rank), run it on `group`; returns
    (error type or None, outputs as lists, whether the memory around the outputs is untouched)."""
    rng = random.Random(case)  # the same on every rank: the ranks agree on the call
    kind = rng.choice(["all_gather_into_tensor", "all_gather", "reduce_scatter_tensor", "reduce_scatter", "all_reduce"])
    dtype = rng.choice([torch.float32, torch.float64, torch.int32, torch.int64])
    n = rng.randint(1, 9)
    wrong = rng.random() < 0.4
    alias = kind == "reduce_scatter_tensor" and not wrong and rng.random() < 0.5
    inp = _values(case, rank, n * (size if kind.startswith("reduce_scatter") else 1), dtype)
    outs, bufs, spans = [], [], []

    def out(numel, out_dtype=dtype):
        view, buf, span = _placed(numel, out_dtype, rng)
        outs.append(view)
        bufs.append(buf)
        spans.append(span)
        return view

    try:
        if kind == "all_gather_into_tensor":
            bad = wrong and rng.choice(["size", "dtype"])
            o = out(n * size + (rng.choice([-1, 1]) if bad == "size" else 0),
                    torch.float16 if bad == "dtype" else dtype)
            dist.all_gather_into_tensor(o, inp, group=group)
        elif kind == "all_gather":
            k = size + (rng.choice([-1, 1]) if wrong else 0)
            dist.all_gather([out(n) for _ in range(max(k, 1))], inp, group=group)
        elif kind == "reduce_scatter_tensor":
            if alias:  # the output is this rank's own chunk of its input
                dist.reduce_scatter_tensor(inp[rank * n:(rank + 1) * n], inp, group=group)
                outs.append(inp)
            else:
                o = out(n + (rng.choice([-1, 1]) if wrong else 0))
                dist.reduce_scatter_tensor(o, inp, group=group)
        elif kind == "reduce_scatter":
            k = size + (rng.choice([-1, 1]) if wrong else 0)
            dist.reduce_scatter(out(n), list(inp.chunk(size))[:max(k, 1)] if k <= size else
                                list(inp.chunk(size)) + [inp[:n]], group=group)
        else:
            o = out(n)
            o.copy_(inp)
            dist.all_reduce(o, group=group)
        error = None
    except (RuntimeError, ValueError) as exc:
        error = type(exc).__name__ if not isinstance(exc, ShmArgumentError) else "refused"
    untouched = all(torch.equal(buf[:a], torch.full((a,), SENTINEL, dtype=buf.dtype)) and
                    torch.equal(buf[b:], torch.full((len(buf) - b,), SENTINEL, dtype=buf.dtype))
                    for buf, (a, b) in zip(bufs, spans))
    return kind, wrong, error, [o.tolist() for o in outs] if error is None else None, untouched


def _against_gloo(env):
    shm_group = dist.new_group(backend="shm")
    report = []
    for case in range(CASES):
        theirs = _one_case(case, env.rank, env.world_size, None)  # the world is Gloo
        ours = _one_case(case, env.rank, env.world_size, shm_group)
        report.append((case, theirs, ours))
    after = torch.tensor([env.rank + 1.0])
    dist.all_reduce(after, group=shm_group)  # still usable after every refusal
    return report, after.item()


@pytest.mark.parametrize("world_size", [2, 3])
def test_every_raw_call_does_what_gloo_does_and_writes_nothing_outside_its_output(world_size):
    for rank, (report, after) in enumerate(C.run(_against_gloo, world_size=world_size, timeout=300)):
        assert after == sum(range(1, world_size + 1))
        wrong_cases = 0
        for case, (kind, wrong, gloo_error, gloo_out, _), (_, _, shm_error, shm_out, untouched) in report:
            where = f"rank {rank}, case {case}: {kind}, {'wrong' if wrong else 'right'} arguments"
            assert untouched, f"{where}: shm wrote outside the output"
            assert (gloo_error is None) == (shm_error is None), f"{where}: Gloo {gloo_error}, shm {shm_error}"
            if gloo_error is None:
                assert shm_out == gloo_out, f"{where}: shm {shm_out}, Gloo {gloo_out}"
            else:
                assert shm_error in ("refused", "ValueError"), f"{where}: shm raised {shm_error}"
                wrong_cases += 1
        assert wrong_cases >= 10  # the generator really made wrong calls


def _one_rank_wrong(env):
    group = dist.new_group(backend="shm")
    size = env.world_size
    out = torch.empty(2 * size + (1 if env.rank == 1 else 0))  # rank 1's output is one too long
    try:
        dist.all_gather_into_tensor(out, torch.ones(2), group=group)
        said = "no error"
    except ShmArgumentError as exc:
        said = f"refused: {exc}"
    except CollectiveMismatchError as exc:
        said = f"mismatch: {exc}"
    t = torch.ones(1)
    dist.all_reduce(t, group=group)
    return said, t.item()


@pytest.mark.parametrize("path", PATHS)
def test_one_rank_with_wrong_arguments_is_named_and_nobody_waits_for_it(path, monkeypatch):
    monkeypatch.setenv("COLLECTIVES_SHM_PATH", path)
    results = C.run(_one_rank_wrong, world_size=3, timeout=60)
    assert results[1][0].startswith("refused: all_gather on rank 1 of the shm group: output has 7 elements; it must "
                                    "have world_size x input's, 3 x 2 = 6; nothing was moved"), results[1][0]
    for rank in (0, 2):
        said = results[rank][0]
        assert said.startswith("mismatch:") and "rank 1: all_gather with arguments that rank refused" in said, said
    assert [t for _, t in results] == [3.0, 3.0, 3.0]  # the group is still usable


def _refused_by_torch_before(env, on_every_rank):
    """Calls whose data torch itself would refuse mid-call (writing into an expanded tensor; an
    average of integers), on every rank or on rank 0 only: what each raised, and whether the
    group still sums afterwards."""
    group = dist.new_group(backend="shm")
    wrong = on_every_rank or env.rank == 0
    calls = {
        "all_reduce into an expanded tensor": lambda: dist.all_reduce(
            torch.ones(1).expand(4) if wrong else torch.ones(4), group=group),
        "broadcast into an expanded tensor": lambda: dist.broadcast(  # the root only reads: rank 1 is the root
            torch.zeros(2, 1).expand(2, 3) if wrong and env.rank != 1 else torch.zeros(2, 3), src=1, group=group),
        "all_gather into an expanded tensor": lambda: dist.all_gather_into_tensor(
            torch.zeros(1).expand(2 * env.world_size) if wrong else torch.zeros(2 * env.world_size), torch.ones(2),
            group=group),
        "reduce_scatter into an expanded tensor": lambda: dist.reduce_scatter_tensor(
            torch.zeros(1).expand(2) if wrong else torch.zeros(2), torch.ones(2 * env.world_size), group=group),
        "all_reduce avg of int64": lambda: dist.all_reduce(
            torch.ones(3, dtype=torch.int64), op=dist.ReduceOp.AVG if wrong else dist.ReduceOp.SUM, group=group),
        "all_reduce of a sparse tensor": lambda: dist.all_reduce(
            torch.ones(4).to_sparse() if wrong else torch.ones(4), group=group),
        "direct all_reduce of a sparse tensor": lambda: C.shm.all_reduce(
            torch.ones(4).to_sparse() if wrong else torch.ones(4), group=group),
    }
    said = {}
    for label, call in calls.items():
        try:
            call()
            said[label] = "no error"
        except (ShmArgumentError, CollectiveMismatchError) as exc:
            said[label] = f"{type(exc).__name__}: {exc}"
        t = torch.ones(1)
        dist.all_reduce(t, group=group)  # the group is still usable
        said[label] = (said[label], t.item())
    return said


@pytest.mark.parametrize("on_every_rank, path", [(True, "native"), (False, "native"), (False, "python")],
                         ids=["every rank", "rank 0 only", "rank 0 only, python path"])
def test_what_torch_would_refuse_mid_call_is_refused_before_a_byte_moves(on_every_rank, path, monkeypatch):
    monkeypatch.setenv("COLLECTIVES_SHM_PATH", path)
    """These broke the group ("group BROKEN after") when torch's own copy or division raised
    inside the call; now they are refused up front, named, and the group goes on."""
    results = C.run(_refused_by_torch_before, world_size=2, timeout=60, args=(on_every_rank,))
    for rank, said in enumerate(results):
        for label, (text, after) in said.items():
            assert after == 2.0, (rank, label, text)
            if rank == 0 or on_every_rank:
                if "broadcast" in label and rank == 1:  # the root, whose buffer is only read: not refused
                    assert text.startswith("CollectiveMismatchError") and "refused" in text, text
                    continue
                assert text.startswith("ShmArgumentError"), (rank, label, text)
                assert ("share memory (an expanded or stride-0 view" in text) == ("expanded" in label), text
                assert ("op 'avg' on torch.int64 would have to round" in text) == ("avg" in label), text
                assert ("tensor[0] is a sparse tensor (sparse_coo); the shm backend moves dense tensors only: pass "
                        "t.to_dense(), or use a Gloo group, which sums sparse COO tensors" in text) == ("sparse" in label), text
            else:  # rank 1, with right arguments, is told who refused
                assert text.startswith("CollectiveMismatchError") and "refused" in text, (rank, label, text)
