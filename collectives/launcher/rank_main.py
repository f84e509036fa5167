"""What each rank of a RankPool (pool.py) runs, from its start to its exit.

    ctx.Process(target=run_rank, args=(rank, world_size, backend, store_port, conn, stack_writer,
                                         lifeline, threads, setup, recorder))

`ctx` is multiprocessing's forkserver (a server that imported torch once forks each rank) or its
spawn context (each rank a fresh interpreter); see start_methods.rank_context. A forked rank has already
taken the launcher's environment, stdout and stderr when this runs (as_spawned.py).

A rank puts itself in a process group of its own (so it and everything it starts can be killed
together), watches the parent's lifeline pipe in a daemon thread (end-of-file: the parent is
gone, so the rank kills its own group), lets faulthandler write its stack into a pipe on
SIGUSR1 (the parent's hang diagnosis) and on a fatal signal (SIGSEGV, SIGABRT, ...: where a crashed
rank was, which the parent reads once it has died), joins the process group through the parent's TCP store,
answers the parent's requests for its flight record from a thread (flight_recorder.py), then runs
each function the parent sends until the parent sends None. For each it sends ("loaded", None) once
the function and its arguments are unpickled (their modules imported: the call's timeout starts
there), then ("ok", (pickled result, its class)) or ("error", (one line, traceback without this
harness's frames)); a function that cannot be unpickled gets the error alone.
"""

from __future__ import annotations

import faulthandler
import os
import pickle
import select
import signal
import sys
import threading
import traceback

from ..cli import compile_cache_outside_tmp

PARENT_POLL_S = 1.0  # the lifeline wakes the watcher at once; this is only the fallback
# The library's own files (the collectives package, this folder's parent): a frame in them is not
# "where the user's code was"
PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
# Frames of the harness itself, left out of the tracebacks and stacks shown to the user.
HIDDEN_FILES = {os.path.join(PACKAGE_DIR, name) for name in ("launcher/pool.py", "launcher/rank_main.py", "testing.py")}


def _kill_own_group(*_):
    os.killpg(os.getpgrp(), signal.SIGKILL)  # this rank and every process it started


def _parent_gone(lifeline, wait: float) -> bool:
    """Whether the launcher has ended: its lifeline pipe, of which it holds the only writer and
    never writes, reads end-of-file (select says "ready")."""
    try:
        ready, _, _ = select.select([lifeline.fileno()], [], [], wait)
    except (OSError, ValueError):
        return True
    return bool(ready)


def _watch_parent(lifeline, parent_pid: int) -> None:
    """Runs in a daemon thread of each rank: when the parent is gone, take the rank down.
    `parent_pid` is the rank's parent process when it started (the launcher, or the fork server,
    which exits with the launcher): a rank re-parented elsewhere has lost it too."""
    while True:
        if _parent_gone(lifeline, PARENT_POLL_S) or os.getppid() != parent_pid:
            _kill_own_group()


def _answer_flight_record_requests(recorder) -> None:
    """Runs in a daemon thread of each rank: send this rank's flight record whenever the parent
    asks. A thread, so that a rank blocked in a collective (which releases Python's lock) answers."""
    from ..flight_recorder import dump

    while True:
        try:
            recorder.recv()
        except (EOFError, OSError):
            return
        try:
            record = dump()
        except Exception:  # a record that cannot be read is no answer, not a second failure
            record = None
        try:
            recorder.send(record)
        except (OSError, ValueError):
            return


def _as_a_torchrun_rank(tmp: str) -> None:
    """multiprocessing in this rank as in one torchrun starts: the platform's default start method
    (a rank forked from the fork server would start DataLoader workers by forkserver, whose
    named semaphores a killed rank leaks to the resource tracker: "28 leaked semaphore objects"),
    and its sockets in the pool's folder `tmp`, which the pool and its reaper remove however the
    rank ends. Processes forked from the rank do not inherit its SIGTERM handler."""
    import multiprocessing

    multiprocessing.set_start_method(None, force=True)
    multiprocessing.process.current_process()._config["tempdir"] = tmp
    os.register_at_fork(after_in_child=lambda: signal.signal(signal.SIGTERM, signal.SIG_DFL))


def run_rank(rank, world_size, backend, store_port, conn, stack_writer, lifeline, threads, setup, recorder, tmp):
    """Body of one rank: join the group, then run what the parent sends until None."""
    os.setpgid(0, 0)  # own process group, so the rank and its children can be killed together
    compile_cache_outside_tmp()  # before torch's optimizers import torch._dynamo
    signal.signal(signal.SIGTERM, _kill_own_group)
    _as_a_torchrun_rank(tmp)
    threading.Thread(target=_watch_parent, args=(lifeline, os.getppid()), daemon=True, name="parent-watch").start()
    if _parent_gone(lifeline, 0):  # the launcher died while this rank was starting
        _kill_own_group()
    faulthandler.register(signal.SIGUSR1, file=stack_writer.fileno(), all_threads=True)
    faulthandler.enable(file=stack_writer.fileno(), all_threads=True)  # then the signal kills the rank as before
    try:
        if setup is not None:
            setup()
        import torch
        import torch.distributed as dist

        from .env import DEFAULT_PG_TIMEOUT, DistEnv, device_for, device_id_for

        if threads:
            torch.set_num_threads(threads)
        device = device_for(backend, rank)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        if backend == "shm":
            import collectives.shm  # noqa: F401 - registers the backend in this process
        store = dist.TCPStore("127.0.0.1", store_port, world_size, False, timeout=DEFAULT_PG_TIMEOUT)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=DEFAULT_PG_TIMEOUT,
                                **device_id_for(backend, device))
        env = DistEnv(rank=rank, world_size=world_size, local_rank=rank, device=device, backend=backend)
    except BaseException as exc:
        conn.send(("error", (_one_line(exc), traceback.format_exc())))
        return
    threading.Thread(target=_answer_flight_record_requests, args=(recorder,), daemon=True, name="flight-record").start()
    conn.send(("ready", None))
    while True:
        try:
            message = conn.recv()
        except EOFError:  # the parent went away
            break
        if message is None:
            break
        payload, sys_path = message
        for entry in reversed(sys_path):  # so test modules the parent imported resolve here too
            if entry not in sys.path:
                sys.path.insert(0, entry)
        try:
            fn, args = pickle.loads(payload)  # imports fn's module: not part of the call's timeout
        except BaseException as exc:
            conn.send(("error", (_one_line(exc), _format_exception(exc))))
            continue
        conn.send(("loaded", None))
        try:
            result = fn(env, *args)
            kind = type(result)
            reply = ("ok", (pickle.dumps(result), f"{kind.__module__}.{kind.__qualname__}"))
        except BaseException as exc:
            reply = ("error", (_one_line(exc), _format_exception(exc)))
        conn.send(reply)
    try:
        dist.destroy_process_group()
    except Exception:
        pass


def _format_exception(exc: BaseException) -> str:
    """The traceback without this module's frames: the user's code is what the reader wants."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename not in HIDDEN_FILES]
    lines = ["Traceback (most recent call last):\n"] + traceback.format_list(frames)
    return "".join(lines + traceback.format_exception_only(type(exc), exc))


def _one_line(exc: BaseException) -> str:
    """ "ValueError: the first line of its message" (an exception whose str() fails says so).

    An error re-raised from another process carries the original's traceback in its message, and
    its first line only says where it was caught ("Caught ValueError in DataLoader worker process
    0."); the original's own last line, the dataset's error, is what the reader needs first, so it
    follows: "ValueError in DataLoader worker process 0: ValueError: sample 3: ..."."""
    try:
        lines = str(exc).strip().splitlines()
    except Exception as failure:  # noqa: BLE001 - the rank must still report something
        return f"{type(exc).__name__} (its str() raised {type(failure).__name__})"
    if not lines:
        return type(exc).__name__
    if len(lines) > 1 and any(line.startswith("Original Traceback") for line in lines):
        original = next((line.strip() for line in reversed(lines) if line.strip()), "")
        where = lines[0].rstrip(".")
        where = where[len("Caught "):] if where.startswith("Caught ") else where
        return f"{where}: {original}"
    return f"{type(exc).__name__}: {lines[0]}"
