"""The pytest harness itself: a failing rank's traceback reaches pytest, a hang shows every rank's
stack, the pool is rebuilt after a failure, and pytest parameters reach the ranks.

    pytest tests/collectives/test_harness.py -q
"""

import os
import re
import time

import pytest
import torch

import collectives as C
from collectives.testing import distributed, get_pool, run_on_ranks


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


def test_failure_names_the_rank_and_the_pool_is_rebuilt():
    before = run_on_ranks(_pid, 2)
    with pytest.raises(C.RankFailure) as info:
        run_on_ranks(_fails_on_rank_1, 2)
    assert info.value.ranks == [1]
    assert "rank 1 raised" in str(info.value) and "planted assertion on rank 1" in str(info.value)
    after = run_on_ranks(_pid, 2)  # a fresh pool, not the one that saw the failure
    assert set(before).isdisjoint(after)
    assert run_on_ranks(_pid, 2) == after  # and it is reused again


def test_a_failed_assert_shows_its_values_and_the_users_frames_only():
    with pytest.raises(C.RankFailure) as info:
        run_on_ranks(_compares, 2)
    message = str(info.value)
    assert message.startswith("rank 1 raised AssertionError: planted"), message
    assert "assert 6 == 3" in message  # the values, as pytest's own assertion rewriting shows them
    assert "in _compares" in message
    assert not [f for f in ("pool.py", "rank_main.py", "testing.py") if f in message], message


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
