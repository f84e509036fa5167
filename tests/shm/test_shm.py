"""The shared-memory backend: registered with torch.distributed, right on every collective (also
in many rounds through a tiny slot), no Gloo under any call, a dead peer named within the
timeout, a late rank named at it, a sleeping rank woken by the peer it waits for, every call
right across the counters' wrap past 2**31, nothing left in /dev/shm however the ranks end, and
torch's own DDP bitwise equal to torch's DDP on Gloo on 2 ranks.

The whole collectives suite runs on it too: test_collectives_suite_on_shm.py.

    pytest tests/shm -q
"""

import os
import re
import signal
import textwrap
import time
import warnings
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

import collectives as C
from collectives import shm
from collectives.launcher.pool import RankPool
from collectives.shm import backend_of
from collectives.shm.python_path import small_limit
from collectives.shm.segment import Segment
from collectives.testing import distributed, run_on_ranks

from ..algorithms.reference import expected, inputs_for
from . import PATHS
from ..collectives.test_launch import assert_all_gone, kill_launcher_script


@distributed(world_size=3, backend="shm")
def test_torch_distributed_calls_run_on_it(env):
    assert dist.get_backend() == "shm" and isinstance(backend_of(), shm.ShmBackend)
    r, n = env.rank, env.world_size
    for op, red in [(dist.ReduceOp.SUM, "sum"), (dist.ReduceOp.MAX, "max"), (dist.ReduceOp.MIN, "min"),
                    (dist.ReduceOp.PRODUCT, "product"), (dist.ReduceOp.BXOR, "bxor")]:
        inputs = inputs_for("all_reduce", n, 37, torch.int64, seed=5, op=red)
        t = inputs[r].clone()
        dist.all_reduce(t, op=op)
        assert torch.equal(t, expected("all_reduce", inputs, red)[r]), red
    avg = torch.full((5,), float(r))
    dist.all_reduce(avg, op=dist.ReduceOp.AVG)
    assert avg.tolist() == [1.0] * 5
    out = torch.empty(3 * 4)
    dist.all_gather_into_tensor(out, torch.full((4,), float(r)))
    assert out.tolist() == [q for q in (0.0, 1.0, 2.0) for _ in range(4)]
    chunk = torch.empty(2)
    dist.reduce_scatter_tensor(chunk, torch.arange(6.0) * (r + 1))
    assert chunk.tolist() == [6.0 * (2 * r), 6.0 * (2 * r + 1)]
    lists = [torch.empty(2) for _ in range(n)]
    dist.all_gather(lists, torch.full((2,), float(r)))
    assert [x.tolist() for x in lists] == [[q, q] for q in (0.0, 1.0, 2.0)]
    w = dist.all_reduce(torch.ones(4), async_op=True)
    w.wait()
    dist.barrier()


def _many_rounds(env):
    """COLLECTIVES_SHM_SLOT_MB is tiny: every collective goes through in many rounds."""
    r, n = env.rank, env.world_size
    wrong = []
    for numel in (1, 100, 1500, 3001):  # 1500 doubles: more than half a slot, less than SMALL_BYTES
        inputs = inputs_for("all_reduce", n, numel, torch.float64, seed=numel)
        t = inputs[r].clone()
        C.all_reduce(t)
        wrong += [] if torch.equal(t, expected("all_reduce", inputs)[r]) else [f"all_reduce {numel}"]
        t = inputs[r].clone()
        C.broadcast(t, src=n - 1)
        wrong += [] if torch.equal(t, inputs[n - 1]) else [f"broadcast {numel}"]
        t = inputs[r].clone()
        C.reduce(t, dst=1)
        wrong += [] if r != 1 or torch.equal(t, expected("all_reduce", inputs)[r]) else [f"reduce {numel}"]
        wrong += [] if torch.equal(C.all_gather(inputs[r]), torch.cat(inputs)) else [f"all_gather {numel}"]
        rs_in = inputs_for("reduce_scatter", n, numel * n, torch.int32, seed=numel)
        got = C.reduce_scatter(rs_in[r])
        wrong += [] if torch.equal(got, expected("reduce_scatter", rs_in)[r]) else [f"reduce_scatter {numel}"]
    return wrong


def test_buffers_larger_than_a_slot_go_through_in_rounds(monkeypatch):
    monkeypatch.setenv("COLLECTIVES_SHM_SLOT_MB", "0.002")  # 2 KB: 1 KB halves, 128 doubles a round
    for wrong in C.run(_many_rounds, 3, backend="shm", timeout=120):
        assert not wrong, wrong


def _reduce_in_pieces(env):
    """COLLECTIVES_SHM_PIECE_KB is tiny: step 3 adds every slice in many pieces, the last one short.
    Raw torch.distributed calls, so the backend itself sees each dtype (the wrappers widen uint16)."""
    r, n = env.rank, env.world_size
    ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN, "bor": dist.ReduceOp.BOR,
           "product": dist.ReduceOp.PRODUCT, "bxor": dist.ReduceOp.BXOR}
    wrong = []
    for numel, dtype, op in [(1001, torch.float64, "sum"), (777, torch.int32, "max"), (513, torch.int64, "product"),
                             (999, torch.uint8, "bxor"), (1234, torch.uint16, "sum"), (600, torch.bool, "bor"),
                             (640, torch.float32, "min")]:
        wide = dtype == torch.uint16  # no CPU add for it in torch: the expectation in int64, wrapped
        inputs = inputs_for("all_reduce", n, numel, torch.int64 if wide else dtype, seed=numel, op=op)
        want = expected("all_reduce", inputs, op)[0]
        if wide:
            inputs, want = [x.to(dtype) for x in inputs], (want % 65536).to(dtype)
        t = inputs[r].clone()
        dist.all_reduce(t, op=ops[op])
        wrong += [] if torch.equal(t, want) else [f"all_reduce {dtype} {op}"]
        t = inputs[r].clone()
        dist.reduce(t, dst=2, op=ops[op])
        wrong += [] if r != 2 or torch.equal(t, want) else [f"reduce {dtype} {op}"]
        chunk = torch.empty(numel // n, dtype=dtype)
        dist.reduce_scatter_tensor(chunk, torch.cat([inputs[r][:numel // n * n]]), op=ops[op])
        mine = want[:numel // n * n].view(n, -1)[r]
        wrong += [] if torch.equal(chunk, mine) else [f"reduce_scatter {dtype} {op}"]
    return wrong


def test_the_reduction_goes_through_in_pieces(monkeypatch):
    # 0.1 KB pieces: 12 doubles (the last piece of a slice short), and rounds of 1 KB halves as well
    monkeypatch.setenv("COLLECTIVES_SHM_PIECE_KB", "0.1")
    for wrong in C.run(_reduce_in_pieces, 3, backend="shm", timeout=120):
        assert not wrong, wrong
    monkeypatch.setenv("COLLECTIVES_SHM_SLOT_MB", "0.002")
    for wrong in C.run(_reduce_in_pieces, 3, backend="shm", timeout=120):
        assert not wrong, wrong


class _MemoryBytes(TorchDispatchMode):
    """Bytes the tensor ops read and write (each operand counted whole, as if nothing were in cache)."""

    def __init__(self):
        super().__init__()
        self.read = self.written = 0
        self.unknown = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        nbytes = [a.numel() * a.element_size() if isinstance(a, torch.Tensor) else 0 for a in args]
        if func is torch.ops.aten.copy_.default:  # reads src, writes self
            self.read, self.written = self.read + nbytes[1], self.written + nbytes[0]
        elif func is torch.ops.aten.add.out:  # reads both, writes out
            self.read += nbytes[0] + nbytes[1]
            self.written += kwargs["out"].numel() * kwargs["out"].element_size()
        elif func is torch.ops.aten.add_.Tensor:  # reads both, writes self
            self.read, self.written = self.read + nbytes[0] + nbytes[1], self.written + nbytes[0]
        elif not func.is_view:
            self.unknown.add(str(func))
        return result


def _count_all_reduce_bytes(env, numel):
    group = dist.new_group(backend="shm")
    backend_of(group).state.collectives.cma = None  # the copies through the segment: cross-memory attach moves its bytes in the kernel
    flat = torch.arange(numel, dtype=torch.float32) + env.rank
    with _MemoryBytes() as counted:
        backend_of(group).state.collectives.all_reduce(flat, "sum")
    assert torch.equal(flat, (torch.arange(numel, dtype=torch.float32) * env.world_size
                              + sum(range(env.world_size))))
    return counted.read + counted.written, counted.unknown


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_the_memory_traffic_model_counts_what_the_all_reduce_does(world_size, monkeypatch):
    """all_reduce_traffic(path="whole") is what the ops read and write, counted op by op (slices of
    24-48 KiB: the large path, one round, more than one piece each with 4 KiB pieces); in pieces
    the re-reads of a piece still in cache are not memory traffic, which op counts cannot see."""
    numel = 24 * 1024  # 96 KiB: past the small path on 2 ranks (64 KiB), whole slices at 2, 3 and 4 ranks
    monkeypatch.setenv("COLLECTIVES_SHM_PIECE_KB", "4")
    results = C.run(_count_all_reduce_bytes, world_size, backend="gloo", args=(numel,), timeout=60)
    for rank, (moved, unknown) in enumerate(results):
        assert not unknown, f"rank {rank}: ops the model does not count: {unknown}"
        assert moved == shm.python_path.all_reduce_traffic(numel * 4, world_size, "whole"), (rank, moved)
    paths = ("whole", "pieces", "cma")
    assert [shm.python_path.all_reduce_traffic(1.0, p, path) for p in (2, 4) for path in paths] == [4.5, 4.0, 2.0, 5.75, 4.5, 2.0]


def _routing_without_warnings(env):
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for _ in range(3):
            got = C.all_to_all(torch.tensor([10.0 * env.rank + j for j in range(env.world_size)]))
    said = [str(w.message) for w in seen if "shm backend" in str(w.message)]
    return got.tolist(), said


def test_all_to_all_runs_on_shm_itself():
    """No call goes to an inner Gloo group any more (tests/shm/test_routing.py checks each)."""
    results = C.run(_routing_without_warnings, 2, backend="shm", timeout=60)
    for r, (got, said) in enumerate(results):
        assert got == [float(r), 10.0 + r]
        assert said == [], said


def _one_rank_dies(env):
    C.all_reduce(torch.ones(4))
    if env.rank == 1:
        os._exit(3)
    C.all_reduce(torch.ones(4))  # ranks 0 and 2 wait here for rank 1, which is gone


@pytest.mark.parametrize("path", PATHS)
def test_a_dead_peer_is_named_not_waited_for(path, monkeypatch):
    monkeypatch.setenv("COLLECTIVES_SHM_PATH", path)
    pool = RankPool(3, backend="shm").start()  # started outside the timing: a loaded machine starts ranks slowly
    ranks = pool.pids
    start = time.monotonic()
    with pytest.raises(C.RankFailure) as info:
        pool.submit(_one_rank_dies, timeout=600)
    assert time.monotonic() - start < 300  # not the 600 s timeout (a few s here: the 3 s grace, the teardown)
    message = str(info.value)
    if path == "native":  # it records by default: the verdict leads, in collective terms, with no setting
        verdict, headline = message.splitlines()[:2]
        assert verdict.startswith("flight recorder: rank(s) [1] died (rank 1 exited with code 3); rank(s) [0, 2] "
                                  "last entered all_reduce(4 Float)"), message
    else:  # the Python path records only when TORCH_FR_BUFFER_SIZE is set
        headline = message.splitlines()[0]
    assert headline.startswith("rank 1 exited with code 3"), message
    assert (info.value.first, info.value.failed, info.value.stopped) == (1, [1], [0, 2]), message
    for r in (0, 2):  # each names rank 1: it saw the death itself, or the abort word the other left
        assert f"PeerFailure: all_reduce on rank {r}: rank 1 " in message, message
    assert shm.leftovers(ranks) == [], shm.leftovers(ranks)  # made by these ranks (other runs may be going on)


def _late_for_a_collective(env, path):
    """Ranks 0 and 2 give up on rank 1 at the group's 1 s timeout; rank 1 comes only after that.
    Each rank makes a small all_reduce (one barrier) and one in a round (two), and then one on the
    world group. What each call returned or raised, in that order."""
    dist.barrier()  # the ranks come to the group's making together: its 1 s is the setup's, not a slow start's
    group = shm.new_group_with({"COLLECTIVES_SHM_PATH": path}, timeout=timedelta(seconds=1))
    store = dist.distributed_c10d._get_default_store()
    gave_up = "gave up on a collective {} {}"  # per path: the pool's store outlives a test
    if env.rank == 1:
        store.wait([gave_up.format(path, 0), gave_up.format(path, 2)])
    said = []
    for numel in (2, 1 << 16):
        t = torch.full((numel,), float(env.rank + 1))
        try:
            dist.all_reduce(t, group=group)
            said.append(t[0].item())
        except Exception as exc:  # noqa: BLE001
            said.append(str(exc))
        if env.rank != 1 and numel == 2:
            store.set(gave_up.format(path, env.rank), "1")
    world = torch.ones(1)
    dist.all_reduce(world)  # another group is not broken
    return said + [world.item()]


@pytest.mark.parametrize("path", PATHS)
def test_a_rank_late_for_a_collective_is_named_at_the_timeout_and_raises_when_it_comes(path):
    """The ranks that wait name the late rank and the step at the group's timeout; the late rank,
    whose peers are ahead, never waits, and must still raise instead of running the collective
    alone: its small all_reduce (one barrier) would return a sum of the others' stale slots."""
    said = run_on_ranks(_late_for_a_collective, 3, backend="shm", args=(path,), timeout=120)
    broken = ("all_reduce on rank {r}: rank 1 did not reach a collective within rank {q}'s timeout, which gave up "
              "on it (a late rank breaks the group, as on Gloo), so this call cannot run: the group is broken, make a "
              "new one")
    for r, (small, in_a_round, world) in enumerate(said):
        assert world == 3.0, said
        if r == 1:
            for text in (small, in_a_round):
                assert any(broken.format(r=1, q=q) in str(text) for q in (0, 2)), said
            continue
        timed_out = re.compile(rf"all_reduce on rank {r}: rank 1 did not reach step \d+ within the 1 s timeout "
                               r"\(is it in another collective, or stuck\?\)")
        assert timed_out.search(str(small)) or any(broken.format(r=r, q=q) in str(small) for q in (0, 2)), said
        assert any(broken.format(r=r, q=q) in str(in_a_round) for q in (0, 2)), said


def _late_by_a_moment(env, path):
    """Rank 1 comes to each of three small all_reduces 0.3 s after rank 0, which spins, yields and
    then sleeps in the kernel on rank 1's word. This rank's sleeps during them, and how many a wake ended."""
    group = shm.new_group_with({"COLLECTIVES_SHM_PATH": path, "COLLECTIVES_SHM_WAIT": "futex"})
    before = backend_of(group).sleeps()
    for _ in range(3):
        if env.rank == 1:
            time.sleep(0.3)
        t = torch.full((2,), float(env.rank + 1))
        dist.all_reduce(t, group=group)
        assert t.tolist() == [3.0, 3.0]
    after = backend_of(group).sleeps()
    return {k: after[k] - before[k] for k in after}


@pytest.mark.parametrize("path", PATHS)
def test_a_rank_asleep_at_a_barrier_is_woken_by_the_peer_it_waits_for(path):
    """The rank that writes the word wakes the ranks asleep on it. Were the wake lost (the flag read
    before the word is seen, or not read at all), each sleep would end only at its 50 ms fault-check
    timeout: every call still right, each up to 50 ms late."""
    early, late = run_on_ranks(_late_by_a_moment, 2, backend="shm", args=(path,), timeout=120)
    assert early["slept"] >= 3, early  # 0.3 s at 50 ms a sleep: several per call
    assert early["woken"] >= 1, early  # nearly always 3: one per call
    assert late["woken"] <= late["slept"], late


def _across_the_wrap(env, path):
    """A group whose barrier counters start 8 steps, and whose mailbox counts 4 messages, below the
    int32 wrap (2**31), as they stand after hours of small calls: 8 small all_reduces that rank 1
    comes to 30 ms late (the wrap falls in one of them: the rank that is there first must still
    wait), then 8 rounds of a large all_reduce and a message from rank 0 to rank 1. What each left
    (rank q gives q + i to call i)."""
    original = Segment.create_or_attach.__func__

    def near_the_wrap(cls, store, rank, size, *args, **kwargs):
        seg = original(cls, store, rank, size, *args, **kwargs)
        seg.steps[rank] = 2 ** 31 - 8  # each rank writes only its own words
        for q in range(size):
            seg.mail_sent[rank * size + q] = seg.mail_taken[q * size + rank] = 2 ** 31 - 4
        return seg

    Segment.create_or_attach = classmethod(near_the_wrap)
    try:
        group = shm.new_group_with({"COLLECTIVES_SHM_PATH": path})
    finally:
        Segment.create_or_attach = classmethod(original)
    dist.barrier()  # every rank has set its words
    small, large, messages = [], [], []
    for i in range(8):
        if env.rank == 1:
            time.sleep(0.03)
        t = torch.full((2,), float(env.rank + i))
        dist.all_reduce(t, group=group)
        small.append(t.tolist())
    for i in range(8):
        t = torch.full((1 << 16,), float(env.rank + i))
        dist.all_reduce(t, group=group)
        large.append(sorted(set(t.tolist())))
        m = torch.full((3,), float(i)) if env.rank == 0 else torch.zeros(3)
        if env.rank == 0:
            dist.send(m, 1, group=group)
        elif env.rank == 1:
            dist.recv(m, 0, group=group)
            messages.append(m.tolist())
    return small, large, messages, backend_of(group).state.segment.steps.tolist()


def _group_near_the_wrap(settings, below):
    """An shm group (made with `settings`) whose barrier counters start `below` steps under 2**31."""
    original = Segment.create_or_attach.__func__

    def near_the_wrap(cls, store, rank, size, *args, **kwargs):
        seg = original(cls, store, rank, size, *args, **kwargs)
        seg.steps[rank] = 2 ** 31 - below  # each rank writes only its own word
        return seg

    Segment.create_or_attach = classmethod(near_the_wrap)
    try:
        return shm.new_group_with(settings)
    finally:
        Segment.create_or_attach = classmethod(original)


WRAP_KINDS = ("broadcast", "reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "gather", "scatter",
              "all_to_all_single", "barrier")


def _each_collective_across_the_wrap(env, path):
    """For each collective but all_reduce (the test above takes it across), small and large: a
    group whose counters start 4 steps below the wrap (the group's set-up takes 3), so the wrap
    falls in its first call, then 4 calls more; rank 1 comes to each 20 ms late. Large calls go in
    64 KiB rounds, several a call. What each call left, and the counters at the end."""
    r, p = env.rank, env.world_size
    left, steps = {}, {}
    for kind in WRAP_KINDS:
        for n in (2, 1 << 16):
            group = _group_near_the_wrap({"COLLECTIVES_SHM_PATH": path, "COLLECTIVES_SHM_ROUND_KB": "64"}, below=4)
            dist.barrier()  # every rank has set its words
            got = []
            for i in range(5):
                if r == 1:
                    time.sleep(0.02)
                root = i % p
                t = torch.full((n,), float(r + i))
                if kind == "broadcast":
                    dist.broadcast(t, src=root, group=group)
                elif kind == "reduce":
                    dist.reduce(t, dst=root, group=group)
                    t = t if r == root else None  # the other ranks' tensors are not defined by torch
                elif kind == "all_gather_into_tensor":
                    out = torch.empty(p * n)
                    dist.all_gather_into_tensor(out, t, group=group)
                    t = out
                elif kind == "gather":  # every rank's tensor on the root, one per rank
                    outs = [torch.empty(n) for _ in range(p)] if r == root else None
                    dist.gather(t, outs, dst=root, group=group)
                    t = torch.cat(outs) if outs is not None else None
                elif kind in ("scatter", "all_to_all_single"):  # chunk j of rank q is q + i + 10 j, to rank j
                    chunks = torch.cat([torch.full((n,), float(r + i + 10 * j)) for j in range(p)])
                    if kind == "scatter":
                        dist.scatter(t, list(chunks.chunk(p)) if r == root else None, src=root, group=group)
                    else:
                        t = torch.empty(p * n)
                        dist.all_to_all_single(t, chunks, group=group)
                elif kind == "reduce_scatter_tensor":
                    # chunk j of rank q is q + i + 10 j: rank r gets sum_q (q + i) + 10 r p
                    chunks = torch.cat([torch.full((n,), float(r + i + 10 * j)) for j in range(p)])
                    dist.reduce_scatter_tensor(t, chunks, group=group)
                else:
                    dist.barrier(group=group)
                    t = None
                by_rank = kind in ("all_gather_into_tensor", "gather", "all_to_all_single")  # a part per rank
                got.append(None if t is None else [sorted(set(t[q * n:(q + 1) * n].tolist())) for q in range(p)]
                           if by_rank else sorted(set(t.tolist())))
            left[kind, n] = got
            steps[kind, n] = backend_of(group).state.segment.steps.tolist()
            dist.destroy_process_group(group)
    return left, steps


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("path", PATHS)
def test_every_collective_crosses_the_counter_wrap_and_stays_right(path, world_size):
    """Broadcast, reduce, all_gather, reduce_scatter, gather, scatter, all_to_all and barrier wait
    on the same counters as all_reduce, but each through its own code (a root, a gather's slots, a
    scatter's pieces, all_to_all's count table and its regions, rounds):
    one of them comparing two steps as plain numbers would pass every test but this one."""
    p = world_size
    for r, (left, steps) in enumerate(run_on_ranks(_each_collective_across_the_wrap, p, backend="shm", args=(path,),
                                               timeout=120)):
        for (kind, n), got in left.items():
            want = []
            for i in range(5):
                root, total = i % p, p * i + p * (p - 1) / 2
                want.append({"broadcast": [float(root + i)],
                             "reduce": [total] if r == root else None,
                             "all_gather_into_tensor": [[float(q + i)] for q in range(p)],
                             "gather": [[float(q + i)] for q in range(p)] if r == root else None,
                             "scatter": [float(root + i + 10 * r)],
                             "all_to_all_single": [[float(q + i + 10 * r)] for q in range(p)],
                             "reduce_scatter_tensor": [total + 10.0 * r * p],
                             "barrier": None}[kind])
            assert got == want, (r, kind, n, got)
            assert all(s < 0 for s in steps[kind, n]), (r, kind, n, steps[kind, n])  # it did wrap


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("path", PATHS)
def test_the_counters_wrap_after_two_to_the_31_steps_and_every_call_stays_right(path, world_size):
    """The barrier counters and mailbox counts are int32 words in the segment, so a long job's
    wrap past 2**31 (a few hours of small calls back to back, days of DDP steps). Compared as
    plain numbers, a rank at the step after the wrap finds every peer ahead of it and waits for
    nobody: on the native path the rank there first ran ahead of the late one (a sum of stale slots,
    or its next call's words read as a mismatch); the Python path raised OverflowError storing 2**31."""
    p = world_size
    for r, (small, large, messages, steps) in enumerate(run_on_ranks(_across_the_wrap, p, backend="shm", args=(path,),
                                                                 timeout=120)):
        total = [p * i + p * (p - 1) / 2 for i in range(8)]  # rank q gives q + i
        assert small == [[t] * 2 for t in total], (r, small)
        assert large == [[t] for t in total], (r, large)
        assert messages == ([[float(i)] * 3 for i in range(8)] if r == 1 else []), (r, messages)
        assert all(s < 0 for s in steps), (r, steps)  # it did wrap


LAUNCHER = textwrap.dedent("""
    import os, sys, time, torch, collectives

    def work(env, pid_dir):
        collectives.all_reduce(torch.ones(8))
        with open(os.path.join(pid_dir, f"rank{env.rank}.pid"), "w") as f:
            f.write(str(os.getpid()))
        while True:
            collectives.all_reduce(torch.ones(1 << 16))

    if __name__ == "__main__":
        collectives.run(work, world_size=2, backend="shm", args=(sys.argv[1],))
""")


@pytest.mark.slow
@pytest.mark.parametrize("sig, path", [(signal.SIGKILL, "native"), (signal.SIGTERM, "native"),
                                       (signal.SIGKILL, "python")])
def test_nothing_is_left_in_dev_shm_when_everything_is_killed(sig, path, tmp_path, monkeypatch):
    monkeypatch.setenv("COLLECTIVES_SHM_PATH", path)
    below, _, _ = kill_launcher_script(LAUNCHER, sig, tmp_path)
    assert_all_gone(below)
    assert shm.leftovers(below) == [], shm.leftovers(below)  # made by the launcher's processes


def _ddp_on_both(env, model, steps, batch_size, image):
    from ddp_from_scratch.compare import train_side_by_side

    group = dist.new_group(backend="shm")
    return train_side_by_side(env, "torch", steps, model=model, batch_size=batch_size, image=image,
                              ours_kwargs={"process_group": group})


@pytest.mark.slow
def test_torchs_ddp_on_shm_is_bitwise_torchs_ddp_on_gloo_on_two_ranks():
    """ResNet-50, 2 steps: the two reduce a + b for every element, and a + b == b + a."""
    for rank, steps in enumerate(run_on_ranks(_ddp_on_both, 2, args=("resnet50", 2, 2, 32), timeout=300)):
        for step, check in enumerate(steps):
            assert check.bitwise, f"rank {rank}, step {step}: {check}"


def test_torchs_ddp_on_shm_on_four_ranks_differs_only_in_rounding():
    """On 4 ranks Gloo's ring adds in another order than shm's slices: the last bits differ."""
    largest = max(c.largest_diff for steps in run_on_ranks(_ddp_on_both, 4, args=("small", 3, 4, 12)) for c in steps)
    assert largest < 1e-5, largest


@distributed(world_size=3, backend="shm")
def test_the_algorithms_move_their_messages_through_the_mailboxes(env):
    """On an shm group the from-scratch algorithms use its mailboxes, not Gloo: no fallback is
    said, and messages far larger than a mailbox go through piece by piece (ring and recursive
    doubling both send and receive large messages at once: neither may wait for the other)."""
    import collectives.algorithms as A
    from collectives.algorithms.comm import comm_for
    from collectives.shm.transport import ShmComm

    assert isinstance(comm_for(), ShmComm)
    r, n = env.rank, env.world_size
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for algorithm in A.ALGORITHMS["all_reduce"]:
            inputs = inputs_for("all_reduce", n, 300_001, torch.int64, seed=1)  # 2.4 MB: ~10 mailbox pieces a message
            got = A.all_reduce(inputs[r].clone(), algorithm=algorithm)
            assert torch.equal(got, expected("all_reduce", inputs)[r]), algorithm
        got = A.all_to_all(torch.arange(3.0) + 10 * r, algorithm="bruck")
        assert got.tolist() == [10.0 * q + r for q in range(n)]
    assert not [w for w in seen if "shm backend" in str(w.message)]


def _disagreeing_call(case, rank):
    """Rank `rank`'s side of a call that the ranks disagree on (raw torch.distributed: no wrapper checks)."""
    if case == "count":
        return lambda: dist.all_reduce(torch.ones(3 + (rank == 2)))
    if case == "count, many rounds":  # larger than the test's 64 KiB slot: the ranks would loop differently
        return lambda: dist.all_reduce(torch.ones(40_000 + rank))
    if case == "dtype":
        return lambda: dist.all_reduce(torch.ones(3, dtype=torch.float64 if rank == 1 else torch.float32))
    if case == "op":
        return lambda: dist.all_reduce(torch.ones(3), op=dist.ReduceOp.MAX if rank == 0 else dist.ReduceOp.SUM)
    if case == "root":
        return lambda: dist.broadcast(torch.ones(3), src=rank % 2)
    return [lambda: dist.broadcast(torch.ones(3), src=0), lambda: dist.all_reduce(torch.ones(3)), dist.barrier][rank]


CALLS = {"count": ["ranks 0, 1: all_reduce of 3 float32 (sum)", "rank 2: all_reduce of 4 float32 (sum)"],
         "count, many rounds": ["rank 0: all_reduce of 40000 float32 (sum)", "rank 2: all_reduce of 40002 float32"],
         "dtype": ["ranks 0, 2: all_reduce of 3 float32 (sum)", "rank 1: all_reduce of 3 float64 (sum)"],
         "op": ["rank 0: all_reduce of 3 float32 (max)", "ranks 1, 2: all_reduce of 3 float32 (sum)"],
         "root": ["ranks 0, 2: broadcast of 3 float32 from rank 0", "rank 1: broadcast of 3 float32 from rank 1"],
         "collective": ["rank 0: broadcast of 3 float32 from rank 0", "rank 1: all_reduce of 3 float32 (sum)",
                        "rank 2: barrier"]}


def _every_disagreement_is_named(env):
    said = {}
    for case in CALLS:
        with pytest.raises(C.CollectiveMismatchError) as info:
            _disagreeing_call(case, env.rank)()
        said[case] = str(info.value)
        t = torch.full((5,), float(env.rank))  # and the group still works, every time
        dist.all_reduce(t)
        assert t.tolist() == [3.0] * 5, (case, t)
    return said


@pytest.mark.parametrize("path", PATHS)
def test_ranks_that_disagree_all_get_a_named_error_and_the_group_stays_usable(path, monkeypatch):
    """Gloo aborts (size, dtype) or hangs (op) here; shared memory would read past the shorter
    tensor or add a float64's bytes as float32s: a silent wrong answer. Each case on 3 ranks."""
    monkeypatch.setenv("COLLECTIVES_SHM_PATH", path)
    monkeypatch.setenv("COLLECTIVES_SHM_SLOT_MB", str(64 / 1024))  # 64 KiB: many rounds for 160 KB
    for rank, said in enumerate(C.run(_every_disagreement_is_named, 3, backend="shm", timeout=120)):
        for case, message in said.items():
            assert f"on rank {rank} of the shm group" in message, message
            for call in CALLS[case]:
                assert call in message, (case, call, message)


def test_the_control_words_fit_the_control_area():
    """Every per-rank and per-pair counter region lies inside the control area (an overflow once
    left the sleeping flags an empty array)."""
    from collectives.shm import segment as s

    regions = [(s.STEP0, 4096), (s.PID0, 4096), (s.MAIL_SENT0, s.MAX_MAIL_RANKS ** 2),
               (s.MAIL_TAKEN0, s.MAX_MAIL_RANKS ** 2), (s.SLEEP0, 4096),
               (s.CALL0, 2 * 4096 * s.CALL_WORDS), (s.ADDR0, 2 * 4096), (s.WRITING0, 4096), (s.CMA_OK0, 4096)]
    ends = sorted((start, start + size) for start, size in regions)
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(ends, ends[1:]))
    assert ends[-1][1] <= s.CONTROL_BYTES // 4 and ends[0][0] > max(s.ABORT, s.ABORT_SEEN_BY)
    assert s.ADDR0 % 2 == 0, "the addresses are int64: their first word must be 8-byte aligned"


def test_a_full_dev_shm_is_a_clear_error_not_a_sigbus(monkeypatch):
    """tmpfs hands out pages only when touched: without this check a rank would die of SIGBUS
    in the middle of a collective on a small /dev/shm (Docker's default is 64 MB)."""
    from collectives.shm import segment as s

    class Tiny:
        f_bavail, f_frsize = 1000, 4096  # 4 MB free

    monkeypatch.setattr(s.os, "statvfs", lambda path: Tiny())
    with pytest.raises(MemoryError, match=r"needs \d+ MiB in /dev/shm for 2 ranks, and only 3 MiB is free there: "
                                          r"the data slots \(2 x 64.0 MiB\) take 128.0 MiB of it, so set "
                                          r"COLLECTIVES_SHM_SLOT_MB lower"):
        s.Segment.create_or_attach(dist.HashStore(), 0, 2, 64 << 20)
    assert shm.leftovers() == [] or all(not n.startswith(f"{s.PREFIX}-{os.getpid()}-") for n in shm.leftovers())


def _small_all_reduce_bits(env):
    """Random floats (sums that round), sizes on the small path (up to small_limit): every rank's
    result as raw bits, gathered, for every op."""
    out = {}
    largest = small_limit(env.world_size) // 4
    assert backend_of().state.collectives.all_reduce_path(4 * largest) == "small"
    assert backend_of().state.collectives.all_reduce_path(4 * largest + 4) != "small"
    for numel in (1, 7, 1000, 4000, largest):  # float32: 16000 bytes, and the small path's largest
        for op in ("sum", "avg", "max", "min", "product"):
            g = torch.Generator().manual_seed(1000 * numel + env.rank)
            t = torch.rand(numel, generator=g) + 0.5
            C.all_reduce(t, op=op)
            everyone = C.all_gather(t.view(torch.int32).view(1, -1))  # (world_size, numel) bits
            out[(numel, op)] = all(torch.equal(everyone[0], row) for row in everyone)
    return out


@pytest.mark.parametrize("world_size", [3, 4])
def test_a_small_all_reduce_leaves_the_same_bits_on_every_rank(world_size):
    """On the small path every rank adds every slot itself: only one fixed order (rank 0's slot
    first) gives every rank the same bits at 3 and more ranks; adding its own value first would not."""
    for rank, same in enumerate(C.run(_small_all_reduce_bits, world_size=world_size, backend="shm")):
        assert all(same.values()), (rank, [k for k, v in same.items() if not v])
