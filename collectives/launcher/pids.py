"""Whether a process runs, read one way by every part that asks (the shm backend's peer checks,
the reaper, the test hosts' cluster): from /proc/<pid>/stat's state field.

    from collectives.launcher.pids import alive
    alive(os.getpid())   # True

Standard library only: the reaper, run by path with `python -I -S`, loads this file by path too.
"""

from __future__ import annotations


def alive(pid: int) -> bool:
    """Whether a process with this pid runs: it exists, and is neither a zombie (Z: it exited and
    waits for its parent to reap it) nor dead (X). A pid whose stat cannot be read for another
    reason than being gone (another user's process under hidepid) exists, so it counts as
    running: a peer is never declared dead, nor a host idle, on a read error."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return False
    except OSError:
        return True
    fields = text.rsplit(")", 1)[-1].split()  # the command in (...) may hold spaces and parentheses
    return bool(fields) and fields[0] not in ("Z", "X")
