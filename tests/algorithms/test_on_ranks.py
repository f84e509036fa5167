"""The from-scratch algorithms on real processes (Gloo point-to-point): every algorithm against the
backend's own collective and the closed form, world sizes 1-4 (and 8 for a few), element counts
that do not divide, a subgroup, every op, floats bit-identical on every rank.

    pytest tests/algorithms/test_on_ranks.py -q
"""

import gc
import os
import weakref

import pytest
import torch
import torch.distributed as dist

import collectives
import collectives.algorithms as A
from collectives.errors import CollectiveError

from .reference import expected, inputs_for
from collectives.testing import run_on_ranks

CASES = [(c, a) for c, algos in A.ALGORITHMS.items() for a in algos]


def _flat_call(collective, algorithm, x, op, root, group=None):
    """The public call on a flat tensor, its output flattened (None off the root)."""
    if collective in ("all_reduce", "reduce", "broadcast"):
        t = x.clone()
        kwargs = {"op": op} if collective != "broadcast" else {}
        if collective == "broadcast":
            A.broadcast(t, src=root, group=group, algorithm=algorithm)
        elif collective == "reduce":
            A.reduce(t, dst=root, group=group, algorithm=algorithm, **kwargs)
        else:
            A.all_reduce(t, group=group, algorithm=algorithm, **kwargs)
        return None if collective == "reduce" and dist.get_rank() != root else t
    fn = getattr(A, collective)
    if collective == "reduce_scatter":
        return fn(x, op=op, group=group, algorithm=algorithm)
    if collective in ("gather", "scatter"):
        kw = {"dst": root} if collective == "gather" else {"src": root}
        out = fn(x, group=group, algorithm=algorithm, **kw)
        return out
    return fn(x, group=group, algorithm=algorithm)


def _every_algorithm(env, numel, op):
    """Every (collective, algorithm) on this world; what failed, as text (empty: all right)."""
    n, r = env.world_size, env.rank
    wrong = []
    for collective, algorithm in CASES:
        for root in sorted({0, n - 1}):
            count = numel
            if collective in ("reduce_scatter", "scatter", "all_to_all"):
                count = n * max(1, numel // n)  # the public calls split dim 0 evenly, as the wrappers do
            inputs = inputs_for(collective, n, count, torch.int64, seed=n * 100 + numel, op=op)
            got = _flat_call(collective, algorithm, inputs[r], op, root)
            want = expected(collective, inputs, op, root)[r]
            if (want is None) != (got is None) or (want is not None and not torch.equal(got, want)):
                wrong.append(f"{collective}/{algorithm} root {root}: {got} != {want}")
    return wrong


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("numel", [1, 13])
def test_every_algorithm_on_real_ranks(world_size, numel):
    for wrong in run_on_ranks(_every_algorithm, world_size, args=(numel, "sum"), timeout=120):
        assert not wrong, "\n".join(wrong)


def _against_backend(env):
    """Floats: each algorithm's all_reduce gives every rank the same bits, close to Gloo's."""
    g = torch.Generator().manual_seed(env.rank)
    x = torch.randn(1000, generator=g) * 100
    backend = collectives.all_reduce(x.clone())
    out = {}
    for algorithm in A.ALGORITHMS["all_reduce"]:
        mine = A.all_reduce(x.clone(), algorithm=algorithm)
        torch.testing.assert_close(mine, backend, rtol=1e-5, atol=1e-4)
        everyone = collectives.all_gather(mine.view(1, -1))  # (world, 1000)
        out[algorithm] = all(torch.equal(everyone[0].view(torch.int32), row.view(torch.int32)) for row in everyone)
    return out


@pytest.mark.parametrize("world_size", [3, 4])
def test_floats_close_to_the_backend_and_identical_on_every_rank(world_size):
    for per_rank in run_on_ranks(_against_backend, world_size):
        assert all(per_rank.values()), per_rank


def _ops_and_group(env):
    trio = collectives.split([[1, 2, 3]])
    if env.rank == 0:
        return []
    wrong = []
    g = env.rank - 1
    for op in ("min", "max", "product", "bxor"):
        inputs = inputs_for("all_reduce", 3, 10, torch.int32, seed=7, op=op)
        for algorithm in A.ALGORITHMS["all_reduce"]:
            got = A.all_reduce(inputs[g].clone(), op=op, group=trio, algorithm=algorithm)
            if not torch.equal(got, expected("all_reduce", inputs, op)[g]):
                wrong.append(f"{op}/{algorithm} in group [1, 2, 3]")
    full = torch.arange(6.0) if env.rank == 3 else torch.zeros(6)
    if A.scatter(full, src=3, group=trio, algorithm="binomial").tolist() != [2.0 * g, 2.0 * g + 1]:
        wrong.append("scatter from global rank 3 (group rank 2)")
    avg = A.all_reduce(torch.full((4,), float(env.rank)), op="avg", group=trio, algorithm="ring")
    if avg.tolist() != [2.0] * 4:
        wrong.append(f"avg: {avg.tolist()}")
    return wrong


def test_ops_avg_and_a_subgroup():
    for wrong in run_on_ranks(_ops_and_group, 4):
        assert not wrong, wrong


def _large_world(env):
    inputs = inputs_for("all_reduce", env.world_size, 50, seed=3)
    return [torch.equal(A.all_reduce(inputs[env.rank].clone(), algorithm=a), expected("all_reduce", inputs)[env.rank])
            for a in A.ALGORITHMS["all_reduce"]]


def test_eight_ranks():
    """8 processes on 2 cores: every all_reduce algorithm, a power of two with three levels."""
    assert all(all(r) for r in run_on_ranks(_large_world, 8, timeout=120))


def _hierarchical_hosts(env):
    """hierarchical on real ranks: the hosts discovered (one machine: all host 0), and layouts
    imposed with hosts=[...] (ranks of a host apart, hosts of different sizes) against the
    closed form; a host list of another length refused on every rank, the group still usable."""
    n, r = env.world_size, env.rank
    inputs = inputs_for("all_reduce", n, 37, torch.int64, seed=5)
    want = expected("all_reduce", inputs)[r]
    wrong = [] if A.DistComm().hosts() == [0] * n else [f"hosts discovered: {A.DistComm().hosts()}"]
    for hosts in ([0, 1, 0, 1], [1, 1, 1, 0], [0, 2, 2, 5]):
        got = A.all_reduce(inputs[r].clone(), algorithm="hierarchical", hosts=hosts)
        if not torch.equal(got, want):
            wrong.append(f"hosts={hosts}: {got} != {want}")
    with pytest.raises(CollectiveError, match="must give a host index"):
        A.all_reduce(torch.ones(3), algorithm="hierarchical", hosts=[0, 1])
    if collectives.all_reduce(torch.ones(2)).tolist() != [4.0, 4.0]:
        wrong.append("the group was not usable after the refused call")
    return wrong


def test_hierarchical_with_hosts_discovered_and_imposed():
    for wrong in run_on_ranks(_hierarchical_hosts, 4):
        assert not wrong, wrong


def _settled_thread_count(quiet: float = 0.02, timeout: float = 5.0) -> int:
    """This process's threads once their count has held for `quiet` s: the groups of the test
    before this one on these ranks are destroyed as this one starts, and their threads end a
    moment later, on their own."""
    import time

    gc.collect()
    deadline = time.monotonic() + timeout
    last, since = len(os.listdir("/proc/self/task")), time.monotonic()
    while time.monotonic() < deadline and time.monotonic() - since < quiet:
        time.sleep(0.002)
        now = len(os.listdir("/proc/self/task"))
        if now != last:
            last, since = now, time.monotonic()
    return last


def _a_destroyed_group_is_gone(env):
    """Every algorithm (and the hosts it discovers) on a group, then destroy_process_group(group):
    nothing here may keep the group alive. A group kept past its destroy keeps Gloo's worker
    threads running into interpreter shutdown, where one that drops a tensor with a Python object
    aborts the process ("terminate called without an active exception"): the way a torchrun
    job's ranks died after printing their results, about 1 run in 30 under load."""
    n, r = env.world_size, env.rank
    threads = _settled_thread_count()
    group = collectives.new_group(list(range(n)))
    wrong = [] if A.DistComm(group).hosts() == [0] * n else ["hosts"]
    for checked in (False, True):  # every wrapper, in plain and in checked mode
        with collectives.checked(checked):
            t = torch.full((n,), float(r))
            collectives.all_reduce(t, group=group)
            collectives.all_reduce(t, group=group)  # the second call takes the fast path
            collectives.broadcast(t, src=0, group=group)
            collectives.reduce(t, dst=0, group=group)
            collectives.all_gather(t, group=group)
            collectives.gather(t, dst=0, group=group)
            collectives.reduce_scatter(t, group=group)
            collectives.scatter(t if r == 0 else None, src=0, group=group)
            collectives.all_to_all(t, group=group)
            collectives.barrier(group=group)
    for collective, algorithm in CASES:
        inputs = inputs_for(collective, n, 2 * n, torch.int64, seed=7)
        got = _flat_call(collective, algorithm, inputs[r], "sum", 0, group=group)
        want = expected(collective, inputs, "sum", 0)[r]
        if (want is None) != (got is None) or (want is not None and not torch.equal(got, want)):
            wrong.append(f"{collective}/{algorithm}")
    alive = weakref.ref(group)
    dist.destroy_process_group(group)
    del group
    gc.collect()
    if alive() is not None:
        wrong.append("the group outlived destroy_process_group: " + ", ".join(
            type(o).__name__ for o in gc.get_referrers(alive()) if o is not globals()))
    elif len(os.listdir("/proc/self/task")) != threads:  # the group's Gloo threads end with it
        wrong.append(f"threads: {threads} before the group, {len(os.listdir('/proc/self/task'))} after its destroy")
    return wrong


def test_nothing_keeps_a_destroyed_group_alive():
    for wrong in run_on_ranks(_a_destroyed_group_is_gone, 3):
        assert not wrong, wrong


def _bad_calls(env):
    with pytest.raises(CollectiveError, match="unknown algorithm 'spiral'; one of ring"):
        A.all_reduce(torch.ones(3), algorithm="spiral")
    with pytest.raises(CollectiveError, match="does not divide by the group size 2"):
        A.reduce_scatter(torch.ones(3), algorithm="ring")
    with pytest.raises(CollectiveError, match="'band' needs an integer"):
        A.all_reduce(torch.ones(3), op="band", algorithm="ring")
    t = torch.ones(2)
    collectives.all_reduce(t)  # the group is still usable
    return t.tolist()


def test_bad_calls_are_refused_before_anything_is_sent():
    assert run_on_ranks(_bad_calls, 2) == [[2.0, 2.0]] * 2


def _bytes_auto_chose_by(env):
    """The bytes "auto" weighed for each collective, called on 10 float64 elements per rank."""
    import collectives.algorithms as package

    seen = {}
    real = package.algorithm_for

    def recording(collective, algorithm, nbytes, world_size, model=None):
        seen[collective] = nbytes
        return real(collective, algorithm, nbytes, world_size, model)

    package.algorithm_for = recording
    try:
        for collective in A.ALGORITHMS:
            count = 10 * env.world_size if collective in ("reduce_scatter", "scatter", "all_to_all") else 10
            _flat_call(collective, "auto", torch.ones(count, dtype=torch.float64), "sum", 0)
    finally:
        package.algorithm_for = real
    return seen


def test_auto_weighs_the_bytes_the_collective_moves():
    """all_gather and gather move world_size times their input: auto chooses by that (a planted
    table without all_gather among the gathering kinds chose by the input's bytes, and no test
    saw it); the others by their input's."""
    n = 3
    seen = run_on_ranks(_bytes_auto_chose_by, n)[0]
    assert seen.keys() == A.ALGORITHMS.keys()
    for collective, nbytes in seen.items():
        per_rank = 10 * 8 * (n if collective in ("reduce_scatter", "scatter", "all_to_all") else 1)
        assert nbytes == per_rank * (n if collective in ("all_gather", "gather") else 1), (collective, nbytes)
