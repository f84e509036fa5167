"""A pool of spawned ranks that stay alive and run one function after another.

Starting ranks costs tens of milliseconds each when they are forked from the fork server, which
imported torch once (about a second a rank with start_method="spawn", each importing torch
itself); sending a function to ranks that are already up costs less than a millisecond. `collectives.run` uses a pool for one call; `collectives.testing` keeps
pools alive across tests. Either way, if any rank raises, dies (signal, os._exit, Gloo's
SIGABRT) or is still running at the timeout, every rank is stopped with anything it started,
and the caller gets one `RankFailure` that leads with the rank that failed first and why.

    with RankPool(world_size=2) as pool:
        print(pool.submit(my_fn, args=(3,)))    # my_fn(env, 3) on each rank, results in rank order

Nothing outlives the pool, whatever ends it:
- The ranks join through a TCP store that this process hosts on a free port (no fixed port, no
  rendezvous file to leave behind in /tmp).
- A reaper process (reaper.py), started before the ranks and told their pids, kills the ranks,
  their process groups and every process that carries this pool's mark in its environment (all
  they start, a grandchild in a session of its own included) when the pool closes or this process
  ends in any way, SIGKILL included. It needs
  nothing from the ranks, so a rank stuck in a C call that holds Python's lock goes too.
- Each rank also watches a "lifeline" pipe whose only writer is this process, and kills its own
  process group when it reads end-of-file: the quick path, and the one that covers a rank forked
  but not yet started when this process died.
- A hung rank's Python stack comes back through a pipe too (faulthandler writes into it).

What each rank runs is rank_main.py; this file is the parent's side.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import math
import multiprocessing as mp
import multiprocessing.connection
import multiprocessing.forkserver
import multiprocessing.resource_tracker
import multiprocessing.spawn
import multiprocessing.util  # registers its exit handler now, so that ours (below) runs before it
import os
import pickle
import runpy
import select
import shutil
import signal
import sys
import tempfile
import threading
import time
import weakref
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from ..errors import RankFailure
from .env import check_settings
from .rank_main import run_rank
from .rank_report import PEER_LOST, clean_stack, describe_exit, short, where_it_was
from .reaper import Reaper

# After the first rank fails, how long the others get to report their own error (in checked
# mode every rank raises the same mismatch; all of their messages are worth showing).
FAILURE_GRACE_S = 3.0
STACK_DUMP_WAIT_S = 1.0


class RankPool:
    """`world_size` spawned ranks with an initialised process group, reused across calls.

    Args:
        world_size: number of ranks to spawn.
        backend: "gloo", "nccl" or "shm"; None picks NCCL only with one GPU per rank, else Gloo.
        threads: torch threads per rank (1 by default: ranks share the machine's cores).
        start_timeout: seconds to wait for every rank to import torch and join the group.
        setup: a module-level function each rank calls first, before its first task (the
            pytest harness installs assertion rewriting this way).
        start_method: "forkserver" (each rank forked from a server that imported torch once:
            tens of milliseconds a rank) or "spawn" (a fresh interpreter a rank: about a second
            each, importing torch); None: COLLECTIVES_START_METHOD if set, else forkserver where
            the platform has it (see rank_context).
    """

    def __init__(self, world_size: int, backend: Optional[str] = None, threads: int = 1, start_timeout: float = 120.0,
                 setup: Optional[Callable[[], None]] = None, start_method: Optional[str] = None):
        _check_world_size(world_size)
        if threads is not None and (not isinstance(threads, int) or isinstance(threads, bool) or threads < 0):
            raise ValueError(f"threads must be a non-negative int (0: torch's default), got {threads!r}")
        _check_timeout(start_timeout, "start_timeout")
        from .env import pick_backend

        self.world_size = world_size
        self.backend = pick_backend(world_size, backend)
        check_settings(self.backend)
        self.threads = threads
        self.start_timeout = start_timeout
        self.setup = setup
        self.start_method = start_method_for(start_method)
        self._procs: List[mp.process.BaseProcess] = []
        self._conns: List[mp.connection.Connection] = []
        self._stacks: List[mp.connection.Connection] = []
        self._recorders: List[mp.connection.Connection] = []  # ask a rank for its flight record
        self._lifeline = None
        self._store = None
        self._reaper: Optional[Reaper] = None
        self._tmp: Optional[str] = None  # the ranks' multiprocessing folder (sockets), removed with them

    # -- life cycle ---------------------------------------------------------------------------
    @property
    def alive(self) -> bool:
        return bool(self._procs) and all(p.is_alive() for p in self._procs)

    @property
    def pids(self) -> List[int]:
        """The ranks' process ids, in rank order (empty before start)."""
        return [p.pid for p in self._procs]

    def start(self) -> "RankPool":
        _not_while_a_rank_imports_main()
        if self.alive:
            return self
        self._kill()
        check_settings(self.backend)  # again: the environment may have changed since the pool was made
        if self.backend == "shm":  # its C++ bridge, built here once rather than by every rank at once
            from ..shm import native

            native.load()
        _LIVE.add(self)
        import torch.distributed as dist

        # The rendezvous: a TCP store on a free port of this process, gone when this process is.
        self._store = dist.TCPStore("127.0.0.1", 0, self.world_size, True, wait_for_workers=False,
                                    timeout=datetime.timedelta(seconds=self.start_timeout))
        ctx = rank_context(self.start_method)
        lifeline_reader, self._lifeline = ctx.Pipe(duplex=False)
        # multiprocessing's resource tracker serves this process beyond the pool: start it unmarked
        # (it exits by itself once every process holding its pipe, the ranks included, is gone).
        multiprocessing.resource_tracker.ensure_running()
        if self.start_method == "forkserver":  # started (once) before the mark is set: no pool's mark is its
            multiprocessing.forkserver.ensure_running()
        self._reaper = Reaper()
        # multiprocessing's sockets of the ranks and their DataLoader workers go in a folder of the
        # pool's, which it and the reaper remove: a killed rank or worker leaves its sockets behind
        self._tmp = tempfile.mkdtemp(prefix="collectives-")
        self._reaper.remove_after(self._tmp)
        if self.start_method == "forkserver":  # the server's socket: the launcher's own, if it is killed
            self._reaper.remove_after(multiprocessing.util.get_temp_dir(), only_if_launcher_died=True)
        os.environ[self._reaper.mark] = "1"  # the spawned ranks inherit it, and pass it to all they start
        try:
            for rank in range(self.world_size):
                parent, child = ctx.Pipe()
                stack_reader, stack_writer = ctx.Pipe(duplex=False)
                recorder, recorder_child = ctx.Pipe()
                proc = ctx.Process(
                    target=run_rank,
                    args=(rank, self.world_size, self.backend, self._store.port, child, stack_writer, lifeline_reader,
                          self.threads, self.setup, recorder_child, self._tmp),
                    daemon=False,  # a rank may start processes of its own (DataLoader workers); see _LIVE
                    name=f"rank{rank}",
                )
                with _started_as_if_spawned(self.start_method):
                    proc.start()
                child.close()
                stack_writer.close()
                recorder_child.close()
                self._recorders.append(recorder)
                self._procs.append(proc)
                self._conns.append(parent)
                self._stacks.append(stack_reader)
                self._reaper.watch(proc.pid)  # a forked rank does not carry the mark: name it
        finally:
            del os.environ[self._reaper.mark]
            lifeline_reader.close()
        self._collect("start-up", self.start_timeout, expect="ready")
        return self

    def close(self) -> None:
        """Ask ranks to leave cleanly; kill any that do not within a few seconds."""
        for conn in self._conns:
            try:
                conn.send(None)
            except (OSError, BrokenPipeError):
                pass
        deadline = time.monotonic() + 5.0
        for proc in self._procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        self._kill()

    def _kill(self) -> None:
        for proc in self._procs:
            if proc.pid is None:
                continue
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # the rank and anything it started
            except (ProcessLookupError, PermissionError):
                pass
            proc.join(5.0)
        if self._reaper is not None:
            self._reaper.sweep_now()  # what a rank started outside its process group
        for conn in self._conns + self._stacks + self._recorders + ([self._lifeline] if self._lifeline else []):
            conn.close()
        self._procs, self._conns, self._stacks, self._recorders = [], [], [], []
        self._lifeline, self._store, self._reaper = None, None, None
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None
        _LIVE.discard(self)

    def __enter__(self) -> "RankPool":
        return self.start()

    def __exit__(self, exc_type, *exc) -> None:
        if exc_type is None:
            self.close()
        else:  # Ctrl-C or an error here: no point waiting for the ranks to finish their work
            self._kill()

    # -- running --------------------------------------------------------------------------------
    def submit(self, fn: Callable, args: Sequence[Any] = (), timeout: float = 60.0, name: Optional[str] = None) -> List[Any]:
        """Run `fn(env, *args)` on every rank; return the results in rank order.

        `fn` and `args` must pickle (a function defined at module level, not a lambda).
        On a failure `RankFailure` is raised. The ranks are kept when every one of them answered
        (returned or raised) and they are still in step (`_in_step`); after a death, a hang or any
        doubt the pool is torn down and the next submit starts a fresh one.
        """
        __tracebackhide__ = True  # pytest: show the test, not the harness
        check_call(fn, args, timeout)
        name = name or getattr(fn, "__qualname__", repr(fn))
        payload = pickled(fn, args, name)
        self.start()
        for conn in self._conns:
            conn.send((payload, list(sys.path)))
        return self._collect(name, timeout, expect="ok")

    def _collect(self, what: str, timeout: float, expect: str) -> List[Any]:
        """Every rank's reply to `what` (status `expect`), in rank order; or RankFailure naming the
        first rank that failed, how, and which ranks stopped because of it."""
        __tracebackhide__ = True
        results, failures, summaries, order, pending = self._receive(timeout, expect)
        if not failures and not pending:
            return [results[r] for r in range(self.world_size)]
        self._report_failure(what, timeout, failures, summaries, order, pending)

    def _receive(self, timeout: float, expect: str):
        """Wait for every rank's reply until the timeout, or until FAILURE_GRACE_S after the first
        failure. Returns (results, failures, summaries, order of failures, ranks still pending)."""
        results: Dict[int, Any] = {}
        failures: Dict[int, str] = {}
        summaries: Dict[int, str] = {}
        order: List[int] = []  # ranks in the order their failures arrived
        deadline = time.monotonic() + timeout
        first_failure_at: Optional[float] = None
        pending = set(range(self.world_size))
        while pending:
            now = time.monotonic()
            limit = deadline if first_failure_at is None else min(deadline, first_failure_at + FAILURE_GRACE_S)
            if now >= limit:
                break
            waitables = {self._conns[r]: r for r in pending}
            waitables.update({self._procs[r].sentinel: r for r in pending})
            for ready in mp.connection.wait(list(waitables), timeout=limit - now):
                rank = waitables[ready]
                if rank not in pending:
                    continue
                status, value = self._reply(rank)
                if status == "died":
                    summaries[rank], stack = self._death(rank)
                    failures[rank] = f"rank {rank} {summaries[rank]}" + (f"; its Python stack:\n{stack}" if stack else "")
                elif status == "error":
                    summaries[rank] = f"raised {value[0]}"
                    failures[rank] = f"rank {rank} raised:\n{value[1]}"
                elif status == expect == "ok":
                    try:
                        results[rank] = pickle.loads(value[0])
                    except Exception as exc:  # a class that only exists in the rank, say
                        summaries[rank] = (f"returned a {value[1]} that this process cannot unpickle "
                                           f"({type(exc).__name__}: {exc})")
                        failures[rank] = (f"rank {rank} {summaries[rank]}; return tensors, numbers, strings, lists "
                                          "or dicts, or instances of a class this process can import")
                elif status == expect:
                    results[rank] = None
                else:
                    summaries[rank] = f"sent an unexpected {status!r}"
                    failures[rank] = f"rank {rank} {summaries[rank]}"
                pending.discard(rank)
                if rank in failures:
                    order.append(rank)
                    if first_failure_at is None:
                        first_failure_at = time.monotonic()
        return results, failures, summaries, order, pending

    def _reply(self, rank: int):
        """(status, value) from a rank whose pipe or process sentinel is ready; "died" if it is gone."""
        conn = self._conns[rank]
        if not conn.poll():
            return "died", None
        try:
            return conn.recv()
        except (EOFError, OSError):
            return "died", None

    def _death(self, rank: int) -> Tuple[str, str]:
        """How a dead rank ended and where, and the stack its faulthandler wrote as it died."""
        self._procs[rank].join(1.0)
        summary = describe_exit(self._procs[rank].exitcode)
        stack = clean_stack(self._read_crash_stack(rank))
        where = where_it_was(stack).replace("waiting in ", "in ", 1)
        if where:
            summary = summary.replace(" (", f" {where} (", 1) if " (" in summary else f"{summary} {where}"
        return summary, stack

    def _in_step(self) -> bool:
        """After a failure that every rank answered (each returned or raised, none died or hung):
        whether the ranks can take the next call as they are. Yes when every rank is alive and
        has issued as many calls on the world's group as the others (torch's sequence number: a
        collective or a send/recv counts on each rank it involves, so a rank that left an
        unmatched call behind shows it). Keeping the pool keeps a failing test cheap to re-run,
        as hypothesis does when it shrinks an example; any doubt (a backend without sequence
        numbers, a rank that does not answer at once) gives fresh ranks instead."""
        if not self._procs or not all(p.is_alive() for p in self._procs):
            return False
        try:
            payload = pickled(_world_sequence_number, (), "the pool's check after a failure")
            for conn in self._conns:
                conn.send((payload, list(sys.path)))
            results, failures, _, _, pending = self._receive(IN_STEP_TIMEOUT_S, "ok")
        except (OSError, EOFError, ValueError):
            return False
        return not failures and not pending and len(set(results.values())) == 1 and None not in results.values()

    def _flight_records(self, where: Dict[int, str], pending: set) -> List[str]:
        """What the live ranks' flight records say (a rank that died is named as dead); with
        TORCH_FR_DUMP_TEMP_FILE set (torch's setting), the records are also written there."""
        from .. import flight_recorder  # here, not at the top: `python -m collectives.flight_recorder`
        # imports this package first, and runpy warns when the module it runs is already imported
        records = flight_recorder.collect(self._recorders)
        dead = {r: describe_exit(p.exitcode) for r, p in enumerate(self._procs) if p.exitcode is not None}
        ended = set(range(self.world_size)) - set(pending) - set(dead)  # returned or raised: in no collective now
        lines = flight_recorder.verdict(records, where, ranks=range(self.world_size), dead=dead, ended=ended)
        if not lines and where and not any(records.values()):  # a hang, and nothing to judge it by: say so
            lines = [f"no live rank sent its record within {flight_recorder.ANSWER_WAIT_S:g} s "
                     f"({len(records)} answered, every answer empty)" if records else
                     f"no live rank sent its record within {flight_recorder.ANSWER_WAIT_S:g} s"]
        prefix = os.environ.get("TORCH_FR_DUMP_TEMP_FILE")
        if prefix:  # after the verdict, which a file that cannot be written must not replace
            try:
                flight_recorder.write(records, prefix, self.world_size)
            except OSError as exc:
                lines.append(f"could not write the records to {prefix}<rank>: {exc.strerror or exc}")
        return lines

    def _report_failure(self, what: str, timeout: float, failures: Dict[int, str], summaries: Dict[int, str],
                        order: List[int], pending: set) -> None:
        """Raise RankFailure: the first rank that failed on its own leads, then the others that
        failed, then those stopped because of it (hung past the grace period, or lost a peer)."""
        __tracebackhide__ = True
        # A rank that only lost its peer can report before the parent sees the peer's death (both
        # arrive in one wait, in no set order): lead with the first failure of its own.
        own = [r for r in order if not PEER_LOST.search(failures[r])]
        if own and own[0] != order[0]:
            order = [own[0]] + [r for r in order if r != own[0]]
        stopped: List[int] = []
        if pending:  # hung (timeout), or still busy after another rank failed
            stacks = self._dump_stacks(sorted(pending))
            where = {r: where_it_was(stacks.get(r, "")) for r in pending}
            if failures:
                why = f"was still running {FAILURE_GRACE_S:.0f} s after rank {order[0]} failed"
                stopped = sorted(pending)
            else:  # a timeout: ranks busy outside a collective are the likely cause
                why = f"did not finish within the {timeout:g} s timeout"
                order = sorted(pending, key=lambda r: (where[r].startswith("waiting in"), r))
                if not where[order[0]].startswith("waiting in"):
                    stopped = [r for r in order if where[r].startswith("waiting in")]
            for rank in sorted(pending):
                summaries[rank] = f"{why}: {where[rank]}" if where[rank] else why
                failures[rank] = f"rank {rank} {why}; its Python stack:\n{stacks.get(rank) or '(no stack captured)'}"
        # A rank whose connection to a dead or failed peer broke failed because of that peer.
        stopped += [r for r in order[1:] if r not in stopped and PEER_LOST.search(failures[r])]
        # A hang: what torch's flight records say, when the ranks keep them (TORCH_FR_BUFFER_SIZE).
        from ..flight_recorder import recording
        told = self._flight_records(where if pending else {}, pending) if recording() else []
        if pending or not self._in_step():
            self._kill()  # the next submit starts fresh ranks
        failed = [r for r in order if r not in stopped]
        first = order[0]
        lines = [f"flight recorder: {line}" for line in told] + [
                 f"rank {first} {summaries[first]}",
                 f"  in {what} (world_size={self.world_size}, backend={self.backend})"]
        others = [r for r in failed if r != first]
        if others:
            lines.append("  also: " + "; ".join(f"rank {r} {short(summaries[r])}" for r in others))
        if stopped:
            lines.append(f"  stopped because of it: rank(s) {sorted(stopped)}")
            lines += [f"    rank {r} {short(summaries[r])}" for r in sorted(stopped)]
        body = "\n".join(f"----- {failures[r]}".rstrip() for r in [*failed, *sorted(stopped)])
        if what == "start-up" and any("exited with code 1" in f for f in failures.values()):
            body += (
                "\nHint: the ranks are spawned, so each one imports your main module first; a script that "
                "calls collectives.run() must do it under `if __name__ == \"__main__\":` (the ranks' own "
                "error output, above this message, says more)."
            )
        raise RankFailure("\n".join(lines) + "\n" + body, failures, first=first, failed=failed, stopped=stopped)

    def _read_crash_stack(self, rank: int) -> str:
        """What a dead rank's faulthandler wrote into its stack pipe as a fatal signal hit it (empty
        for a rank that exited or was killed by SIGKILL)."""
        reader, raw = self._stacks[rank], b""
        deadline = time.monotonic() + STACK_DUMP_WAIT_S
        while time.monotonic() < deadline and reader.poll(0):
            try:
                chunk = os.read(reader.fileno(), 1 << 16)
            except OSError:
                break
            if not chunk:  # end of file: the rank is gone and everything it wrote is read
                break
            raw += chunk
        return raw.decode(errors="replace")

    # -- hang diagnosis ---------------------------------------------------------------------------
    def _dump_stacks(self, ranks: List[int]) -> Dict[int, str]:
        for rank in ranks:
            try:
                os.kill(self._procs[rank].pid, signal.SIGUSR1)  # faulthandler writes the stack
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + STACK_DUMP_WAIT_S
        raw = {rank: b"" for rank in ranks}
        while time.monotonic() < deadline:
            readers = {self._stacks[r].fileno(): r for r in ranks}
            ready, _, _ = select.select(list(readers), [], [], max(0.0, deadline - time.monotonic()))
            for fd in ready:
                chunk = os.read(fd, 1 << 16)
                raw[readers[fd]] += chunk
            if all(raw.values()) and not ready:
                break
            if all(raw.values()):
                time.sleep(0.05)  # let the last threads' frames arrive
        return {rank: clean_stack(text.decode(errors="replace")) for rank, text in raw.items() if text}


START_METHODS = ("forkserver", "spawn")
# What the fork server imports once, before it forks any rank: the seconds each spawned rank
# would spend importing them itself.
PRELOAD = ["torch", "torch.distributed"]


def start_method_for(start_method: Optional[str] = None) -> str:
    """The start method a pool uses: the one asked for, else COLLECTIVES_START_METHOD, else
    forkserver where multiprocessing has it (Linux, macOS), else spawn."""
    chosen = start_method or os.environ.get("COLLECTIVES_START_METHOD") or (
        "forkserver" if "forkserver" in mp.get_all_start_methods() and _forkserver_address_fits() else "spawn")
    if chosen not in START_METHODS:
        where = "start_method" if start_method else "COLLECTIVES_START_METHOD"
        raise ValueError(f"{where} must be one of {', '.join(START_METHODS)}, got {chosen!r}")
    if chosen == "forkserver" and not _forkserver_address_fits():
        raise ValueError(f"start method forkserver: its socket in {tempfile.gettempdir()} would have a path longer "
                         "than a Unix socket's 107 bytes; set a shorter TMPDIR, or use start method spawn")
    return chosen


def _forkserver_address_fits() -> bool:
    """Whether multiprocessing's fork server can listen here: on a Unix socket at
    TMPDIR/pymp-XXXXXXXX/listener-XXXXXXXX, whose path must fit in 107 bytes (a long TMPDIR, as
    pytest's tmp_path gives, does not: bind() fails with "AF_UNIX path too long")."""
    from multiprocessing import forkserver, process

    if getattr(forkserver._forkserver, "_forkserver_address", None):  # already listening
        return True
    folder = process.current_process()._config.get("tempdir") or os.path.join(tempfile.gettempdir(), "pymp-" + "x" * 8)
    return len(os.path.join(folder, "listener-" + "x" * 8).encode()) <= 107


def rank_context(start_method: str):
    """multiprocessing's context that starts the ranks.

    forkserver: multiprocessing starts one server process per launcher, which imports torch
    once; each rank is a fork of it, so a rank starts without importing torch again. The server
    has no threads and has initialised nothing (no process group, no CUDA), which is what makes
    forking it safe; it exits when the launcher does. spawn: each rank is a fresh interpreter.
    With either, a rank imports the launcher's main module first (so a script calls run() under
    `if __name__ == "__main__":`) and takes the launcher's environment as it was at the start.
    """
    ctx = mp.get_context(start_method)
    if start_method == "forkserver":
        ctx.set_forkserver_preload(PRELOAD)
    return ctx


AS_SPAWNED = os.path.join(os.path.dirname(os.path.abspath(__file__)), "as_spawned.py")
_PREPARING = threading.Lock()


class _AsSpawned:
    """Unpickled first in a forked rank (it leads multiprocessing's preparation data), this runs
    as_spawned.py there with the launcher's environment, stdout and stderr as they are now."""

    def __init__(self, environ: Dict[str, str]):
        self.environ = environ

    def __reduce__(self):
        from multiprocessing.reduction import DupFd  # descriptors passed along with the rank's own

        return runpy.run_path, (AS_SPAWNED, {"environ": self.environ, "std_fds": [DupFd(1), DupFd(2)]})


@contextlib.contextmanager
def _started_as_if_spawned(start_method: str):
    """While a rank starts: multiprocessing's preparation data (what a new rank unpickles before
    it imports the launcher's main module) leads with _AsSpawned. Spawned ranks need nothing."""
    if start_method != "forkserver":
        yield
        return
    with _PREPARING:
        original = mp.spawn.get_preparation_data

        def preparation_data(name):
            return {"collectives_as_spawned": _AsSpawned(dict(os.environ)), **original(name)}

        mp.spawn.get_preparation_data = preparation_data
        try:
            yield
        finally:
            mp.spawn.get_preparation_data = original


def _not_while_a_rank_imports_main() -> None:
    """A spawned rank imports the launching script as __mp_main__; a script that calls run() at
    module level (no `if __name__ == "__main__":`) would call it again in every rank, and each
    would print multiprocessing's 60-line bootstrap traceback. Say it in one line and leave."""
    if getattr(mp.current_process(), "_inheriting", False):
        print(f"{mp.current_process().name}: collectives.run() was called while this rank imported your "
              "main module; call it under `if __name__ == \"__main__\":`", file=sys.stderr, flush=True)
        raise SystemExit(1)


IN_STEP_TIMEOUT_S = 10.0  # the check after a failure is local to each rank: it answers at once or not at all


def _world_sequence_number(env) -> Optional[int]:
    """The calls this rank has issued on the world's group (None where the backend keeps no count)."""
    import torch.distributed as dist

    try:
        return int(dist.group.WORLD._get_sequence_number_for_group())
    except (AttributeError, RuntimeError, NotImplementedError):
        return None


# Pools with ranks running. Ranks are not daemonic processes (daemons may not have children), so
# multiprocessing joins them when this process exits; a pool left open would then wait for ranks
# that wait for this process. This exit handler, registered after multiprocessing's own and so run
# before it, kills them first.
_LIVE: "weakref.WeakSet[RankPool]" = weakref.WeakSet()


@atexit.register
def _kill_live_pools() -> None:
    for pool in list(_LIVE):
        pool._kill()


def pickled(fn, args, name: Optional[str] = None) -> bytes:
    """(fn, args) as the ranks receive them; a TypeError naming what does not pickle, before any rank starts."""
    try:
        return pickle.dumps((fn, tuple(args)))
    except Exception as exc:
        raise TypeError(
            f"cannot send {name or getattr(fn, '__qualname__', repr(fn))} to the ranks: {exc}. Define the function "
            "at module level (not a lambda or a nested function) and pass picklable args."
        ) from exc


def check_call(fn, args, timeout) -> None:
    """What submit() and run() take: a function, a tuple or list of arguments, a timeout."""
    if not callable(fn):
        raise TypeError(f"fn must be a function, got {type(fn).__name__} {fn!r}")
    if isinstance(args, (str, bytes)) or not isinstance(args, (tuple, list)):
        raise TypeError(f"args must be a tuple or list of positional arguments, got {type(args).__name__} {args!r}")
    _check_timeout(timeout, "timeout")


def _check_world_size(world_size) -> None:
    if not isinstance(world_size, int) or isinstance(world_size, bool):
        raise TypeError(f"world_size must be an int, got {type(world_size).__name__} {world_size!r}")
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")


def _check_timeout(timeout, name: str) -> None:
    if not isinstance(timeout, (int, float)) or isinstance(timeout, bool):
        raise TypeError(f"{name} must be a number of seconds, got {type(timeout).__name__} {timeout!r}")
    if not math.isfinite(timeout) or timeout <= 0:
        raise ValueError(f"{name} must be a positive, finite number of seconds, got {timeout!r}")
