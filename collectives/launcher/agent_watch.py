"""A worker started by torchrun says, in one line, when its host's agent is gone.

torchrun starts each worker in a session of its own and sets no parent-death signal, so an agent
killed with SIGKILL leaves its workers running. Measured on two namespace hosts (2 x 2 ranks,
tests/multinode/test_elastic.py): nothing restarts, the orphaned workers and the others finish the
run (bitwise what an uninterrupted run gives), and the other host's torchrun then waits at torch's
exit barrier (exit_barrier_timeout, 300 s) for the dead agent. Nothing in torch says any of this.

`init_from_env()` calls `watch_agent()` in every worker torchrun starts: a daemon thread that
sees within a second that the worker's parent changed (and the worker looks once more as it
exits, so a worker that ends sooner still says it) and writes to stderr

    rank 2 on host node1: this host's torchrun agent (pid 4242) is gone: this worker goes on ...

No thread outside torchrun (TORCHELASTIC_RUN_ID unset).
"""

from __future__ import annotations

import atexit
import os
import socket
import sys
import threading
import time
from typing import Mapping, Optional, TextIO


def agent_gone_line(rank: int, host: str, agent_pid: int) -> str:
    return (f"rank {rank} on host {host}: this host's torchrun agent (pid {agent_pid}) is gone: this worker goes "
            "on and the job can still finish, but nothing will restart a worker on this host, and the other hosts' "
            "torchrun will wait at torch's exit barrier (300 s by default) for this host's agent")


def watch_agent(rank: int, environ: Optional[Mapping[str, str]] = None, interval: float = 1.0,
                stream: Optional[TextIO] = None) -> Optional[threading.Thread]:
    """Start the watch when this process was started by torchrun's agent; the thread, or None."""
    environ = os.environ if environ is None else environ
    if "TORCHELASTIC_RUN_ID" not in environ:
        return None
    agent = os.getppid()
    said = threading.Lock()  # held once the line is out: said once, by the thread or at exit

    def say_if_gone() -> bool:
        if os.getppid() == agent:
            return False
        if said.acquire(blocking=False):
            print(agent_gone_line(rank, socket.gethostname(), agent), file=stream or sys.stderr, flush=True)
        return True

    def watch():
        while not say_if_gone():
            time.sleep(interval)

    # A worker that ends within `interval` of its agent's death (a loaded machine, a short run) would
    # end before the thread looks again, without a word: look once more on the way out.
    atexit.register(say_if_gone)
    thread = threading.Thread(target=watch, name="collectives-agent-watch", daemon=True)
    thread.start()
    return thread
