"""The harness leaves a pool's ranks with the groups they had before each test: the groups a test
body makes (its subgroups, a DeviceMesh's) are destroyed once it has returned on every rank (as
the next body starts), but those it makes
through kept_groups, which serve the module's later tests and go when another module's test
comes; a body that raises keeps its groups; DTensor's cached plans never name a destroyed group.

    pytest tests/collectives/test_harness_groups.py -q
"""

import pytest
import torch
import torch.distributed as dist

from collectives.errors import RankFailure
from collectives.testing import kept_groups, run_on_ranks

from .test_harness import _pid  # a body of another module


def _registered(env):
    """How many groups this rank has registered, the world's among them."""
    return len(dist.distributed_c10d._world.pg_map)


def _makes_groups(env, backend):
    whole = dist.new_group(backend=backend)
    dist.new_group([0], backend=backend)  # rank 1 is not in it: nothing is registered there
    t = torch.tensor([env.rank + 1.0])
    dist.all_reduce(t, group=whole)
    return _registered(env), t.item()


def _keeps_one_of_two(env):
    kept = kept_groups("whole", lambda: dist.new_group(backend="gloo"))
    dist.new_group(backend="gloo")
    return _registered(env), _sum_on(kept)


def _sum_on(group):
    t = torch.tensor([dist.get_rank() + 1.0])
    dist.all_reduce(t, group=group)
    return t.item()


def _makes_a_group_and_raises(env):
    dist.new_group(backend="gloo")
    raise ValueError("planted")


def _sums_on_the_newest_and_destroys_it(env):
    """An all_reduce on the last group registered, which the test before left; then it goes, so
    that the next test starts as the one before it did."""
    newest = list(dist.distributed_c10d._world.pg_map)[-1]
    t = torch.tensor([env.rank + 1.0])
    dist.all_reduce(t, group=newest)
    ranks = dist.get_process_group_ranks(newest)
    dist.destroy_process_group(newest)
    return t.item(), ranks


def _a_dtensor_on_a_new_mesh(env):
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = DeviceMesh.from_group(dist.new_group(backend="gloo"), "cpu")
    x = distribute_tensor(torch.arange(4.0), mesh, [Shard(0)])
    return (x * 2).full_tensor().tolist()


@pytest.mark.parametrize("backend", ["gloo", "shm"])
def test_the_groups_a_test_makes_are_gone_when_it_returns(backend):
    before = run_on_ranks(_registered, 2)
    assert run_on_ranks(_makes_groups, 2, args=(backend,)) == [(before[0] + 2, 3.0), (before[1] + 1, 3.0)]
    assert run_on_ranks(_registered, 2) == before


def test_a_kept_group_serves_the_modules_later_tests_and_goes_when_another_modules_test_comes():
    run_on_ranks(_pid, 2)  # whatever an earlier module kept is gone
    before = run_on_ranks(_registered, 2)
    assert run_on_ranks(_keeps_one_of_two, 2) == [(n + 2, 3.0) for n in before]
    assert run_on_ranks(_registered, 2) == [n + 1 for n in before]
    assert run_on_ranks(_keeps_one_of_two, 2) == [(n + 2, 3.0) for n in before]  # the same kept group, not a second
    run_on_ranks(_pid, 2)
    assert run_on_ranks(_registered, 2) == before


def test_a_body_that_raises_keeps_its_groups():
    before = run_on_ranks(_registered, 2)
    with pytest.raises(RankFailure, match="planted"):
        run_on_ranks(_makes_a_group_and_raises, 2)
    assert run_on_ranks(_registered, 2) == [n + 1 for n in before]  # Gloo's pool is kept after an answered failure
    assert run_on_ranks(_sums_on_the_newest_and_destroys_it, 2) == [(3.0, [0, 1])] * 2


def test_a_dtensor_on_an_equal_mesh_of_a_later_test_finds_its_own_group():
    """DTensor caches its plans by mesh, and a mesh over the same ranks is equal to the last test's,
    whose group is destroyed: the harness empties that cache with the groups."""
    for _ in range(2):
        assert run_on_ranks(_a_dtensor_on_a_new_mesh, 2) == [[0.0, 2.0, 4.0, 6.0]] * 2


def _makes_a_group_one_rank_slow(env):
    """Rank 1 takes 0.3 s longer to return than rank 0, after the group is made: when it returns."""
    import time

    dist.new_group(backend="gloo")
    if env.rank == 1:
        time.sleep(0.3)
    return time.monotonic()


def _when_the_groups_before_went(env):
    from collectives import testing

    return testing._left["destroyed_at"]


def test_no_rank_destroys_a_test_s_groups_before_every_rank_has_returned():
    """A rank that closed its Gloo connections as soon as its body returned broke a slower peer
    still reading their handshake; the groups go only once the last rank is back."""
    returned = run_on_ranks(_makes_a_group_one_rank_slow, 2)
    destroyed = run_on_ranks(_when_the_groups_before_went, 2)
    assert min(destroyed) >= max(returned), (returned, destroyed)


def test_the_dist_run_fixture_is_run_on_ranks_under_its_old_name(request):
    with pytest.warns(FutureWarning, match="the dist_run fixture is collectives.testing.run_on_ranks"):
        fixture = request.getfixturevalue("dist_run")
    assert fixture is run_on_ranks and fixture(_registered, 2) == run_on_ranks(_registered, 2)
