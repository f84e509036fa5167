"""One answer to "does this process run?" for the shm backend's peer checks, the reaper and the
test hosts' cluster (they disagreed: a zombie or an unreadable pid read as dead in one place and
alive in another): a running process, a zombie, a reaped (dead) pid and an unreadable stat.

    pytest tests/collectives/test_machine_alive.py -q
"""

import builtins
import os
import subprocess
import sys
import time

import pytest

from collectives.cluster import hosts
from collectives import machine
from collectives.launcher import reaper
from collectives.shm import wait

ASKERS = {"machine.alive": machine.alive, "shm peer check": wait.process_alive, "reaper": reaper._exists,
          "cluster": hosts._running}


def _zombie():
    """A child that has exited and is not reaped yet."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        with open(f"/proc/{child.pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                return child
        time.sleep(0.01)
    raise AssertionError("the child did not become a zombie")


@pytest.mark.parametrize("asker", list(ASKERS))
def test_running_zombie_and_dead_processes(asker):
    alive = ASKERS[asker]
    assert alive(os.getpid())
    child = _zombie()
    try:
        assert not alive(child.pid), "a zombie has exited"
    finally:
        child.wait()
    assert not alive(child.pid), "reaped: gone"
    assert not alive(2 ** 22 + 12345)  # past pid_max's largest value: no such process


@pytest.mark.parametrize("asker", list(ASKERS))
def test_a_stat_that_cannot_be_read_is_a_process_that_exists(asker, monkeypatch):
    """Another user's process under hidepid: /proc/<pid>/stat refuses to be read, but the
    process is there; a peer is not declared dead, nor a host idle, on that."""
    real_open = builtins.open

    def refusing(path, *args, **kwargs):
        if str(path).startswith("/proc/") and str(path).endswith("/stat"):
            raise PermissionError(13, "Permission denied")
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", refusing)
    assert ASKERS[asker](os.getpid())


def test_a_command_with_parentheses_and_spaces_is_read_past(tmp_path):
    """stat's second field is the command in parentheses, which may hold ') Z (': the state is
    after the last ')'."""
    import shutil

    odd = tmp_path / ") Z (x"
    odd.symlink_to(shutil.which("sleep"))
    child = subprocess.Popen([str(odd), "30"])
    try:
        time.sleep(0.2)
        with open(f"/proc/{child.pid}/stat") as f:
            assert f.read().startswith(f"{child.pid} () Z (x) ")  # the name the kernel shows
        assert machine.alive(child.pid)
    finally:
        child.kill()
        child.wait()
