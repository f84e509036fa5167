"""collectives.shm.all_reduce (direct.py): the native all_reduce called without torch's dispatch is
the same collective as dist.all_reduce on the group, in the same order as the group's other calls,
with the same named errors and the same flight record; whatever the native path does not take goes
through dist.all_reduce. Its bits against the Python path's: test_native.py's property test (its
"direct all_reduce" collective).

    pytest tests/shm/test_direct.py -q
"""

import time

import pytest
import torch
import torch.distributed as dist

import collectives as C
import collectives.shm as shm
from collectives.flight_recorder import dump
from collectives.shm import backend_of, new_group_with
from collectives.testing import run_on_ranks

WORLD = 3
TOTAL = WORLD * (WORLD + 1) / 2  # rank r adds r + 1


def _ranks_add(shape=(5,), dtype=torch.float32):
    return torch.full(shape, dist.get_rank() + 1, dtype=dtype)


def _behaviours(env):
    rank, seen = env.rank, {}
    world = dist.group.WORLD
    assert backend_of(world).path == "native"

    # 1. rank 0 calls it, the others dist.all_reduce: one collective
    t = _ranks_add()
    (shm.all_reduce if rank == 0 else dist.all_reduce)(t)
    seen["mixed with dist.all_reduce"] = t.tolist() == [TOTAL] * 5
    t = _ranks_add(dtype=torch.int64)
    shm.all_reduce(t, dist.ReduceOp.MAX)
    seen["max"] = t.tolist() == [WORLD] * 5

    # 2. behind calls queued for the engine's worker, a native one and a Python job (the list form
    # of all_gather): run after them, in the order issued
    big = _ranks_add((1 << 18,))  # 1 MiB: past the inline limit, so queued
    work = dist.all_reduce(big, async_op=True)
    gathered = [torch.zeros(2) for _ in range(WORLD)]
    listed = dist.all_gather(gathered, _ranks_add((2,)), async_op=True)
    small = _ranks_add((3,))
    shm.all_reduce(small)
    work.wait()
    listed.wait()
    seen["after a queued call"] = bool(torch.equal(big, torch.full((1 << 18,), TOTAL))) and \
        small.tolist() == [TOTAL] * 3 and [g.tolist() for g in gathered] == [[r + 1.0] * 2 for r in range(WORLD)]

    # 3. ranks that disagree: the named error on every rank, and the group still works
    with pytest.raises(C.CollectiveMismatchError) as info:
        shm.all_reduce(torch.ones(4 if rank == 2 else 3))
    seen["mismatch"] = str(info.value)
    t = _ranks_add()
    shm.all_reduce(t)
    seen["usable after the mismatch"] = t.tolist() == [TOTAL] * 5

    # 4. what the native path does not take goes through dist.all_reduce, with its result or error
    gloo = dist.new_group(backend="gloo")
    python = new_group_with({"COLLECTIVES_SHM_PATH": "python"})
    pair = dist.new_group([0, 1], backend="shm")  # rank 2 is not in it
    t = _ranks_add()
    shm.all_reduce(t, group=gloo)
    seen["gloo group"] = t.tolist() == [TOTAL] * 5
    t = _ranks_add()
    shm.all_reduce(t, group=python)
    seen["python path"] = t.tolist() == [TOTAL] * 5
    t = _ranks_add(dtype=torch.complex64)
    shm.all_reduce(t)
    seen["complex"] = t.tolist() == [complex(TOTAL)] * 5
    buf = torch.zeros(10)
    t = buf[::2]
    t += rank + 1
    shm.all_reduce(t)
    seen["non-contiguous"] = t.tolist() == [TOTAL] * 5 and buf[1::2].tolist() == [0.0] * 5
    t = _ranks_add()
    shm.all_reduce(t, group=pair)
    seen["not a member"] = t.tolist() == ([3.0] * 5 if rank < 2 else [float(rank + 1)] * 5)
    with pytest.raises(Exception) as info:  # an average of integers: dist.all_reduce's own refusal
        shm.all_reduce(_ranks_add(dtype=torch.int32), dist.ReduceOp.AVG)
    seen["avg of int32"] = f"{type(info.value).__name__}: {info.value}"
    t = _ranks_add()
    shm.all_reduce(t)
    seen["usable after the refusal"] = t.tolist() == [TOTAL] * 5

    # 5. in the flight record like any other call
    shm.all_reduce(torch.ones(7, dtype=torch.float64))
    seen["recorded"] = _last_entry(world)[:4]

    # 6. a call whose caller waits at once runs in the caller, past the inline size: its record was
    # started when it was made (native_recorder.h); an async one is queued, then started. Each
    # collective the native path takes, since FSDP's all-gathers and DDP's buckets must stay queued.
    n = 1 << 18  # 1 MiB of float32, past COLLECTIVES_SHM_INLINE_BYTES
    calls = {
        "all_reduce": lambda a: dist.all_reduce(_ranks_add((n,)), async_op=a),
        "broadcast": lambda a: dist.broadcast(_ranks_add((n,)), src=1, async_op=a),
        "reduce": lambda a: dist.reduce(_ranks_add((n,)), dst=2, async_op=a),
        "all_gather": lambda a: dist.all_gather_into_tensor(torch.empty(WORLD * n), _ranks_add((n,)), async_op=a),
        "reduce_scatter": lambda a: dist.reduce_scatter_tensor(torch.empty(n), _ranks_add((WORLD * n,)), async_op=a),
    }
    ran_at_once = {}
    big = _ranks_add((n,))
    shm.all_reduce(big)
    ran_at_once["direct all_reduce"] = _started_when_made(world) and bool(torch.equal(big, torch.full((n,), TOTAL)))
    for name, call in calls.items():
        for wait_at_once in (True, False):
            work = call(not wait_at_once)
            if work is not None:  # async: the worker thread that completes it lingers before it is
                work.get_future().then(_linger)  # done with it, so the next call finds it still running (the race)
                work.wait()
            assert _last_entry(world)[0] == f"shm:{name}"
            ran_at_once[f"{name}, async_op={not wait_at_once}"] = _started_when_made(world)
    seen["ran at once"] = ran_at_once
    return seen


def _linger(_future):
    time.sleep(0.02)


def _started_when_made(group) -> bool:
    created, started = _last_entry(group)[4:]
    return created == started


def _last_entry(group):
    name = dist.distributed_c10d._world.pg_names[group]
    e = [e for e in dump()["entries"] if e["process_group"][0] == name][-1]
    return (e["profiling_name"], e["input_sizes"], e["input_dtypes"], e["state"], e["time_created_ns"],
            e["time_discovered_started_ns"])


@pytest.fixture(scope="module")
def seen():
    return run_on_ranks(_behaviours, WORLD, backend="shm")  # the shared 3-rank shm pool


@pytest.mark.parametrize("what", ["mixed with dist.all_reduce", "max", "after a queued call", "usable after the mismatch",
                                  "gloo group", "python path", "complex", "non-contiguous", "not a member",
                                  "usable after the refusal"])
def test_it_leaves_what_dist_all_reduce_leaves(seen, what):
    assert [s[what] for s in seen] == [True] * WORLD, what


def test_ranks_that_disagree_get_the_named_mismatch(seen):
    for rank, s in enumerate(seen):
        message = s["mismatch"]
        assert f"on rank {rank} of the shm group" in message, message
        assert "ranks 0, 1: all_reduce of 3 float32 (sum)" in message, message
        assert "rank 2: all_reduce of 4 float32 (sum)" in message, message


def test_a_call_the_native_path_refuses_gets_dist_all_reduces_error(seen):
    for s in seen:
        assert "all_reduce" in s["avg of int32"] and "int32" in s["avg of int32"].lower(), s["avg of int32"]


def test_it_is_in_the_flight_record(seen):
    assert [s["recorded"] for s in seen] == [("shm:all_reduce", [[7]], ["Double"], "completed")] * WORLD


def test_a_call_waited_for_at_once_runs_in_the_caller_and_an_async_one_is_queued(seen):
    expected = {"direct all_reduce": True}
    for name in ("all_reduce", "broadcast", "reduce", "all_gather", "reduce_scatter"):
        expected.update({f"{name}, async_op=False": True, f"{name}, async_op=True": False})
    assert [s["ran at once"] for s in seen] == [expected] * WORLD
