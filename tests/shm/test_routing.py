"""The shm backend's own gather, scatter, all_to_all (both forms), send/recv, batch_isend_irecv,
recv from any source, the coalesced calls and monitored_barrier: no Gloo under them (no inner
group exists), each checked against Gloo's result on the same ranks, every dtype and uneven
splits included, and against the closed forms torch.distributed's own tests expect.

    pytest tests/shm/test_routing.py -q
"""

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from collectives.errors import CollectiveMismatchError
from collectives.shm import backend_of, new_group_with
from collectives.testing import distributed, run_on_ranks
from ddp_from_scratch.parts.step_check import same_bits

from . import PATHS

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int8,
          torch.uint8, torch.bool, torch.complex64]
# what Gloo cannot carry at all (collectives/dtypes.py): shm moves their bytes; checked against the seeds only
BYTES_ONLY = [torch.int16, torch.uint16, torch.uint32, torch.uint64, torch.float8_e4m3fn, torch.float8_e5m2]


def _make(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g, dtype=torch.float64) * 50
    if dtype == torch.bool:
        return x > 0
    if dtype == torch.complex64:
        return torch.complex(x, -x).to(dtype)
    if dtype in (torch.uint16, torch.uint32, torch.uint64):
        return x.abs().to(torch.int64).to(dtype)
    return x.to(dtype)


def _calls(env, group, dtype, d):
    """gather, scatter and all_to_all (three ways) of seeded inputs on `group`: this rank's results."""
    r, n = env.rank, env.world_size
    got = {}
    x = _make((3, 2), dtype, seed=10 * r + d)
    gathered = [torch.empty_like(x) for _ in range(n)] if r == 1 else None
    dist.gather(x, gathered, dst=1, group=group)
    got["gather"] = gathered or []
    chunks = [_make((4,), dtype, seed=100 + q + d) for q in range(n)] if r == n - 1 else None
    mine = torch.empty(4, dtype=dtype)
    dist.scatter(mine, chunks, src=n - 1, group=group)
    got["scatter"] = [mine]
    # uneven splits, with empty parts: rank r sends (r + q) % 3 rows of 2 to rank q
    in_splits, out_splits = [(r + q) % 3 for q in range(n)], [(q + r) % 3 for q in range(n)]
    res = torch.empty((sum(out_splits), 2), dtype=dtype)
    dist.all_to_all_single(res, _make((sum(in_splits), 2), dtype, seed=200 + r + d), out_splits, in_splits,
                           group=group)
    even_out = torch.empty((2 * n, 3), dtype=dtype)
    dist.all_to_all_single(even_out, _make((2 * n, 3), dtype, seed=300 + r), group=group)
    outs = [torch.empty((2, 3), dtype=dtype) for q in range(n)]  # Gloo's list form: one size
    dist.all_to_all(outs, [_make((2, 3), dtype, seed=400 + r + q) for q in range(n)], group=group)
    got["all_to_all"] = [res, even_out, *outs]
    return got


def _expected(r, n, dtype, d):
    """The same calls worked out from the seeds: what rank r must hold."""
    uneven = []
    for q in range(n):
        splits = [(q + k) % 3 for k in range(n)]
        at = sum(splits[:r])
        uneven.append(_make((sum(splits), 2), dtype, seed=200 + q + d)[at:at + splits[r]])
    return {"gather": [_make((3, 2), dtype, seed=10 * q + d) for q in range(n)] if r == 1 else [],
            "scatter": [_make((4,), dtype, seed=100 + r + d)],
            "all_to_all": [torch.cat(uneven), torch.cat([_make((2 * n, 3), dtype, seed=300 + q)[2 * r:2 * r + 2]
                                                          for q in range(n)]),
                           *[_make((2, 3), dtype, seed=400 + q + r) for q in range(n)]]}


def _both(env):
    """Every routing call on shm and on Gloo (where Gloo carries the dtype), same inputs."""
    shm, gloo = dist.new_group(backend="shm"), dist.new_group(backend="gloo")
    rows = []
    for d, dtype in enumerate(DTYPES + BYTES_ONLY):
        on_shm = _calls(env, shm, dtype, d)
        gloo_can = dtype in DTYPES and not dtype.is_complex  # Gloo cannot gather complex
        on_gloo = _calls(env, gloo, dtype, d) if gloo_can else None
        want = _expected(env.rank, env.world_size, dtype, d)
        for key in on_shm:
            rows.append((str(dtype), key, [same_bits(a, b) for a, b in zip(on_shm[key], want[key])],
                         None if on_gloo is None else [same_bits(a, b) for a, b in zip(on_shm[key], on_gloo[key])]))
    return rows


@pytest.mark.parametrize("world_size", [2, 3])
def test_gather_scatter_all_to_all_equal_gloo_on_every_dtype(world_size):
    for rank, rows in enumerate(run_on_ranks(_both, world_size, timeout=120)):
        for dtype, call, as_expected, as_gloo in rows:
            assert all(as_expected), f"rank {rank}: {call} on {dtype}: not what the seeds give ({as_expected})"
            assert as_gloo is None or all(as_gloo), f"rank {rank}: {call} on {dtype}: not Gloo's result"


def _closed_forms(env):
    """torch's own test expectations (distributed_test.py), on shm."""
    r, n = env.rank, env.world_size
    group = dist.new_group(backend="shm")
    # gather: rank q sends ones * q; dst 0 gets them in rank order
    gathered = [torch.empty(10, 10) for _ in range(n)] if r == 0 else None
    dist.gather(torch.ones(10, 10) * r, gathered, dst=0, group=group)
    if r == 0:
        assert all(torch.equal(t, torch.ones(10, 10) * q) for q, t in enumerate(gathered))
    # scatter: src 0 holds ones * q for each q; rank q gets ones * q
    got = torch.empty(10, 10)
    dist.scatter(got, [torch.ones(10, 10) * q for q in range(n)] if r == 0 else None, src=0, group=group)
    assert torch.equal(got, torch.ones(10, 10) * r)
    # all_to_all_single, unequal split: in_splits [q + 1], out_splits [r + 1]
    in_splits, out_splits = [q + 1 for q in range(n)], [r + 1] * n
    res = torch.empty(sum(out_splits), n)
    dist.all_to_all_single(res, torch.ones(sum(in_splits), n) * r, out_splits, in_splits, group=group)
    assert torch.equal(res, torch.cat([torch.ones(r + 1, n) * q for q in range(n)]))
    # all_to_all (lists, of uneven sizes, which Gloo refuses): rank r's tensor q is ones(q + 1) * r;
    # it gets ones(r + 1) * q from rank q
    outs = [torch.empty(r + 1) for _ in range(n)]
    dist.all_to_all(outs, [torch.ones(q + 1) * r for q in range(n)], group=group)
    assert all(torch.equal(t, torch.ones(r + 1) * q) for q, t in enumerate(outs))
    # the coalesced calls: all_reduce of several tensors, all_gather of several, the functional ones
    a, b = torch.full((3,), float(r + 1)), torch.full((2, 2), float(10 * (r + 1)))
    dist.all_reduce_coalesced([a, b], group=group)
    total = n * (n + 1) / 2
    assert torch.equal(a, torch.full((3,), total)) and torch.equal(b, torch.full((2, 2), 10 * total))
    outs = [[torch.empty(2), torch.empty(1)] for _ in range(n)]
    dist.all_gather_coalesced(outs, [torch.full((2,), float(r)), torch.full((1,), float(-r))], group=group)
    assert all(torch.equal(o[0], torch.full((2,), float(q))) and torch.equal(o[1], torch.full((1,), float(-q)))
               for q, o in enumerate(outs))
    gathered = funcol.all_gather_into_tensor_coalesced([torch.full((2,), float(r)), torch.full((1,), r + 0.5)],
                                                       group)
    assert torch.equal(gathered[0].wait() if hasattr(gathered[0], "wait") else gathered[0],
                       torch.arange(n).float().repeat_interleave(2))
    scattered = funcol.reduce_scatter_tensor_coalesced([torch.arange(2.0 * n), torch.ones(n)], "sum", [0, 0], group)
    assert torch.equal(scattered[0], torch.tensor([2.0 * r, 2.0 * r + 1]) * n)
    assert torch.equal(scattered[1], torch.tensor([float(n)]))
    assert funcol.all_to_all_single(torch.arange(float(n)) + 10 * r, [1] * n, [1] * n, group).tolist() == \
        [10.0 * q + r for q in range(n)]
    return True


def test_torchs_closed_forms_hold_on_shm():
    assert run_on_ranks(_closed_forms, 3, timeout=120) == [True] * 3


def _messages(env):
    r, n = env.rank, env.world_size
    group = dist.new_group(backend="shm")
    big = 3_000_001  # 12 MB: many mailbox pieces, sent both ways at once around the ring
    nxt, prv = (r + 1) % n, (r - 1) % n
    send, recv = torch.arange(big, dtype=torch.float32) + r, torch.empty(big)
    ops = [dist.P2POp(dist.isend, send, nxt, group=group), dist.P2POp(dist.irecv, recv, prv, group=group)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    assert torch.equal(recv, torch.arange(big, dtype=torch.float32) + prv)
    # plain send/recv, every dtype, in posting order between a pair
    for dtype in DTYPES:
        if r == 0:
            for q in range(1, n):
                dist.send(_make((5,), dtype, seed=q), q, group=group)
                dist.send(_make((2,), dtype, seed=q + 50), q, group=group)
        else:
            first, second = torch.empty(5, dtype=dtype), torch.empty(2, dtype=dtype)
            dist.recv(first, 0, group=group)
            dist.recv(second, 0, group=group)
            assert torch.equal(first, _make((5,), dtype, seed=r)) and torch.equal(second, _make((2,), dtype, seed=r + 50))
    # recv from any source: rank 0 takes one message from each other rank, in whatever order
    if r == 0:
        sources = set()
        for _ in range(n - 1):
            t = torch.empty(1)
            src = dist.recv(t, group=group)
            assert t.item() == 100.0 + src
            sources.add(src)
        assert sources == set(range(1, n))
    else:
        dist.send(torch.tensor([100.0 + r]), 0, group=group)
    group.monitored_barrier(timedelta(seconds=30), True)  # every rank reached it: no error
    return True


def test_point_to_point_on_shm():
    assert run_on_ranks(_messages, 3, timeout=120) == [True] * 3


def _refused(env, path):
    """Wrong arguments: the rank that gave them raises naming them, the others raise naming the
    disagreement, nothing hangs, and the group works afterwards."""
    from collectives.shm import new_group_with

    r, n = env.rank, env.world_size
    group = new_group_with({"COLLECTIVES_SHM_PATH": path})
    said = []
    try:  # rank 0's gather_list is one tensor short
        dist.gather(torch.ones(2), [torch.empty(2)] * (n - 1) if r == 0 else None, dst=0, group=group)
    except Exception as exc:  # noqa: BLE001
        said.append(str(exc))
    try:  # rank 1 expects 3 rows from rank 0, which sends 2
        in_splits = [1] * n
        out_splits = [3 if (r == 1 and q == 0) else 1 for q in range(n)]
        dist.all_to_all_single(torch.empty(sum(out_splits)), torch.ones(n), out_splits, in_splits, group=group)
    except CollectiveMismatchError as exc:
        said.append(str(exc))
    try:  # rank 0's own input_split_sizes are one short: it refuses the call, and the others say so
        dist.all_to_all_single(torch.empty(n), torch.ones(n), None, [2] * (n - 1) if r == 0 else None, group=group)
    except Exception as exc:  # noqa: BLE001
        said.append(str(exc))
    t = torch.ones(3)
    dist.all_reduce(t, group=group)
    said.append(t.tolist())
    return said


@pytest.mark.parametrize("path", PATHS)
def test_wrong_routing_arguments_are_named_and_the_group_survives(path):
    for r, said in enumerate(run_on_ranks(_refused, 3, args=(path,), timeout=60)):
        assert len(said) == 4, said
        if r == 0:
            assert "gather on rank 0 of the shm group: gather_list has 2 tensors; it must have one per rank (3)" \
                in said[0], said[0]
        else:
            assert "rank 0: gather with arguments that rank refused" in said[0], said[0]
        assert f"all_to_all on rank {r} of the shm group" in said[1] and \
            "rank 0 sends 4 bytes to rank 1, which expects 12" in said[1], said[1]
        if r == 0:
            assert said[2] == ("all_to_all on rank 0 of the shm group: input_split_sizes has 2 entries; it must have "
                               "one per rank (3); nothing was moved"), said[2]
        else:  # it said "ranks 0, 1, 2: all_to_all", as if every rank agreed
            assert f"all_to_all on rank {r} of the shm group: the ranks called different collectives or disagree on " \
                "the arguments (rank 0: all_to_all with arguments that rank refused; ranks 1, 2: all_to_all)" \
                in said[2], said[2]
        assert said[3] == [3.0, 3.0, 3.0]


def _one_rank_late(env, wait_all):
    import time

    group = dist.new_group(backend="shm")
    if env.rank != 0:
        time.sleep(3)  # rank 0 waits for ranks 1 and 2, which come after its 1 s timeout
        return "late"
    try:
        group.monitored_barrier(timedelta(seconds=1), wait_all)
    except Exception as exc:  # noqa: BLE001
        return str(exc)
    return "passed"


@pytest.mark.slow
@pytest.mark.parametrize("wait_all", [False, True])
def test_monitored_barrier_names_the_ranks_that_did_not_come(wait_all):
    import collectives as C

    said = C.run(_one_rank_late, 3, backend="gloo", args=(wait_all,), timeout=60)[0]
    named = "ranks 1, 2" if wait_all else "rank 1"
    assert said.startswith(f"monitored_barrier on rank 0: {named} did not reach it within 1 s"), said


def test_no_inner_gloo_group_and_no_fallback_left():
    import inspect

    from collectives.shm import process_group

    source = inspect.getsource(process_group)
    assert "ProcessGroupGloo" not in source and "_fallback" not in source
    assert backend_of.__doc__


@distributed(world_size=3, backend="shm")
def test_a_receive_into_another_size_fails_naming_both_ranks_and_sizes(env):
    """Every message carries its length: a receive into a tensor of another size (smaller, larger,
    from an empty send, or a message of many mailbox pieces) raises naming both ranks and sizes,
    writes nothing into the tensor, and takes the whole message out, so the next one arrives
    intact; the group works afterwards. Without the length, the receive got the bytes of an
    earlier message or dropped some without a word."""
    big = 300_001  # 1.2 MB: several 256 KiB mailbox pieces, all taken out and dropped
    sends = [torch.full((6,), 50.0), torch.arange(1.0, 5.0), torch.arange(1.0, 9.0), torch.arange(float(big)),
             torch.full((3,), 7.0), torch.empty(0), torch.full((2,), 8.0)]
    sizes = [6, 6, 6, 5, 3, 3, 2]
    if env.rank == 0:
        for t in sends:
            dist.send(t, 1)
    elif env.rank == 1:
        for sent, n in zip(sends, sizes):
            into = torch.full((n,), -7.0)
            if sent.numel() == n:
                dist.recv(into, 0)
                assert torch.equal(into, sent)
                continue
            with pytest.raises(CollectiveMismatchError) as info:
                dist.recv(into, 0)
            assert str(info.value) == (f"recv on rank 1 of the shm group: rank 0 sent {4 * sent.numel()} bytes, and "
                                       f"this rank's tensor holds {4 * n} bytes; nothing was written into it (the "
                                       "message was taken out, so the next one arrives in order)")
            assert torch.equal(into, torch.full((n,), -7.0))
    t = torch.full((2,), float(env.rank))
    dist.all_reduce(t)
    assert t.tolist() == [3.0, 3.0]


@distributed(world_size=3, backend="shm")
def test_a_peer_outside_the_group_is_refused_and_the_messages_go_on(env):
    """send to / recv from a rank the group does not have is refused before anything moves (it
    killed the point-to-point thread, and the send hung to the run's timeout), and the thread
    serves the next messages."""
    from collectives.shm.protocol import ShmArgumentError

    if env.rank in (0, 2):
        for peer in (3, 7, -1):
            with pytest.raises(ShmArgumentError, match=rf"^send on rank {env.rank} of the shm group: rank {peer} "
                               r"is not in the group \(its ranks are 0 to 2\)$"):
                dist.send(torch.ones(2), peer)
        with pytest.raises(ShmArgumentError, match=r"recv on rank \d of the shm group: rank 5 is not in the group"):
            dist.recv(torch.empty(2), 5)
        dist.send(torch.full((2,), 10.0 + env.rank), 1)
    else:
        for src in (0, 2):
            into = torch.empty(2)
            dist.recv(into, src)
            assert into.tolist() == [10.0 + src] * 2


def _late_for_monitored_barrier(env, path):
    """Rank 1 comes to monitored_barrier only after ranks 0 and 2 have given up on it."""
    group = new_group_with({"COLLECTIVES_SHM_PATH": path})
    store = dist.distributed_c10d._get_default_store()
    said = []
    if env.rank == 1:
        store.wait([f"gave up {path} 0", f"gave up {path} 2"])  # per path: the pool's store outlives a test
    try:
        group.monitored_barrier(timedelta(seconds=0.5), False)
        said.append("passed")
    except Exception as exc:  # noqa: BLE001
        said.append(str(exc))
    if env.rank != 1:
        store.set(f"gave up {path} {env.rank}", "1")
    for k in range(3):
        t = torch.tensor([10.0 ** k * (env.rank + 1)])
        try:
            dist.all_reduce(t, group=group)
            said.append(t.item())
        except Exception as exc:  # noqa: BLE001
            said.append(str(exc))
    world = torch.ones(1)
    dist.all_reduce(world)  # another group is not broken
    said.append(world.item())
    return said


@pytest.mark.parametrize("path", PATHS)
def test_after_monitored_barrier_names_a_late_rank_every_rank_raises(path):
    """Once monitored_barrier has given up on a late rank the group is broken, as on Gloo: every
    later call raises on every rank, the late one included, naming it. Before, the late rank's
    calls met nobody's (the others were ahead) and returned sums of stale slots (102, 30, 300)."""
    said = run_on_ranks(_late_for_monitored_barrier, 3, backend="shm", args=(path,), timeout=120)
    broken = "rank 1 did not reach a collective within rank {}'s timeout, which gave up on it (a late rank breaks " \
             "the group, as on Gloo), so this call cannot run: the group is broken, make a new one"
    for r, (barrier, *reduces, world) in enumerate(said):
        if r == 1:
            assert barrier.startswith("monitored_barrier on rank 1: rank 1 did not reach a collective"), barrier
        else:
            assert barrier.startswith(f"monitored_barrier on rank {r}: rank 1 did not reach it within 0.5 s") or \
                barrier.startswith(f"monitored_barrier on rank {r}: rank 1 did not reach a collective"), barrier
        for text in reduces:
            assert isinstance(text, str) and text.startswith(f"all_reduce on rank {r}: ") and \
                any(broken.format(q) in text for q in (0, 2)), text
        assert world == 3.0
