"""A worker whose torchrun agent is killed says so in one line (collectives/launcher/agent_watch.py); one
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

import pytest

from collectives.launcher import agent_watch

WORKER = textwrap.dedent("""
    import os, time
    from collectives.launcher.agent_watch import watch_agent
    assert watch_agent(2, interval=0.05) is not None
    print(os.getpid(), os.getppid(), flush=True)
    time.sleep(30)
""")
# A worker that ends soon after its agent died, before its watch looks again (60 s apart here).
SHORT_WORKER = textwrap.dedent("""
    import os, time
    from collectives.launcher.agent_watch import watch_agent
    assert watch_agent(2, interval=60) is not None
    parent = os.getppid()
    print(os.getpid(), parent, flush=True)
    while os.getppid() == parent:
        time.sleep(0.02)
""")
AGENT = textwrap.dedent("""
    import os, subprocess, sys, time
    env = {**os.environ, "TORCHELASTIC_RUN_ID": "job"}
    subprocess.Popen([sys.executable, "-c", sys.argv[1]], env=env, start_new_session=True,
                     stdout=open(sys.argv[2], "w"), stderr=open(sys.argv[3], "w"))
    time.sleep(30)
""")


def _running(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _start(tmp_path, worker=WORKER):
    out, err = tmp_path / "out", tmp_path / "err"
    agent = subprocess.Popen([sys.executable, "-c", AGENT, worker, str(out), str(err)])
    deadline = time.monotonic() + 30
    while not (out.exists() and out.read_text().strip()):
        assert time.monotonic() < deadline, "the worker did not start"
        time.sleep(0.05)
    worker, parent = map(int, out.read_text().split())
    assert parent == agent.pid
    return agent, worker, err


@pytest.mark.slow
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


@pytest.mark.slow
def test_a_worker_that_ends_before_its_watch_looks_again_still_says_so_once(tmp_path):
    agent, worker, err = _start(tmp_path, SHORT_WORKER)
    agent.kill()
    agent.wait()
    deadline = time.monotonic() + 10
    while _running(worker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _running(worker), "the worker did not end once its agent was gone"
    assert err.read_text().splitlines() == [agent_watch.agent_gone_line(2, os.uname().nodename, agent.pid)]


def test_without_torchrun_there_is_no_watch():
    assert agent_watch.watch_agent(0, environ={}) is None
