"""The pytest harness itself: a failing rank's traceback reaches pytest, a hang shows every rank's
stack, the pool is kept after a failure only while its ranks are in step, and pytest parameters reach the ranks.

    pytest tests/collectives/test_harness.py -q
"""

import os
import re
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
import torch.distributed as dist

import collectives as C
from collectives.testing import distributed, get_pool, run_on_ranks


def keeps_ranks() -> bool:
    """After a failure every rank answered, the ranks are kept where the backend counts each
    rank's calls (torch's sequence numbers: Gloo, NCCL); shm keeps no such count, so its pool is
    rebuilt. Read when a test runs: tests/shm runs this module again with shm's pools."""
    return (os.environ.get("COLLECTIVES_TEST_BACKEND") or "gloo") != "shm"


def _pid(env):
    return os.getpid()


def _fails_on_rank_1(env):
    assert env.rank != 1, "planted assertion on rank 1"
    return env.rank


def _compares(env):
    total = sum(range(env.rank + 3))
    assert total == 3, "planted"


def _sleeps(env):
    time.sleep(60)


def _raises_after_an_unmatched_send(env):
    if env.rank == 0:
        dist.isend(torch.ones(2), 1)  # never received: the next test's recv from rank 0 would get it
    raise RuntimeError(f"planted on rank {env.rank}, after rank 0's unmatched send")


def _dies_on_rank_1(env):
    if env.rank == 1:
        os._exit(3)
    return env.rank


def test_failure_names_the_rank_and_the_pool_is_kept_only_while_its_ranks_are_in_step():
    before = run_on_ranks(_pid, 2)
    with pytest.raises(C.RankFailure) as info:
        run_on_ranks(_fails_on_rank_1, 2)
    assert info.value.ranks == [1]
    assert "rank 1 raised" in str(info.value) and "planted assertion on rank 1" in str(info.value)
    kept = run_on_ranks(_pid, 2)
    if keeps_ranks():
        assert kept == before  # every rank answered, in step: the same ranks go on
    else:  # shm keeps no sequence numbers to compare: fresh ranks after any failure
        assert set(before).isdisjoint(kept)
    before = kept
    with pytest.raises(C.RankFailure, match="planted on rank"):
        run_on_ranks(_raises_after_an_unmatched_send, 2)
    after = run_on_ranks(_pid, 2)  # rank 0 issued a call rank 1 never matched: fresh ranks
    assert set(before).isdisjoint(after)
    assert run_on_ranks(_pid, 2) == after  # and they are reused again
    with pytest.raises(C.RankFailure, match="rank 1 exited with code 3"):
        run_on_ranks(_dies_on_rank_1, 2)
    assert set(after).isdisjoint(run_on_ranks(_pid, 2))  # a rank died: fresh ranks


def test_a_failed_assert_shows_its_values_and_the_users_frames_only():
    with pytest.raises(C.RankFailure) as info:
        run_on_ranks(_compares, 2)
    message = str(info.value)
    assert message.startswith("rank 1 raised AssertionError: planted"), message
    assert "assert 6 == 3" in message  # the values, as pytest's own assertion rewriting shows them
    assert "in _compares" in message
    assert not [f for f in ("pool.py", "rank_main.py", "testing.py") if f in message], message


def test_a_pools_fork_server_imports_what_test_modules_import(monkeypatch):
    """A new pool asks the fork server to import pytest and hypothesis (and torch._dynamo) once,
    so that no rank imports them itself: a suite starts hundreds of ranks."""
    from collectives import testing

    asked, started = [], []
    monkeypatch.setattr(testing, "preload", lambda *modules: asked.extend(modules))
    monkeypatch.setattr(testing, "_TestPool", lambda *args, **kwargs: started.append(kwargs) or "pool")
    monkeypatch.setattr(testing, "_pools", {})
    assert testing.get_pool(5, "gloo") == "pool" and len(started) == 1
    assert {"torch._dynamo", "pytest", "hypothesis"} <= set(asked), asked
    assert started[0]["setup"] is testing.install_assert_rewriting


def test_a_rank_reads_a_rewritten_test_module_from_pytests_cache_and_never_a_stale_one(tmp_path, monkeypatch):
    """Ranks import test modules through collectives.testing's loader: rewritten as pytest
    rewrites them, written once to pytest's cache, read from it after, and rewritten again once
    the file changes."""
    from collectives import testing

    module = tmp_path / "test_cached_example.py"
    module.write_text("def check(x):\n    assert x == 3\n")

    def imported():
        loader = testing._AssertRewritingLoader("test_cached_example", str(module))
        namespace = {}
        exec(loader.get_code("test_cached_example"), namespace)
        return namespace["check"]

    with pytest.raises(AssertionError, match="assert 6 == 3"):
        imported()(6)
    assert testing._pytest_pyc(str(module)).is_file()

    parsed, parse = [], testing.ast.parse
    monkeypatch.setattr(testing.ast, "parse", lambda *args, **kwargs: parsed.append(args) or parse(*args, **kwargs))
    with pytest.raises(AssertionError, match="assert 6 == 3"):  # from the cache, and rewritten
        imported()(6)
    monkeypatch.undo()
    assert not parsed, "parsed again: pytest's cache was not read"
    module.write_text("def check(x):\n    assert x == 40\n")  # an edit within the same second: the size tells
    with pytest.raises(AssertionError, match="assert 6 == 40"):
        imported()(6)
    module.write_text("def check(x):\n    assert x == 41\n")  # the same size, a later second: the mtime tells
    later = os.stat(module).st_mtime + 10
    os.utime(module, (later, later))
    with pytest.raises(AssertionError, match="assert 6 == 41"):
        imported()(6)


@pytest.mark.slow
def test_a_hang_dumps_every_ranks_stack():
    with pytest.raises(C.RankFailure) as info:
        run_on_ranks(_sleeps, 2, timeout=1.5)
    message = str(info.value)
    for r in range(2):
        assert f"rank {r} did not finish within the 1.5 s timeout; its Python stack" in message
    assert len(re.findall(r"line \d+ in _sleeps", message)) == 2  # one stack frame per rank
    assert not get_pool(2).alive


@pytest.mark.parametrize("value", [3, 5])
@distributed(world_size=2)
def test_parameters_reach_every_rank(env, value):
    t = torch.tensor([float(value)])
    C.all_reduce(t)
    assert t.item() == 2 * value


# hypothesis's @given over @distributed: hypothesis draws in the test process, each example runs on
# the pooled ranks, and a failing example shrinks on the same ranks (they stay while in step).
@settings(max_examples=25, deadline=None)
@given(shape=st.lists(st.integers(0, 5), min_size=0, max_size=3),
       dtype=st.sampled_from([torch.float32, torch.float64, torch.int32, torch.int64]))
@distributed(world_size=3)
def test_a_property_over_ranks(env, shape, dtype):
    """all_reduce of rank r's (r + 1) is 1 + 2 + 3 in every element, whatever the shape and dtype."""
    t = torch.full(shape, env.rank + 1, dtype=dtype)
    C.all_reduce(t)
    torch.testing.assert_close(t, torch.full(shape, 6, dtype=dtype))


@settings(max_examples=40, deadline=None, database=None, derandomize=True)
@given(n=st.integers(1, 64))
@distributed(world_size=2)
def _fails_from_7_on_rank_1(env, n):  # not collected: the test below runs it
    t = torch.full((n,), env.rank + 1.0)
    C.all_reduce(t)
    assert n < 7 or env.rank == 0, f"planted: rank 1 fails from n=7, here n={n}"


def test_a_failing_property_shrinks_on_the_same_ranks():
    before = run_on_ranks(_pid, 2)
    with pytest.raises(C.RankFailure) as info:
        _fails_from_7_on_rank_1()
    message = str(info.value)
    assert message.startswith("rank 1 raised AssertionError: planted: rank 1 fails from n=7, here n=7"), message
    assert "in _fails_from_7_on_rank_1(n=7) on 2 ranks" in message, message
    if keeps_ranks():
        assert run_on_ranks(_pid, 2) == before  # every example ran on the same two ranks
