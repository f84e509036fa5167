"""The native path's wait reads the machine, not the rank count (native_wait.h): a waiting rank
stops spinning once more threads want the ranks' cores than there are, so the rank it waits for
gets a core instead of queueing behind the spinner.

Both ranks pinned to one CPU: the rank that arrives first would spin its whole millisecond while
the other cannot run. The wait must cut that spin short, in most of the waits that spin. The
cores it counts are the CPUs the ranks may run on between them, not the cores online: counting
those, ranks pinned to fewer cores than the machine has spun on beside a busy process and lost to
Gloo (benchmarks/RESULTS.md, "Which backend for my sizes?", the 16-core Xeon). The counts are the engine's own (`spins`:
waits that spun, and those the machine reading cut short), so this is no timed test.

    pytest tests/shm/test_wait_reads_machine.py -q
"""

from __future__ import annotations

import mmap
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from collectives.shm import backend_of, new_group_with
from collectives.shm.segment import CONTROL_BYTES, Segment
from collectives.shm.wait import PeerFailure, Waiter
from collectives.testing import run_on_ranks

CALLS = 200


def _pinned(env, cpu):
    """Pin this rank's thread to `cpu` while its group is made and used (the group's worker
    thread, made then, stays there); the engine's spin counts and whether every result was right."""
    saved = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {cpu})
    try:
        group = new_group_with({"COLLECTIVES_SHM_PATH": "native"})
        right = True
        t = torch.empty(2)
        for _ in range(CALLS):
            t.fill_(env.rank + 1)
            dist.all_reduce(t, group=group)
            right &= bool(torch.equal(t, torch.full((2,), env.world_size * (env.world_size + 1) / 2)))
        spins = backend_of(group).spins()
        return spins["cores"], (spins["spun"], spins["cut"]), right
    finally:
        os.sched_setaffinity(0, saved)


def test_ranks_pinned_to_one_cpu_cut_their_spins_short():
    cpu = min(os.sched_getaffinity(0))
    got = run_on_ranks(_pinned, 2, args=(cpu,), backend="gloo")
    for rank, (cores, (spun, cut), right) in enumerate(got):
        assert right, f"rank {rank}: a wrong all_reduce result"
        assert cores == 1, f"rank {rank}: the wait counts {cores} cores for ranks pinned to one"
    spun = sum(s for _, (s, _), _ in got)
    cut = sum(c for _, (_, c), _ in got)
    # one of the two waits at almost every call (the one that came first); a wait the scheduler
    # ended by preempting the spinner before the reading (60 us) does not count as cut
    assert spun >= CALLS // 4, got
    assert cut >= spun // 2, f"of {spun} waits that spun, the machine reading cut {cut} short: {got}"


def _own_cores_peer_running(env, loadavg, proc):
    """Each rank on a CPU of its own, the machine reading held still at one runnable thread (a
    file of the test's own where /proc/loadavg is read) and each rank's run delay held still too
    (`proc`/<pid>/schedstat, files of the test's own where /proc/<pid>/schedstat is read): rank 1
    computes for about 200 us before each call while rank 0 waits for it, and nothing the wait
    reads says that anyone waited for a core. The engine's spin counts, and whether every result
    was right."""
    import time

    from collectives.shm import native_setup

    os.makedirs(os.path.join(proc, str(os.getpid())), exist_ok=True)
    with open(os.path.join(proc, str(os.getpid()), "schedstat"), "w") as f:
        f.write("123456789 5000 42\n")  # run time, run delay (ns), time slices: never changing
    dist.barrier()
    saved = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {sorted(saved)[env.rank]})
    real = native_setup.setup
    native_setup.setup = lambda state: {**real(state), "loadavg": loadavg, "proc": proc}
    try:
        group = new_group_with({"COLLECTIVES_SHM_PATH": "native"})
    finally:
        native_setup.setup = real
    try:
        right, t = True, torch.empty(2)
        for _ in range(CALLS):
            if env.rank == 1:
                end = time.perf_counter() + 200e-6
                while time.perf_counter() < end:
                    pass
            t.fill_(1.0)
            dist.all_reduce(t, group=group)
            right &= bool(torch.equal(t, torch.full((2,), 2.0)))
        spins = backend_of(group).spins()
        return spins["spun"], spins["cut"], right
    finally:
        os.sched_setaffinity(0, saved)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs a core for each rank")
def test_a_wait_for_a_peer_whose_run_delay_holds_still_keeps_its_spin(tmp_path):
    """The converse of the test above: a spin is cut only when the peer's run delay grew (it
    waited for a core) or the machine is full, never because the delay stayed the same. With the
    machine reading and every run delay held still, no wait may cut its spin, however busy the
    machine really is: a wait that cut whenever the delay had not changed cut almost all of them
    and left every result right (only the speed changed)."""
    loadavg = tmp_path / "loadavg"
    loadavg.write_text("0.00 0.00 0.00 1/100 1\n")
    proc = tmp_path / "proc"
    proc.mkdir()
    got = run_on_ranks(_own_cores_peer_running, 2, args=(str(loadavg), str(proc)), backend="gloo")
    assert all(right for _, _, right in got), got
    spun, cut = got[0][0], got[0][1]  # rank 0 waits for rank 1 at almost every call
    assert spun >= CALLS // 4, got
    assert cut == 0 and got[1][1] == 0, f"with nothing read changing, waits cut their spins: {got}"


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="the Python path spins only where the ranks have a core each")
def test_the_python_wait_stops_spinning_when_more_threads_than_the_ranks_cores_are_runnable():
    """wait.py's Waiter, rank 0 of a 2-rank segment whose rank 1 never comes, counting 1 core for
    the ranks: with a busy process beside it, 2 threads want that core, so the spin is cut short
    (then it yields, sleeps, and names rank 1 at its timeout). The cut takes 3 readings 20 us
    apart within the 1 ms spin: on a loaded machine the scheduler may hold the waiting thread off
    its core for that whole millisecond, so up to 5 waits are tried; with the reading off, none is
    cut."""
    busy = subprocess.Popen([sys.executable, "-c", "print('busy', flush=True)\nwhile True: pass"],
                            stdout=subprocess.PIPE, text=True)
    tries = []
    try:
        assert busy.stdout.readline() == "busy\n"  # in its loop before the wait starts, not still starting
        while len(tries) < 5 and not (tries and tries[-1][1]):
            segment = Segment(mmap.mmap(-1, CONTROL_BYTES + 2 * 128 + 4 * 64), 2, 128, mailbox_bytes=64)
            waiter = Waiter(segment, 0, strategy="futex", timeout_s=0.3, cores=1)
            waiter.what = "all_reduce"
            with pytest.raises(PeerFailure, match="rank 1 did not reach step 1"):
                waiter.barrier()
            tries.append((waiter.spun, waiter.spins_cut, waiter.machine_cores))
    finally:
        busy.kill()
        busy.wait()
    assert all(spun == 1 and cores == 1 for spun, _, cores in tries), tries
    assert tries[-1][1] == 1, f"no spin was cut short in {len(tries)} waits: {tries}"
