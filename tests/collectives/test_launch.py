"""collectives.run: results in rank order; a rank that raises, dies, aborts or hangs gives one
RankFailure naming it, with its traceback, exit code, signal or Python stack, and no rank
process is left behind. Each case spawns ranks (~3 s), so the grid is small.

    pytest tests/collectives/test_launch.py -q
"""

import os
import time

import pytest
import torch
import torch.distributed as dist

import collectives as C


def _who(env, k):
    t = torch.tensor([env.rank + 1.0])
    dist.all_reduce(t)
    return env.rank, env.world_size, env.backend, str(env.device), torch.get_num_threads(), t.item() * k


def test_results_come_back_in_rank_order():
    assert C.run(_who, world_size=3, args=(2,)) == [(r, 3, "gloo", "cpu", 1, 12.0) for r in range(3)]


def _fail(env, how, pid_dir):
    (pid_dir / f"rank{env.rank}.pid").write_text(str(os.getpid()))
    if env.rank == 1:
        if how == "raise":
            raise ValueError("planted failure on rank 1")
        if how == "exit":
            os._exit(7)
        if how == "abort":  # what Gloo does on a size mismatch
            t = torch.ones(3)
            dist.all_reduce(t)
    if how == "abort" and env.rank == 0:
        dist.all_reduce(torch.ones(5))  # the size mismatch: raw Gloo aborts
    if how == "hang":
        time.sleep(600)
    dist.all_reduce(torch.ones(1))  # rank 0 waits here for a rank 1 that never comes
    time.sleep(600)


def _assert_all_gone(pid_dir):
    pids = [int(p.read_text()) for p in pid_dir.glob("*.pid")]
    assert pids, "the ranks never started"
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


@pytest.mark.parametrize(
    "how, fragments",
    [
        ("raise", ["rank 1 raised", "ValueError: planted failure on rank 1", "rank 0 was still running", "in _fail"]),
        ("exit", ["rank 1 exited with code 7"]),
        ("abort", ["died from SIGABRT"]),
        ("hang", ["did not finish within the 2 s timeout", "its Python stack", "in _fail"]),
    ],
)
def test_a_failing_rank_is_named_and_nothing_is_left_behind(how, fragments, tmp_path):
    start = time.monotonic()
    with pytest.raises(C.RankFailure) as info:
        C.run(_fail, world_size=2, args=(how, tmp_path), timeout=2 if how == "hang" else 60)
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} missing from:\n{message}"
    assert info.value.ranks == [0, 1]
    assert time.monotonic() - start < 30
    _assert_all_gone(tmp_path)


def test_a_function_the_ranks_cannot_import_is_refused_clearly():
    with pytest.raises(TypeError, match="module level"):
        C.run(lambda env: env.rank, world_size=2)
