"""collectives.run: results in rank order; a rank that raises, dies, aborts or hangs gives one
RankFailure that leads with that rank (not with the ranks stopped because of it), with its
traceback, exit code, signal (and where it was when a fatal signal hit it) or Python stack; no rank process, and nothing a rank started, is
left behind, even when the launcher itself is killed. Each case spawns ranks (~3 s), so the
grid is small.

    pytest tests/collectives/test_launch.py -q
"""

import atexit
import ctypes
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import socket
import tempfile
import textwrap
import threading
import time

import pytest
import torch
import torch.distributed as dist

import collectives as C
from collectives.machine import descendants


def _who(env, k):
    t = torch.tensor([env.rank + 1.0])
    dist.all_reduce(t)
    return env.rank, env.world_size, env.backend, str(env.device), torch.get_num_threads(), t.item() * k


@pytest.mark.parametrize("start_method", ["forkserver", pytest.param("spawn", marks=pytest.mark.slow)])  # spawn: seconds a rank
def test_results_come_back_in_rank_order(start_method):
    assert C.run(_who, world_size=3, args=(2,), start_method=start_method) == [
        (r, 3, "gloo", "cpu", 1, 12.0) for r in range(3)]


SLOW_IMPORT = textwrap.dedent("""
    import time
    time.sleep(1.5)  # a heavy import, as a test file importing pytest on a busy machine


    def rank_of(env):
        return env.rank
""")


@pytest.mark.parametrize("start_method", ["forkserver", pytest.param("spawn", marks=pytest.mark.slow)])  # spawn: seconds a rank
def test_the_timeout_starts_once_every_rank_has_imported_the_functions_module(start_method, tmp_path, monkeypatch):
    """A rank imports the function's module when it unpickles the call; that is not the call: a
    module that takes 1.5 s to import still runs a call whose timeout is 1 s."""
    (tmp_path / "slow_to_import.py").write_text(SLOW_IMPORT)
    monkeypatch.syspath_prepend(str(tmp_path))
    import slow_to_import

    try:
        assert C.run(slow_to_import.rank_of, world_size=2, timeout=1, start_method=start_method) == [0, 1]
    finally:
        sys.modules.pop("slow_to_import", None)


IMPORTED_WITH = os.environ.get("COLLECTIVES_TEST_SET_LATE")  # read as a rank imports this module


def _as_a_spawned_rank_sees_it(env):
    import tempfile

    import numpy as np

    print(f"rank {env.rank} to stdout", flush=True)
    print(f"rank {env.rank} to stderr", file=sys.stderr, flush=True)
    return IMPORTED_WITH, os.environ.get("COLLECTIVES_TEST_SET_LATE"), tempfile.gettempdir(), int(np.random.randint(1 << 30))


@pytest.mark.parametrize("start_method", ["forkserver", pytest.param("spawn", marks=pytest.mark.slow)])  # spawn: seconds a rank
def test_a_rank_starts_with_the_launchers_environment_and_output_as_they_are_now(start_method, monkeypatch, tmp_path):
    """A forked rank would have the fork server's environment and output, from when the server
    started (before the changes below): the variable set now, seen at import and after; the
    temporary folder from TMPDIR now; output where this process's stdout and stderr go now;
    numpy's global random state drawn afresh in each rank, as in a fresh interpreter."""
    C.run(_who, world_size=1, args=(1,), start_method=start_method)  # the server is up before the changes
    monkeypatch.setenv("COLLECTIVES_TEST_SET_LATE", "now")
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    saved = os.dup(1), os.dup(2)
    files = [open(tmp_path / name, "wb") for name in ("out", "err")]
    try:
        for fd, f in zip((1, 2), files):
            os.dup2(f.fileno(), fd)
        got = C.run(_as_a_spawned_rank_sees_it, world_size=2, start_method=start_method)
    finally:
        for fd, old in zip((1, 2), saved):
            os.dup2(old, fd)
            os.close(old)
        for f in files:
            f.close()
    assert [g[:3] for g in got] == [("now", "now", str(tmp_path))] * 2, got
    assert got[0][3] != got[1][3], "both ranks drew the same numpy random numbers"
    out, err = (tmp_path / "out").read_text(), (tmp_path / "err").read_text()
    assert "rank 0 to stdout" in out and "rank 1 to stdout" in out, out
    assert "rank 0 to stderr" in err and "rank 1 to stderr" in err, err


def test_a_start_method_that_does_not_exist_is_refused(monkeypatch):
    with pytest.raises(ValueError, match="start_method must be one of forkserver, spawn, got 'fork'"):
        C.run(_who, world_size=1, args=(1,), start_method="fork")
    monkeypatch.setenv("COLLECTIVES_START_METHOD", "thread")
    with pytest.raises(ValueError, match="COLLECTIVES_START_METHOD must be one of forkserver, spawn, got 'thread'"):
        C.run(_who, world_size=1, args=(1,))


def _fail(env, how, pid_dir):
    # each rank starts a child of its own: the launcher must stop it too
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    (pid_dir / f"rank{env.rank}.pid").write_text(f"{os.getpid()} {child.pid}")
    if env.rank == 1:
        if how == "raise":
            raise ValueError("planted failure on rank 1")
        if how == "exit":
            os._exit(7)
        if how == "segfault":  # what a crash inside a C++ extension looks like
            ctypes.string_at(0)
        if how == "abort":  # what Gloo does on a size mismatch
            t = torch.ones(3)
            dist.all_reduce(t)
    if how == "abort" and env.rank == 0:
        dist.all_reduce(torch.ones(5))  # the size mismatch: raw Gloo aborts
    if how == "hang" and env.rank == 1:
        time.sleep(600)
    dist.all_reduce(torch.ones(1))  # rank 0 waits here for a rank 1 that never comes
    time.sleep(600)


def _running(pid: int) -> bool:
    """Alive and not a zombie (a killed process whose parent has not reaped it yet counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def assert_all_gone(pids, within: float = 10.0):
    deadline = time.monotonic() + within
    while time.monotonic() < deadline and any(_running(p) for p in pids):
        time.sleep(0.1)
    assert not [p for p in pids if _running(p)], f"left running: {[p for p in pids if _running(p)]} of {pids}"


def _pids_in(pid_dir):
    pids = [int(x) for p in pid_dir.glob("*.pid") for x in p.read_text().split()]
    assert pids, "the ranks never started"
    return pids


@pytest.mark.slow
@pytest.mark.parametrize(
    "how, headline, fragments",
    [
        ("raise", "rank 1 raised ValueError: planted failure on rank 1\n",
         ["stopped because of it: rank(s) [0]", "rank 0 was still running 3 s after rank 1 failed",  # the failed rank
          "waiting in all_reduce", "in _fail"]),
        ("exit", "rank 1 exited with code 7", ["stopped because of it: rank(s) [0]"]),
        ("abort", "died from SIGABRT in all_reduce (called from test_launch.py:", ["its Python stack"]),
        ("segfault", "rank 1 died from SIGSEGV in string_at (", [
            "its Python stack", "in _fail", "stopped because of it: rank(s) [0]"]),
        ("hang", "rank 1 did not finish within the 2 s timeout: in _fail (test_launch.py:", [
            "stopped because of it: rank(s) [0]", "rank 0 did not finish within the 2 s timeout: waiting in all_reduce",
            "its Python stack", "in _fail"]),
    ],
)
def test_a_failing_rank_is_named_first_and_nothing_is_left_behind(how, headline, fragments, tmp_path):
    start = time.monotonic()
    with pytest.raises(C.RankFailure) as info:
        C.run(_fail, world_size=2, args=(how, tmp_path), timeout=2 if how == "hang" else 600)
    message = str(info.value)
    assert message.startswith(headline) or (how == "abort" and headline in message.splitlines()[0]), message
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} missing from:\n{message}"
    if how != "abort":  # which rank Gloo's abort hits first is up to Gloo
        assert (info.value.first, info.value.failed, info.value.stopped) == (1, [1], [0])
    assert info.value.ranks == [0, 1]
    # ~2-6 s here (the 2 s hang timeout, the 3 s grace, stacks); the other cases' timeout is 600 s,
    # so the bound tells a prompt report from a wait for the timeout however loaded the machine is
    assert time.monotonic() - start < 300
    assert_all_gone(_pids_in(tmp_path))


def _segfault_in_a_thread(env):
    if env.rank == 1:
        worker = threading.Thread(target=ctypes.string_at, args=(0,), name="worker")
        worker.start()
        worker.join()
    time.sleep(600)


@pytest.mark.slow
def test_a_crash_in_another_thread_is_placed_in_that_thread():
    """The summary names where the signal hit (faulthandler's current thread), not where the main
    thread was waiting for it."""
    with pytest.raises(C.RankFailure) as info:
        C.run(_segfault_in_a_thread, world_size=2, timeout=60)
    headline = str(info.value).splitlines()[0]
    assert headline.startswith("rank 1 died from SIGSEGV in string_at ("), str(info.value)


def _peer_lost_reported_before_the_death(env):
    if env.rank == 0:  # what Gloo raises on the rank whose peer died, here reported first
        raise RuntimeError("[gloo] Connection closed by peer [127.0.0.1]:12345")
    time.sleep(0.5)
    os.abort()


def test_the_rank_that_died_leads_even_when_its_peers_lost_connection_reports_first():
    """Gloo's abort kills one rank; its peer's "Connection closed by peer" can reach the launcher
    first (once seen under load): the dead rank is still named first, the other as stopped by it."""
    with pytest.raises(C.RankFailure) as info:
        C.run(_peer_lost_reported_before_the_death, world_size=2, timeout=60)
    assert str(info.value).startswith("rank 1 died from SIGABRT"), str(info.value)
    assert (info.value.first, info.value.failed, info.value.stopped) == (1, [1], [0])


LAUNCHER = textwrap.dedent("""
    import os, subprocess, sys, time
    import collectives

    def work(env, pid_dir):
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        with open(os.path.join(pid_dir, f"rank{env.rank}.pid"), "w") as f:
            f.write(f"{os.getpid()} {child.pid}")
        time.sleep(600)

    if __name__ == "__main__":
        collectives.run(work, world_size=2, args=(sys.argv[1],))
""")


def start_and_kill(argv, sig, ready, tmp_path, env=None):
    """Start a launcher, wait until `ready()`, note every process below it, kill it with `sig`;
    return those processes' pids."""
    tmp = tmp_path / "tmp"
    tmp.mkdir(exist_ok=True)
    # TMPDIR through a short link: under xdist tmp_path is long enough that the fork server's socket
    # (TMPDIR/pymp-XXXXXXXX/listener-XXXXXXXX) would pass a Unix socket's 107 bytes
    link = tempfile.mktemp(prefix="cp-", dir="/tmp")
    os.symlink(tmp, link)
    atexit.register(os.unlink, link)
    stderr = tmp_path / "launcher-stderr.txt"
    with open(stderr, "wb") as err:
        proc = subprocess.Popen(argv, env={**os.environ, "TMPDIR": link, **(env or {})},
                                stdout=subprocess.DEVNULL, stderr=err)
    deadline = time.monotonic() + 120
    while not ready() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.2)
    assert proc.poll() is None and ready(), f"the launcher did not get going: {stderr.read_text()[-2000:]}"
    below = descendants(proc.pid)
    os.kill(proc.pid, sig)
    proc.wait(30)
    return below, tmp


def kill_launcher_script(source: str, sig, tmp_path, ranks: int = 2, env=None):
    """Run `source` as `python launcher.py PID_DIR`; once each of its `ranks` ranks has written
    PID_DIR/rankN.pid, kill the launcher with `sig`. Returns (the processes below it, pid_dir, tmp)."""
    script = tmp_path / "launcher.py"
    script.write_text(source)
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()

    def ready():
        files = list(pid_dir.glob("*.pid"))
        return len(files) == ranks and all(p.read_text() for p in files)

    below, tmp = start_and_kill([sys.executable, str(script), str(pid_dir)], sig, ready, tmp_path, env=env)
    return below, pid_dir, tmp


@pytest.mark.slow
@pytest.mark.parametrize("sig, start_method", [(signal.SIGKILL, "forkserver"), (signal.SIGTERM, "forkserver"),
                                               (signal.SIGKILL, "spawn")])
def test_ranks_die_with_a_killed_launcher(sig, start_method, tmp_path):
    below, pid_dir, tmp = kill_launcher_script(LAUNCHER, sig, tmp_path, env={"COLLECTIVES_START_METHOD": start_method})
    ranks_and_children = _pids_in(pid_dir)
    assert set(ranks_and_children) <= set(below)
    assert len(below) >= 5  # 2 ranks, their 2 children, multiprocessing's resource tracker
    assert_all_gone(below)
    assert not [p.name for p in tmp.iterdir() if p.name.startswith("collectives")], list(tmp.iterdir())


DATALOADER_LAUNCHER = textwrap.dedent("""
    import os, sys, time
    import torch
    import collectives

    class Numbers(torch.utils.data.Dataset):
        def __len__(self):
            return 10**6

        def __getitem__(self, i):
            if os.environ.get("PLANT_RAISE") and i == 40:
                raise ValueError("planted in a DataLoader worker")
            return torch.full((64,), float(i))

    def work(env, pid_dir):
        # batches come back from the workers through multiprocessing's sockets and semaphores
        for k, batch in enumerate(torch.utils.data.DataLoader(Numbers(), batch_size=4, num_workers=2)):
            if k == 3:
                with open(os.path.join(pid_dir, f"rank{env.rank}.pid"), "w") as f:
                    f.write(str(os.getpid()))
            time.sleep(0.01)

    if __name__ == "__main__":
        collectives.run(work, world_size=2, args=(sys.argv[1],), timeout=300)
""")


@pytest.mark.slow
@pytest.mark.parametrize("start_method", ["forkserver", "spawn"])
def test_ranks_with_dataloader_workers_leave_nothing_in_tmpdir_when_the_launcher_is_killed(start_method, tmp_path):
    """A SIGKILLed launcher whose ranks read through DataLoader workers left pymp-* folders with
    their listener sockets in TMPDIR, and the resource tracker warned of "28 leaked semaphore
    objects" (the ranks started their workers by forkserver, whose semaphores are named)."""
    below, _, tmp = kill_launcher_script(DATALOADER_LAUNCHER, signal.SIGKILL, tmp_path,
                                         env={"COLLECTIVES_START_METHOD": start_method})
    assert len(below) >= 7  # 2 ranks, 4 workers, the resource tracker
    assert_all_gone(below, within=20)
    deadline = time.monotonic() + 10  # the reaper removes the folders after its sweep
    while list(tmp.iterdir()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not list(tmp.iterdir()), [str(p) for p in tmp.rglob("*")]
    said = (tmp_path / "launcher-stderr.txt").read_text()
    assert "leaked" not in said, said[-2000:]


@pytest.mark.slow
def test_a_dataloader_worker_that_raises_leaves_nothing_behind(tmp_path):
    script = tmp_path / "launcher.py"
    script.write_text(DATALOADER_LAUNCHER)
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    link = tempfile.mktemp(prefix="cp-", dir="/tmp")  # short: see start_and_kill
    os.symlink(tmp, link)
    try:
        out = subprocess.run([sys.executable, str(script), str(tmp_path)], capture_output=True, text=True, timeout=240,
                             env={**os.environ, "TMPDIR": link, "PLANT_RAISE": "1"})
    finally:
        os.unlink(link)
    assert out.returncode == 1 and "planted in a DataLoader worker" in out.stderr, out.stderr[-3000:]
    headline = next(line for line in out.stderr.splitlines() if "RankFailure: rank" in line)
    assert "raised ValueError in DataLoader worker process" in headline and \
        headline.endswith(": ValueError: planted in a DataLoader worker"), headline  # the dataset's own error first
    assert "leaked" not in out.stderr, out.stderr[-2000:]
    assert not list(tmp.iterdir()), [str(p) for p in tmp.rglob("*")]


STUCK_LAUNCHER = textwrap.dedent("""
    import ctypes, os, subprocess, sys, time
    import collectives

    def work(env, pid_dir):
        if env.rank == 0:  # will sit in one C call that holds Python's lock: its watcher thread never runs
            pids = [os.getpid()]
        else:  # leaves for a session of its own, out of reach of the rank's process group
            child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
            pids = [os.getpid(), child.pid]
        with open(os.path.join(pid_dir, f"rank{env.rank}.pid"), "w") as f:
            f.write(" ".join(map(str, pids)))
        if env.rank == 0:
            ctypes.PyDLL(None).sleep(600)
        time.sleep(600)

    if __name__ == "__main__":
        collectives.run(work, world_size=2, args=(sys.argv[1],))
""")


@pytest.mark.slow
@pytest.mark.parametrize("start_method", ["forkserver", "spawn"])
def test_nothing_outlives_a_killed_launcher_even_a_rank_that_holds_the_gil_or_a_detached_grandchild(start_method,
                                                                                                    tmp_path):
    """Seen surviving a SIGKILLed launcher before the reaper: a rank stuck in a GIL-holding call,
    the grandchild in its own session, and the launcher's resource tracker (kept alive by them).
    A spawned rank carries the reaper's mark in its environment; a forked one is named to the
    reaper by its pid."""
    below, pid_dir, _ = kill_launcher_script(STUCK_LAUNCHER, signal.SIGKILL, tmp_path,
                                             env={"COLLECTIVES_START_METHOD": start_method})
    pids = _pids_in(pid_dir)
    assert len(pids) == 3 and set(pids) <= set(below)
    assert os.getsid(pids[2]) == pids[2]  # the grandchild really did leave the rank's session
    assert len(below) >= 5  # and multiprocessing's resource tracker, and the reaper
    assert_all_gone(below)


def _start_a_detached_child(env):
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
    return child.pid


def test_a_detached_grandchild_is_gone_when_run_returns():
    [pid] = C.run(_start_a_detached_child, world_size=1)
    assert not _running(pid), f"pid {pid}, started by the rank in a session of its own, outlived the run"


def test_a_function_the_ranks_cannot_import_is_refused_clearly():
    with pytest.raises(TypeError, match="module level"):
        C.run(lambda env: env.rank, world_size=2)


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_training_stops_with_a_killed_launcher(sig, tmp_path):
    """`timeout 15 python -m ddp_from_scratch.train ...` once left both ranks training and writing
    checkpoints under init."""
    ckpt = tmp_path / "ckpt"
    argv = [sys.executable, "-m", "ddp_from_scratch.train", "--nproc", "2", "--model", "small", "--synthetic",
            "--train-size", "4096", "--test-size", "8", "--batch-size", "2", "--epochs", "50", "--checkpoint", str(ckpt)]
    log = tmp_path / "launcher-stderr.txt"
    below, _ = start_and_kill(argv, sig, lambda: log.exists() and "step 3/" in log.read_text(), tmp_path)
    assert len(below) >= 3  # 2 ranks and the resource tracker
    assert_all_gone(below)
    time.sleep(1.0)
    assert not (ckpt / "checkpoint.pt").exists(), "a rank went on training and wrote a checkpoint"


@pytest.mark.slow
def test_ctrl_c_ends_the_progress_line_without_a_traceback(tmp_path):
    """SIGINT (Ctrl-C) to the launcher: 'interrupted' on its own line, exit code 130, no
    traceback glued onto the progress line, and every rank gone."""
    argv = [sys.executable, "-m", "ddp_from_scratch.train", "--nproc", "2", "--model", "small", "--synthetic",
            "--train-size", "4096", "--test-size", "8", "--batch-size", "2", "--epochs", "50"]
    log = tmp_path / "launcher-stderr.txt"
    with open(log, "wb") as err:  # SIGINT as a terminal delivers it, even if this test runs in the background
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=err,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 120
    while "step 3/" not in log.read_text() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.2)
    below = descendants(proc.pid)
    os.kill(proc.pid, signal.SIGINT)
    assert proc.wait(60) == 130
    text = log.read_text()
    assert "\ninterrupted (Ctrl-C)" in text and "Traceback" not in text, text[-2000:]
    # the progress line showed the time left, in whatever unit the machine's speed makes it ("~5 s",
    # "~2 h 39 min": a loaded machine's first steps are slow, and "s left" alone failed there)
    assert re.search(r"~\d[\w ]* left|estimating time left", text), text[-2000:]
    assert_all_gone(below)


def test_eta_by_size_is_latency_plus_bandwidth_not_bytes_alone():
    from collectives.cli import eta_by_size

    # 40 us per call up to 1 MiB, then bandwidth-bound at 1 GB/s: 1 GiB takes ~1.07 s
    def cost(n):
        return 40e-6 + n / 1e9

    sizes = [8 << k for k in range(28)]
    first = eta_by_size([(sizes[0], cost(sizes[0]))], sizes[1:])
    # counted in bytes, the 8-byte size would predict 40 us * 2^28 ~ 3 h; latency alone is ~1 ms
    assert first == "~0 s left", first
    done = [(n, cost(n)) for n in sizes[:20]]  # up to 4 MiB
    left = sizes[20:]
    predicted = float(eta_by_size(done, left).split()[0].lstrip("~"))
    assert abs(predicted - sum(cost(n) for n in left)) <= 1, predicted
    assert eta_by_size(done, []) == "" and eta_by_size([], left) == "estimating time left"


@pytest.mark.parametrize("fn, args, what", [
    (lambda env: 1, (), "Can't pickle <function <lambda>"),
    (print, (threading.Lock(),), "cannot pickle '_thread.lock' object"),
])
def test_what_cannot_pickle_is_refused_before_any_rank_is_spawned(fn, args, what, monkeypatch):
    def no_spawn(*a, **k):
        raise AssertionError("a rank pool was started for a call that cannot reach the ranks")

    monkeypatch.setattr(C.RankPool, "start", no_spawn)
    with pytest.raises(TypeError, match="cannot send .* to the ranks: " + what):
        C.run(fn, world_size=2, args=args)


class _StrFails(Exception):
    def __str__(self):
        raise RuntimeError("str() of this exception fails")


def _raise_str_fails(env):
    raise _StrFails()


def test_an_exception_whose_str_fails_is_still_reported():
    with pytest.raises(C.RankFailure) as info:
        C.run(_raise_str_fails, world_size=2)
    assert str(info.value).startswith("rank 0 raised _StrFails (its str() raised RuntimeError)") or \
        str(info.value).startswith("rank 1 raised _StrFails (its str() raised RuntimeError)"), str(info.value)
    assert "exited with code 1" not in str(info.value)  # the rank reported; it did not die


def _compile_cache_dir(env):
    import tempfile

    import torch
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)  # imports torch._dynamo, which makes the cache dir
    return cache_dir(), tempfile.gettempdir()


def test_ranks_keep_torchs_compile_cache_out_of_tmp():
    """torch's optimizers create /tmp/torchinductor_<user> on import (seen after every train,
    trace and compare run); our ranks point the cache at ~/.cache/torchinductor instead."""
    for where, tmp in C.run(_compile_cache_dir, world_size=2):
        assert not where.startswith(tmp), where
        assert where.endswith("torchinductor")


PRELOADED = """
import os, sys
import collectives
from collectives.launcher.start_methods import TRAINING, preload


def rank(env):
    imported = "torch._dynamo" in sys.modules  # before this rank built anything
    import torch
    torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    return imported


if __name__ == "__main__":
    first = preload(*TRAINING)
    print(first, collectives.run(rank, world_size=2), preload("json"))
"""


@pytest.mark.slow
def test_a_training_programs_ranks_start_with_what_an_optimizer_imports_and_nothing_lands_in_tmp(tmp_path):
    """preload(*TRAINING): the fork server imports torch._dynamo once (what the first optimizer or
    torch DDP of a rank imports, about a second of CPU each), with the compile cache pointed outside
    the temporary directory first, since importing it makes that folder; once the server has
    started, a preload is refused."""
    script = tmp_path / "preloaded.py"
    script.write_text(PRELOADED)
    # a short TMPDIR: under pytest's own (pytest-of-root/pytest-NNN/popen-gwN/<test name>/) the fork
    # server's socket path passes 107 bytes once NNN has three digits, and the ranks are spawned
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="pre"))
    try:
        env = {k: v for k, v in os.environ.items() if k not in ("TORCHINDUCTOR_CACHE_DIR", "TMPDIR")}
        out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                             env={**env, "TMPDIR": str(tmp)})
        assert out.returncode == 0 and out.stdout.split() == ["True", "[True,", "True]", "False"], \
            out.stdout + out.stderr
        assert not [p.name for p in tmp.iterdir() if p.name.startswith("torchinductor")]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _load_with_workers(env):
    """A DataLoader with worker processes inside a rank (a daemonic rank may not have children)."""
    data = torch.utils.data.TensorDataset(torch.arange(8.0))
    loader = torch.utils.data.DataLoader(data, batch_size=4, num_workers=2)
    return [batch[0].tolist() for batch in loader]


@pytest.mark.slow
def test_a_rank_may_start_processes_of_its_own():
    for batches in C.run(_load_with_workers, world_size=2, timeout=120):
        assert batches == [[0.0, 1.0, 2.0, 3.0], [4.0, 5.0, 6.0, 7.0]]


@pytest.mark.slow
def test_a_program_that_leaves_its_pool_open_still_exits(tmp_path):
    """Ranks are not daemons (so they may have children), and multiprocessing joins such processes
    at exit; a pool left open must be killed first, or the program waits for ranks that wait for it."""
    script = tmp_path / "open_pool.py"
    script.write_text("import collectives\n\ndef f(env):\n    return env.rank\n\nif __name__ == '__main__':\n"
                      "    pool = collectives.RankPool(2)\n    print(pool.start().submit(f))\n")
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert out.returncode == 0 and out.stdout.strip() == "[0, 1]", out.stderr


def _inner(env):
    return os.getpid()


def _run_nested(env):
    return C.run(_inner, world_size=1, timeout=120)


@pytest.mark.slow
def test_a_rank_may_run_a_pool_of_its_own():
    """A nested run (a daemonic rank may not have children); its rank is gone once it returns."""
    [[inner_pid]] = C.run(_run_nested, world_size=1, timeout=180)
    assert inner_pid != os.getpid() and not _running(inner_pid)


def _fail_in_order(env, delays):
    dist.barrier()  # the same start for every rank, then each fails after its own delay
    time.sleep(delays[env.rank])
    raise ValueError(f"rank {env.rank} failed after {delays[env.rank]} s")


def test_several_failing_ranks_are_listed_in_the_order_they_failed():
    """Rank 2 fails first, then rank 0, then rank 1 (all within the grace period): rank 2 leads,
    the others follow in their order, not in rank order."""
    with pytest.raises(C.RankFailure) as info:
        C.run(_fail_in_order, world_size=3, args=({2: 0.0, 0: 0.8, 1: 1.6},), timeout=60)
    lines = str(info.value).splitlines()
    assert lines[0] == "rank 2 raised ValueError: rank 2 failed after 0.0 s", lines[0]
    assert lines[2] == "  also: rank 0 raised ValueError: rank 0 failed after 0.8 s; " \
                       "rank 1 raised ValueError: rank 1 failed after 1.6 s", lines[2]
    assert (info.value.first, info.value.failed, info.value.stopped) == (2, [0, 1, 2], [])  # failed: rank order


@pytest.mark.parametrize("order, peer_lost, first, failed, stopped", [
    ([2, 0, 1], [], 2, [2, 0, 1], []),
    ([0, 1, 2], [], 0, [0, 1, 2], []),
    ([1, 2, 0], [], 1, [1, 2, 0], []),
    ([0, 2, 1], [0], 2, [2, 1], [0]),     # rank 0 only lost its peer: the next rank of its own leads
    ([1, 0, 2], [1, 2], 0, [0], [1, 2]),
])
def test_the_first_failure_of_its_own_leads_whatever_the_arrival_order(order, peer_lost, first, failed, stopped):
    """The launcher's ordering alone, for arrival orders a 3-rank run cannot force cheaply."""
    pool = C.RankPool(world_size=3)
    failures = {r: (f"rank {r} raised:\nRuntimeError: [gloo] Connection closed by peer [127.0.0.1]:1" if r in peer_lost
                    else f"rank {r} raised:\nValueError: planted {r}") for r in order}
    summaries = {r: "raised " + failures[r].splitlines()[1] for r in order}
    with pytest.raises(C.RankFailure) as info:
        pool._report_failure("call", 60, failures, summaries, list(order), set())
    assert (info.value.first, info.value.failed, info.value.stopped) == (first, sorted(failed), stopped)
    lines = str(info.value).splitlines()
    assert lines[0].startswith(f"rank {first} raised")
    others = [r for r in failed if r != first]
    if others:  # the others that failed on their own follow in the order they failed
        assert lines[2] == "  also: " + "; ".join(f"rank {r} raised ValueError: planted {r}" for r in others), lines


def _a_result_of_a_class_only_the_rank_has(env):
    import types

    module = types.ModuleType("only_in_the_rank")
    sys.modules["only_in_the_rank"] = module
    module.Result = type("Result", (), {"__module__": "only_in_the_rank"})
    return module.Result()


def test_a_result_the_launcher_cannot_unpickle_is_a_rank_failure():
    """It escaped as a bare ModuleNotFoundError from the launcher's own pickle.loads."""
    with pytest.raises(C.RankFailure) as info:
        C.run(_a_result_of_a_class_only_the_rank_has, world_size=2, timeout=60)
    headline = str(info.value).splitlines()[0]
    assert "returned a only_in_the_rank.Result that this process cannot unpickle (ModuleNotFoundError" in headline
    assert "instances of a class this process can import" in str(info.value)


def _peer_gone_mid_collective(env, out, async_op):
    if env.rank == 1:
        time.sleep(0.5)
        os._exit(3)
    try:
        work = C.all_reduce(torch.ones(1 << 16), async_op=async_op)
        if async_op:
            work.wait()
    except C.BackendFailure as exc:
        (out / "caught").write_text(f"{exc.rank}|{exc.host}|{exc.collective}|{exc}")
    time.sleep(600)  # the launcher stops this rank once it sees rank 1 gone


@pytest.mark.slow
@pytest.mark.parametrize("async_op", [False, True])
def test_a_peer_gone_mid_collective_is_a_backend_failure_naming_rank_host_and_collective(async_op, tmp_path):
    """Gloo's own words ("Connection closed by peer", or after a timeout "Timed out waiting
    10000ms for recv operation") name no rank, host or collective; the wrappers add them, in
    the call and in Work.wait()."""

    with pytest.raises(C.RankFailure):
        C.run(_peer_gone_mid_collective, world_size=2, args=(tmp_path, async_op), timeout=60)
    rank, host, collective, message = (tmp_path / "caught").read_text().split("|", 3)
    assert (rank, host, collective) == ("0", socket.gethostname(), "all_reduce")
    assert message.startswith(f"rank 0 on host {socket.gethostname()}: all_reduce over 2 ranks (gloo) failed in the "
                              "backend: "), message
    assert "gloo" in message.lower()  # torch's own words follow


@pytest.mark.slow
def test_a_tmpdir_too_long_for_the_fork_servers_socket_starts_ranks_by_spawn(tmp_path):
    """pytest's tmp_path as TMPDIR can be too long for the fork server's Unix socket (107 bytes):
    the ranks start by spawn instead of failing with 'AF_UNIX path too long'; asked for by name,
    forkserver is refused saying why."""
    long = tmp_path / ("d" * (100 - len(str(tmp_path))) if len(str(tmp_path)) < 90 else "d")
    long.mkdir()
    program = ("import collectives, collectives.launcher.start_methods as P\n"
               "def rank(env): return env.rank\n"
               "if __name__ == '__main__':\n"
               "    print(P.start_method_for(), collectives.run(rank, 2))\n"
               "    try:\n"
               "        P.start_method_for('forkserver')\n"
               "    except ValueError as exc:\n"
               "        print(exc)\n")
    (tmp_path / "prog.py").write_text(program)
    out = subprocess.run([sys.executable, str(tmp_path / "prog.py")], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "TMPDIR": str(long)})
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[0] == "spawn [0, 1]", out.stdout
    assert "would have a path longer than a Unix socket's 107 bytes" in out.stdout, out.stdout


@pytest.mark.parametrize("message, says", [
    ("plain message\nsecond line", "ValueError: plain message"),
    ("Caught ValueError in DataLoader worker process 0.\nOriginal Traceback (most recent call last):\n"
     "  File \"ds.py\", line 3, in __getitem__\n    raise ValueError(\"sample 3: truncated\")\n"
     "ValueError: sample 3: truncated\n", "ValueError in DataLoader worker process 0: ValueError: sample 3: truncated"),
    ("", "ValueError"),
])
def test_a_ranks_error_in_one_line_leads_with_the_original_error(message, says):
    """The headline of a failure report: an error that carries another process's traceback in
    its message (torch's DataLoader re-raises a worker's so) is headed by that error's own line."""
    from collectives.launcher.rank_main import _one_line

    assert _one_line(ValueError(message)) == says


@pytest.mark.parametrize("length", [106, 107, 108, 109])
def test_the_fork_servers_socket_fits_exactly_when_the_kernel_binds_it(length, monkeypatch):
    """At the edge, against the kernel itself: a socket path of 107 bytes binds and one of 108 does
    not (sun_path holds 108 with its NUL); forkserver is kept exactly when it binds (a planted
    check that kept 108 passed every test, whose long path is about 130 bytes)."""
    import shutil
    from multiprocessing import forkserver, process

    from collectives.launcher import start_methods

    tail = "/listener-" + "x" * 8
    base = tempfile.mkdtemp(prefix="cp-edge-", dir="/tmp")
    folder = base + "/" + "d" * (length - len(tail) - len(base) - 1)
    os.makedirs(folder)
    try:
        sock = socket.socket(socket.AF_UNIX)
        try:
            sock.bind(folder + tail)
            binds = True
        except OSError:
            binds = False
        finally:
            sock.close()
        monkeypatch.setattr(forkserver._forkserver, "_forkserver_address", None)
        monkeypatch.setitem(process.current_process()._config, "tempdir", folder)
        assert len((folder + tail).encode()) == length
        assert binds == (length <= 107)
        assert start_methods.forkserver_address_fits() == binds
    finally:
        shutil.rmtree(base)
