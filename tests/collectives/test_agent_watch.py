"""A worker whose torchrun agent is killed says so in one line (collectives/agent_watch.py); one
whose agent lives, or that torchrun did not start, says nothing. An "agent" here is a small
process that starts a worker as torchrun does (a session of its own, TORCHELASTIC_RUN_ID set).

    pytest tests/collectives/test_agent_watch.py -q
"""

import os
import signal
import subprocess
import sys
import textwrap
import time

from collectives import agent_watch

WORKER = textwrap.dedent("""
    import os, time
    from collectives.agent_watch import watch_agent
    assert watch_agent(2, interval=0.05) is not None
    print(os.getpid(), os.getppid(), flush=True)
    time.sleep(30)
""")
AGENT = textwrap.dedent("""
    import os, subprocess, sys, time
    env = {**os.environ, "TORCHELASTIC_RUN_ID": "job"}
    subprocess.Popen([sys.executable, "-c", sys.argv[1]], env=env, start_new_session=True,
                     stdout=open(sys.argv[2], "w"), stderr=open(sys.argv[3], "w"))
    time.sleep(30)
""")


def _start(tmp_path):
    out, err = tmp_path / "out", tmp_path / "err"
    agent = subprocess.Popen([sys.executable, "-c", AGENT, WORKER, str(out), str(err)])
    deadline = time.monotonic() + 30
    while not (out.exists() and out.read_text().strip()):
        assert time.monotonic() < deadline, "the worker did not start"
        time.sleep(0.05)
    worker, parent = map(int, out.read_text().split())
    assert parent == agent.pid
    return agent, worker, err


def test_a_worker_whose_agent_is_killed_says_so_in_one_line(tmp_path):
    agent, worker, err = _start(tmp_path)
    try:
        time.sleep(0.5)
        assert err.read_text() == ""  # the agent lives: nothing said
        agent.kill()
        agent.wait()
        deadline = time.monotonic() + 5
        while not err.read_text() and time.monotonic() < deadline:
            time.sleep(0.05)
        lines = err.read_text().splitlines()
        assert lines == [agent_watch.agent_gone_line(2, os.uname().nodename, agent.pid)], lines
        assert lines[0].startswith(f"rank 2 on host {os.uname().nodename}: this host's torchrun agent (pid {agent.pid}) "
                                   "is gone: this worker goes on")
    finally:
        os.kill(worker, signal.SIGKILL)


def test_without_torchrun_there_is_no_watch():
    assert agent_watch.watch_agent(0, environ={}) is None
