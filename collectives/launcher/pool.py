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

What each rank runs is rank_main.py; this file is the parent's side: the pool's life (start, submit,
collect, close). Why a call failed is diagnosis.py's, how ranks start start_methods.py's, and what a
call is checked for call_checks.py's.
"""

from __future__ import annotations

import atexit
import datetime
import multiprocessing as mp
import multiprocessing.connection
import multiprocessing.forkserver
import multiprocessing.resource_tracker
import multiprocessing.spawn
import multiprocessing.util  # registers its exit handler now, so that ours (below) runs before it
import os
import pickle
import shutil
import signal
import sys
import tempfile
import time
import weakref
from typing import Any, Callable, Dict, List, Optional, Sequence

from .call_checks import check_call, check_timeout, check_world_size, pickled
from .diagnosis import FAILURE_GRACE_S, FailureDiagnosis
from .env import check_settings
from .rank_main import run_rank
from .reaper import Reaper
from .start_methods import not_while_a_rank_imports_main, rank_context, start_method_for, started_as_if_spawned



class RankPool(FailureDiagnosis):
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
        check_world_size(world_size)
        if threads is not None and (not isinstance(threads, int) or isinstance(threads, bool) or threads < 0):
            raise ValueError(f"threads must be a non-negative int (0: torch's default), got {threads!r}")
        check_timeout(start_timeout, "start_timeout")
        from .env import pick_backend

        self.world_size = world_size
        self.backend = pick_backend(world_size, backend)
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
        not_while_a_rank_imports_main()
        if self.alive:
            return self
        self._kill()
        check_settings(self.backend)  # before any rank starts (the ranks' environment is this one, now)
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
                with started_as_if_spawned(self.start_method):
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
        self._send_call(payload, name, self.start_timeout)
        return self._collect(name, timeout, expect="ok")

    def _send_call(self, payload: bytes, what: str, load_timeout: float) -> None:
        """Send a pickled call to every rank and wait until each has unpickled it. Importing the
        function's module (a test file that imports pytest, say) can take seconds on a busy
        machine, and is not part of the call: its timeout starts once every rank has loaded it."""
        __tracebackhide__ = True
        self._send(payload)
        self._collect(f"{what} (unpickling it)", load_timeout, expect="loaded")

    def _send(self, payload: bytes) -> None:
        """A pickled call to every rank, with this process's sys.path (so test modules resolve
        there too); each answers "loaded", then "ok" or "error" (rank_main.py)."""
        for conn in self._conns:
            conn.send((payload, list(sys.path)))

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



# Pools with ranks running. Ranks are not daemonic processes (daemons may not have children), so
# multiprocessing joins them when this process exits; a pool left open would then wait for ranks
# that wait for this process. This exit handler, registered after multiprocessing's own and so run
# before it, kills them first.
_LIVE: "weakref.WeakSet[RankPool]" = weakref.WeakSet()


@atexit.register
def _kill_live_pools() -> None:
    for pool in list(_LIVE):
        pool._kill()


