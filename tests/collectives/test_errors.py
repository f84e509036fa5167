"""Every error the wrappers raise: the message names what is wrong, nothing hangs or aborts, and
the next collective on the same group still gives the right answer.

Mismatches that would abort Gloo (sizes), hang it (different collectives) or silently mix ops
(SUM on one rank, MAX on another) are caught by checked mode on every rank.

    pytest tests/collectives/test_errors.py -q
"""


import pytest
import torch

import collectives as C
from collectives.checks import GroupInfo, check_tensor
from collectives.errors import CollectiveError, CollectiveMismatchError
from collectives.launcher.pool import RankPool
from collectives.testing import distributed


def raises(fn, exc_type, *fragments):
    """Call fn, require exc_type whose message holds every fragment; return the message."""
    with pytest.raises(exc_type) as info:
        fn()
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} missing from: {message}"
    return message


def group_still_works(group=None, ranks=None):
    """A SUM all_reduce on the group gives the closed form: the group is usable."""
    import torch.distributed as dist

    ranks = ranks if ranks is not None else list(range(dist.get_world_size()))
    t = torch.tensor([dist.get_rank() + 1.0])
    C.all_reduce(t, group=group)
    assert t.item() == sum(r + 1 for r in ranks)


@distributed(world_size=2)
def test_local_checks_name_the_problem(env):
    r = env.rank
    raises(lambda: C.broadcast(torch.ones(2), src=2), CollectiveError, "broadcast", f"rank {r}", "src=2", "world_size 2")
    raises(lambda: C.reduce(torch.ones(2), dst=-1), CollectiveError, "reduce", "dst=-1")
    raises(lambda: C.all_reduce(torch.ones(2), op="band"), CollectiveError, "'band'", "torch.float32")
    raises(lambda: C.all_reduce(torch.ones(2, dtype=torch.complex64), op="min"), CollectiveError, "'min'", "complex")
    raises(lambda: C.all_reduce(torch.ones(2, dtype=torch.int32), op="avg"), CollectiveError, "'avg'", "torch.int32")
    raises(lambda: C.all_reduce(torch.ones(2, dtype=torch.bool), op="sum"), CollectiveError, "'sum'", "bool", "bor")
    raises(lambda: C.all_reduce(torch.ones(2), op="mean"), CollectiveError, "unknown reduction op 'mean'")
    raises(lambda: C.all_reduce(torch.ones(2).to(torch.float8_e5m2)), CollectiveError, "float8_e5m2", "bfloat16 or float32")
    raises(lambda: C.all_reduce([1.0, 2.0]), CollectiveError, "must be a torch.Tensor", "list")
    raises(lambda: C.all_reduce(torch.ones(2, device="meta")), CollectiveError, env.backend, "meta")
    raises(lambda: C.reduce_scatter(torch.ones(3, 2)), CollectiveError, "reduce_scatter", "first dimension 3", "group size 2")
    raises(lambda: C.scatter(torch.ones(5)), CollectiveError, "scatter", "first dimension 5")
    raises(lambda: C.all_to_all(torch.ones(())), CollectiveError, "all_to_all", "0-d tensor")
    raises(lambda: C.all_reduce(torch.sparse_coo_tensor(torch.zeros(1, 0, dtype=torch.long), torch.ones(0), (2,))),
           CollectiveError, "dense")
    group_still_works()


@distributed(world_size=2)
def test_arguments_that_used_to_reach_torch_internals_are_named(env):
    """op=None, a group that is not a process group and dtypes no backend moves: one clear error
    each (they were KeyError, AttributeError, a barrier silently on the world, "Invalid scalar type")."""
    raises(lambda: C.all_reduce(torch.ones(2), op=None), CollectiveError, "all_reduce", "unknown reduction op None")
    raises(lambda: C.reduce_scatter(torch.ones(2, 2), op=None), CollectiveError, "reduce_scatter", "op None")
    raises(lambda: C.reduce_scatter(torch.ones(2, 2), torch.ones(2)), CollectiveError, "reduce_scatter",
           "unknown reduction op Tensor of shape (2,)")  # a tensor where op goes was an AttributeError
    for bad in (0, "world", [0, 1]):
        raises(lambda: C.all_reduce(torch.ones(2), group=bad), CollectiveError, "all_reduce", "group must be a process group",
               repr(bad))
    raises(lambda: C.barrier(group=0), CollectiveError, "barrier", "got 0")
    for dtype in (torch.float8_e8m0fnu, torch.uint4, torch.bits8):
        raises(lambda: C.broadcast(torch.zeros(4, dtype=dtype), src=0), CollectiveError, "broadcast", f"rank {env.rank}",
               str(dtype), "no backend here can move")
        raises(lambda: C.all_gather(torch.zeros(4, dtype=dtype)), CollectiveError, "all_gather", str(dtype))
    group_still_works()


def test_nccl_checks_without_a_gpu():
    """The NCCL device check, run against a NCCL-like group description. Non-contiguous tensors
    pass (the wrappers hand NCCL a contiguous copy)."""
    info = GroupInfo(group=None, ranks=(0, 1), group_rank=0, global_rank=0, backend="nccl")
    raises(lambda: check_tensor(torch.ones(4), "all_reduce", info), CollectiveError, "nccl", "CUDA", "cpu")


@distributed(world_size=4)
def test_root_not_in_group_and_rank_not_in_group(env):
    low = C.new_group([0, 1])  # every rank creates it; only 0 and 1 are in it
    if env.rank in (0, 1):
        raises(lambda: C.broadcast(torch.ones(1), src=3, group=low), CollectiveError, "src=3", "not in the group", "[0, 1]")
        group_still_works(low, [0, 1])
    else:
        # torch.distributed would only warn here and leave the tensor untouched.
        raises(lambda: C.all_reduce(torch.ones(1), group=low), CollectiveError, f"rank {env.rank}", "not in", "[0, 1]")
    group_still_works()


@distributed(world_size=3)
def test_all_gather_trailing_shape_mismatch_is_caught_without_checked_mode(env):
    # Unchecked, raw Gloo aborts the process (SIGABRT) on this; the wrapper's size exchange
    # sees it first and every rank raises.
    t = torch.ones(2, 3) if env.rank != 1 else torch.ones(2, 4)
    raises(lambda: C.all_gather(t), CollectiveMismatchError, "trailing", "rank 1: shape=(2, 4)", "rank 0: shape=(2, 3)")
    dtype = torch.float32 if env.rank != 2 else torch.float64
    raises(lambda: C.gather(torch.ones(2, dtype=dtype)), CollectiveMismatchError, "rank 2: shape=(2,), dtype=torch.float64")
    group_still_works()


def _mismatches(rank):
    """(name, what this rank calls, what the message must say) for each mismatch checked mode catches."""
    odd = rank == 1
    return [
        ("op", lambda: C.all_reduce(torch.ones(2), op="max" if odd else "sum"), ["op differ", "op=max", "op=sum"]),
        ("size", lambda: C.all_reduce(torch.ones(3 if odd else 2)), ["shape differ", "shape=(3,)", "shape=(2,)"]),
        ("dtype", lambda: C.broadcast(torch.ones(2, dtype=torch.float64 if odd else torch.float32)), ["dtype differ"]),
        ("collective", lambda: C.broadcast(torch.ones(2)) if odd else C.all_reduce(torch.ones(2)),
         ["collective", "rank 1: broadcast(", "rank 0: all_reduce("]),
        ("root", lambda: C.broadcast(torch.ones(2), src=1 if odd else 0), ["src/dst differ", "src=1", "src=0"]),
        ("gather dim", lambda: C.all_gather(torch.ones(2, 3 if odd else 2)), ["shape differ"]),
    ]


@distributed(world_size=3)
def test_checked_mode_catches_mismatches_on_every_rank(env):
    for name, call, fragments in _mismatches(env.rank):
        with C.checked():
            message = raises(call, CollectiveMismatchError, "checked mode", *fragments)
        assert "rank 0" in message and "rank 2" in message, name
        group_still_works()


@distributed(world_size=2)
def test_checked_mode_spreads_one_ranks_local_error_to_all_ranks(env):
    # Only rank 1 passes a bad tensor; unchecked, rank 0 would enter the collective and wait forever.
    t = torch.ones(2) if env.rank == 1 else torch.ones(2, dtype=torch.int32)
    with C.checked():
        raises(lambda: C.all_reduce(t, op="bor"), CollectiveError, "rank(s) [1] failed a local check", "'bor'")
    group_still_works()


@distributed(world_size=2)
def test_checked_mode_passes_matching_calls_and_can_be_switched_off(env):
    with C.checked():
        assert C.is_checked()
        group_still_works()
        with C.checked(False):
            assert not C.is_checked()
        assert C.is_checked()
    assert not C.is_checked()


def _env_checked_body(env):
    assert C.is_checked(), "COLLECTIVES_CHECKED=1 did not turn checked mode on"
    message = ""
    try:
        C.all_reduce(torch.ones(2), op="max" if env.rank else "sum")
    except CollectiveMismatchError as exc:
        message = str(exc)
    group_still_works()
    return message


def test_checked_mode_from_the_environment(monkeypatch):
    monkeypatch.setenv("COLLECTIVES_CHECKED", "1")  # the spawned ranks inherit it
    messages = C.run(_env_checked_body, world_size=2, timeout=60)
    assert all("op differ" in m for m in messages), messages


@distributed(world_size=3)
def test_none_is_a_collective_error_not_an_attribute_error(env):
    for call in (lambda: C.all_reduce(None), lambda: C.reduce(None), lambda: C.broadcast(None),
                 lambda: C.reduce_scatter(None), lambda: C.all_to_all(None)):
        raises(call, CollectiveError, "is None", f"rank {env.rank}")
    # collectives that exchange shapes first: every rank raises, even those that passed a tensor
    raises(lambda: C.all_gather(None if env.rank == 1 else torch.ones(2)), CollectiveError,
           "rank(s) [1] failed a local check", "rank 1: all_gather on rank 1: tensor is None")
    raises(lambda: C.gather(torch.ones(2) if env.rank else None), CollectiveError, "rank(s) [0] failed a local check")
    group_still_works()


@distributed(world_size=3)
def test_scatter_takes_none_on_the_ranks_other_than_src(env):
    src = 2
    full = torch.arange(12.0).view(6, 2) if env.rank == src else None
    got = C.scatter(full, src=src)
    assert torch.equal(got, torch.arange(12.0).view(6, 2)[2 * env.rank:2 * env.rank + 2])
    ints = C.scatter(torch.arange(3, dtype=torch.int8) if env.rank == 0 else None, src=0, async_op=True).wait()
    assert ints.dtype == torch.int8 and ints.tolist() == [env.rank]
    with C.checked():  # checked mode does not count None against src's shape
        assert C.scatter(torch.ones(3) if env.rank == 0 else None, src=0).tolist() == [1.0]
    # src passing None, or another rank passing a tensor of another shape: every rank raises
    raises(lambda: C.scatter(None, src=1), CollectiveError, "failed a local check", "rank 1: scatter on rank 1: tensor is None")
    raises(lambda: C.scatter(torch.ones(3) if env.rank != 1 else torch.ones(6), src=0), CollectiveMismatchError,
           "rank(s) [1] passed a tensor not shaped like src rank 0's", "rank 1: shape=(6,)")
    raises(lambda: C.scatter(torch.ones(4) if env.rank == 0 else None, src=0), CollectiveError,
           "src rank 0's tensor has first dimension 4", "group size 3")
    group_still_works()


@distributed(world_size=3)
def test_plain_mode_spreads_a_local_failure_where_it_exchanges_shapes(env):
    # Only rank 2 passes a bad dst. Without the shape exchange carrying that failure, ranks 0
    # and 1 would enter the gather and wait for rank 2 forever.
    dst = 7 if env.rank == 2 else 0
    raises(lambda: C.gather(torch.ones(2), dst=dst), CollectiveError, "rank(s) [2] failed a local check", "dst=7")
    # different dst on different ranks (each valid): every rank is told
    raises(lambda: C.gather(torch.ones(2), dst=env.rank % 2), CollectiveMismatchError, "different dst",
           "rank 1: dst=1", "rank 0: dst=0")
    raises(lambda: C.scatter(torch.ones(3), src=env.rank % 2), CollectiveMismatchError, "different src")
    group_still_works()


@pytest.mark.parametrize("kwargs, error, fragment", [
    ({"world_size": "2"}, TypeError, "world_size must be an int, got str '2'"),
    ({"world_size": None}, TypeError, "world_size must be an int, got NoneType"),
    ({"world_size": True}, TypeError, "world_size must be an int, got bool"),
    ({"world_size": 0}, ValueError, "world_size must be at least 1, got 0"),
    ({"world_size": 2, "timeout": float("nan")}, ValueError, "timeout must be a positive, finite number of seconds, got nan"),
    ({"world_size": 2, "timeout": "5"}, TypeError, "timeout must be a number of seconds, got str '5'"),
    ({"world_size": 2, "timeout": -1}, ValueError, "got -1"),
    ({"world_size": 2, "args": 5}, TypeError, "args must be a tuple or list of positional arguments, got int 5"),
    ({"world_size": 2, "args": "ab"}, TypeError, "got str 'ab'"),
    ({"world_size": 2, "threads": -1}, ValueError, "threads must be a non-negative int"),
])
def test_run_refuses_bad_arguments_before_spawning(kwargs, error, fragment, monkeypatch):
    def no_rank_may_start(self):
        raise AssertionError("a rank was started for a call with bad arguments")

    monkeypatch.setattr(RankPool, "start", no_rank_may_start)
    with pytest.raises(error) as info:
        C.run(_env_checked_body, **kwargs)
    assert fragment in str(info.value)
    with pytest.raises(TypeError, match="fn must be a function, got int"):
        C.run(5, 2)


@distributed(world_size=2)
def test_numpy_integer_roots_are_taken_as_torch_takes_them(env):
    """src=np.int64(1) is a rank to torch.distributed; the wrappers used to refuse it as not an int."""
    import numpy as np

    t = torch.tensor([float(env.rank)])
    C.broadcast(t, src=np.int64(1))
    assert t.item() == 1.0
    r = torch.tensor([env.rank + 1.0])
    C.reduce(r, dst=np.int32(0))
    assert env.rank != 0 or r.item() == 3.0
    raises(lambda: C.broadcast(torch.ones(1), src=True), CollectiveError, "src must be an int")
    raises(lambda: C.broadcast(torch.ones(1), src=np.float64(1.0)), CollectiveError, "src must be an int")
    group_still_works()
