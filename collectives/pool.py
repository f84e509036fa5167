"""A pool of spawned ranks that stay alive and run one function after another.

Spawning ranks costs seconds (each imports torch); sending a function to ranks that are already
up costs milliseconds. `collectives.run` uses a pool for one call; `collectives.testing` keeps
pools alive across tests. Either way, if any rank raises, dies (signal, os._exit, Gloo's
SIGABRT) or is still running at the timeout, every rank is stopped, none is left behind, and the
caller gets one `RankFailure` naming the ranks, with each one's traceback, signal, exit code or
(for a hang) Python stack.

    with RankPool(world_size=2) as pool:
        print(pool.submit(my_fn, args=(3,)))    # my_fn(env, 3) on each rank, results in rank order
"""

from __future__ import annotations

import faulthandler
import multiprocessing as mp
import multiprocessing.connection
import os
import pickle
import shutil
import signal
import sys
import tempfile
import time
import traceback
from typing import Any, Callable, Dict, List, Optional, Sequence

from .errors import RankFailure

# After the first rank fails, how long the others get to report their own error (in checked
# mode every rank raises the same mismatch; all of their messages are worth showing).
FAILURE_GRACE_S = 3.0
STACK_DUMP_WAIT_S = 1.0


def _rank_main(rank, world_size, backend, init_method, conn, stack_path, threads):
    """Body of one spawned rank: join the group, then run what the parent sends until None."""
    os.setpgid(0, 0)  # own process group, so the parent can kill the rank and its children
    stack_file = open(stack_path, "w")
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    try:
        import torch
        import torch.distributed as dist

        from .env import DEFAULT_PG_TIMEOUT, DistEnv, device_for

        if threads:
            torch.set_num_threads(threads)
        device = device_for(backend, rank)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(
            backend, init_method=init_method, rank=rank, world_size=world_size, timeout=DEFAULT_PG_TIMEOUT
        )
        env = DistEnv(rank=rank, world_size=world_size, local_rank=rank, device=device, backend=backend)
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        return
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
            fn, args = pickle.loads(payload)
            result = fn(env, *args)
            reply = ("ok", pickle.dumps(result))
        except BaseException:
            reply = ("error", traceback.format_exc())
        conn.send(reply)
    try:
        dist.destroy_process_group()
    except Exception:
        pass


def _describe_exit(code: Optional[int]) -> str:
    if code is None:
        return "is still running"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        hint = " (Gloo aborts like this on a size or dtype mismatch)" if name == "SIGABRT" else ""
        return f"died from {name}{hint}"
    return f"exited with code {code} without reporting a result"


class RankPool:
    """`world_size` spawned ranks with an initialised process group, reused across calls.

    Args:
        world_size: number of ranks to spawn.
        backend: "gloo" or "nccl"; None picks NCCL only with one GPU per rank, else Gloo.
        threads: torch threads per rank (1 by default: ranks share the machine's cores).
        start_timeout: seconds to wait for every rank to import torch and join the group.
    """

    def __init__(self, world_size: int, backend: Optional[str] = None, threads: int = 1, start_timeout: float = 120.0):
        if world_size < 1:
            raise ValueError(f"world_size must be at least 1, got {world_size}")
        from .env import pick_backend

        self.world_size = world_size
        self.backend = pick_backend(world_size, backend)
        self.threads = threads
        self.start_timeout = start_timeout
        self._procs: List[mp.process.BaseProcess] = []
        self._conns: List[mp.connection.Connection] = []
        self._tmpdir: Optional[str] = None

    # -- life cycle ---------------------------------------------------------------------------
    @property
    def alive(self) -> bool:
        return bool(self._procs) and all(p.is_alive() for p in self._procs)

    def start(self) -> "RankPool":
        if self.alive:
            return self
        self.close()
        self._tmpdir = tempfile.mkdtemp(prefix="collectives-pool-")
        # A file rendezvous: no port to pick, so parallel runs never collide.
        init_method = "file://" + os.path.join(self._tmpdir, "store")
        ctx = mp.get_context("spawn")
        for rank in range(self.world_size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=_rank_main,
                args=(rank, self.world_size, self.backend, init_method, child, self._stack_path(rank), self.threads),
                daemon=True,
                name=f"rank{rank}",
            )
            proc.start()
            child.close()
            self._procs.append(proc)
            self._conns.append(parent)
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
        for conn in self._conns:
            conn.close()
        self._procs, self._conns = [], []
        if self._tmpdir:
            shutil.rmtree(self._tmpdir, ignore_errors=True)
            self._tmpdir = None

    def __enter__(self) -> "RankPool":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    # -- running --------------------------------------------------------------------------------
    def submit(self, fn: Callable, args: Sequence[Any] = (), timeout: float = 60.0, name: Optional[str] = None) -> List[Any]:
        """Run `fn(env, *args)` on every rank; return the results in rank order.

        `fn` and `args` must pickle (a function defined at module level, not a lambda).
        On any failure the pool is torn down (the next submit starts a fresh one) and
        `RankFailure` is raised.
        """
        name = name or getattr(fn, "__qualname__", repr(fn))
        try:
            payload = pickle.dumps((fn, tuple(args)))
        except Exception as exc:
            raise TypeError(
                f"cannot send {name} to the ranks: {exc}. Define the function at module level "
                "(not a lambda or a nested function) and pass picklable args."
            ) from exc
        self.start()
        for conn in self._conns:
            conn.send((payload, list(sys.path)))
        return self._collect(name, timeout, expect="ok")

    def _collect(self, what: str, timeout: float, expect: str) -> List[Any]:
        results: Dict[int, Any] = {}
        failures: Dict[int, str] = {}
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
                conn = self._conns[rank]
                if conn.poll():
                    try:
                        status, value = conn.recv()
                    except (EOFError, OSError):
                        status, value = "died", None
                else:
                    status, value = "died", None
                if status == "died":
                    self._procs[rank].join(1.0)
                    failures[rank] = f"rank {rank} {_describe_exit(self._procs[rank].exitcode)}"
                elif status == "error":
                    failures[rank] = f"rank {rank} raised:\n{value}"
                elif status == expect:
                    results[rank] = pickle.loads(value) if status == "ok" else None
                else:
                    failures[rank] = f"rank {rank} sent an unexpected {status!r}"
                pending.discard(rank)
                if rank in failures and first_failure_at is None:
                    first_failure_at = time.monotonic()
        if not failures and not pending:
            return [results[r] for r in range(self.world_size)]
        if pending:  # hung (timeout), or still busy after another rank failed
            stacks = self._dump_stacks(sorted(pending))
            why = (
                f"was still running {FAILURE_GRACE_S:.0f} s after rank {min(failures)} failed"
                if failures
                else f"did not finish within the {timeout:g} s timeout"
            )
            for rank in sorted(pending):
                failures[rank] = f"rank {rank} {why}; its Python stack:\n{stacks.get(rank) or '(no stack captured)'}"
        self._kill()
        header = (
            f"{len(failures)} of {self.world_size} rank(s) failed in {what} "
            f"(world_size={self.world_size}, backend={self.backend}): ranks {sorted(failures)}"
        )
        body = "\n".join(f"----- {failures[r]}".rstrip() for r in sorted(failures))
        if what == "start-up" and any("exited with code 1" in f for f in failures.values()):
            body += (
                "\nHint: the ranks are spawned, so each one imports your main module first; a script that "
                "calls collectives.run() must do it under `if __name__ == \"__main__\":` (the ranks' own "
                "error output, above this message, says more)."
            )
        raise RankFailure(f"{header}\n{body}", failures)

    # -- hang diagnosis ---------------------------------------------------------------------------
    def _stack_path(self, rank: int) -> str:
        return os.path.join(self._tmpdir, f"stack-rank{rank}.txt")

    def _dump_stacks(self, ranks: List[int]) -> Dict[int, str]:
        for rank in ranks:
            try:
                os.kill(self._procs[rank].pid, signal.SIGUSR1)  # faulthandler writes the stack
            except ProcessLookupError:
                pass
        time.sleep(STACK_DUMP_WAIT_S)
        stacks = {}
        for rank in ranks:
            try:
                with open(self._stack_path(rank)) as f:
                    lines = f.read().strip().splitlines()
            except OSError:
                continue
            # The spawn bootstrap frames say nothing about where the rank is stuck.
            stacks[rank] = "\n".join(
                ln for ln in lines if "multiprocessing/" not in ln and '"<string>"' not in ln and __file__ not in ln
            )
        return stacks
