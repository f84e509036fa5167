"""How a pool starts its ranks: forkserver (each rank a fork of a server that imported torch once)
or spawn (each a fresh interpreter), and what a forked rank runs first so that it starts as a
spawned one would (as_spawned.py).

    ctx = rank_context(start_method_for())      # the one asked for, COLLECTIVES_START_METHOD, or the default
    with started_as_if_spawned(start_method):
        ctx.Process(...).start()
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import multiprocessing.spawn
import os
import runpy
import sys
import tempfile
import threading
from typing import Dict, Optional

START_METHODS = ("forkserver", "spawn")
# What the fork server imports once, before it forks any rank: the seconds each spawned rank
# would spend importing them itself.
PRELOAD = ["torch", "torch.distributed"]
# What a rank that trains imports on top: torch._dynamo, which the first torch.optim optimizer or
# torch DDP a process makes imports (about 1.2 s of CPU on a 2-core VM, in every such rank).
TRAINING = ("torch._dynamo",)


def preload(*modules: str) -> bool:
    """Have the fork server import `modules` too, once, so that its ranks start with them: a
    program whose ranks train calls `preload(*TRAINING)` before it starts any. Ranks that never
    use them pay nothing more, but the server's start takes that much longer. False if the fork
    server of this process has already started (the call then changes nothing).

    torch._dynamo makes torch's compile cache folder as it is imported: the server takes this
    process's environment, so TORCHINDUCTOR_CACHE_DIR is pointed outside /tmp here first, as each
    rank does for itself (cli.compile_cache_outside_tmp; a folder the user chose is kept)."""
    from multiprocessing import forkserver

    from ..cli import compile_cache_outside_tmp

    if getattr(forkserver._forkserver, "_forkserver_pid", None) is not None:
        return False
    if "torch._dynamo" in modules:
        compile_cache_outside_tmp()
    PRELOAD.extend(m for m in modules if m not in PRELOAD)
    return True


def start_method_for(start_method: Optional[str] = None) -> str:
    """The start method a pool uses: the one asked for, else COLLECTIVES_START_METHOD, else
    forkserver where multiprocessing has it (Linux, macOS), else spawn."""
    chosen = start_method or os.environ.get("COLLECTIVES_START_METHOD") or (
        "forkserver" if "forkserver" in mp.get_all_start_methods() and forkserver_address_fits() else "spawn")
    if chosen not in START_METHODS:
        where = "start_method" if start_method else "COLLECTIVES_START_METHOD"
        raise ValueError(f"{where} must be one of {', '.join(START_METHODS)}, got {chosen!r}")
    if chosen == "forkserver" and not forkserver_address_fits():
        raise ValueError(f"start method forkserver: its socket in {tempfile.gettempdir()} would have a path longer "
                         "than a Unix socket's 107 bytes; set a shorter TMPDIR, or use start method spawn")
    return chosen


def forkserver_address_fits() -> bool:
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
def started_as_if_spawned(start_method: str):
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


def not_while_a_rank_imports_main() -> None:
    """A spawned rank imports the launching script as __mp_main__; a script that calls run() at
    module level (no `if __name__ == "__main__":`) would call it again in every rank, and each
    would print multiprocessing's 60-line bootstrap traceback. Say it in one line and leave."""
    if getattr(mp.current_process(), "_inheriting", False):
        print(f"{mp.current_process().name}: collectives.run() was called while this rank imported your "
              "main module; call it under `if __name__ == \"__main__\":`", file=sys.stderr, flush=True)
        raise SystemExit(1)
