"""What this machine and its processes are, read one way by every part that asks: the CPUs this
process may run on, the memory the kernel can give, whether a process runs, and what runs below it.

    from collectives.machine import alive, cpus, cpu_set, available_memory, descendants
    alive(os.getpid())    # True
    descendants(pid)      # every process below pid: its children, theirs, ...
    cpus()                # 2: the CPUs this process's affinity allows, not the machine's count

The shm backend's peer checks and its wait, the programs' memory checks, the reaper and the test
hosts' cluster all ask here. Standard library only: the reaper, run by path with `python -I -S`,
loads this file by path too.
"""

from __future__ import annotations

import os
from typing import Optional


def cpu_set() -> set:
    """The CPUs this process may run on (its affinity: what taskset or a cgroup leaves), not the machine's."""
    return set(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))


def cpus() -> int:
    """How many CPUs this process may run on (cpu_set)."""
    return len(cpu_set())


def available_memory() -> Optional[int]:
    """Bytes of memory the kernel says can be allocated without swapping (MemAvailable), or None."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


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


def descendants(pid: int) -> list:
    """Every process below `pid` (children, their children, ...), from each process's parent in
    /proc; a process that ends while it is read is left out."""
    children: dict = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    found, stack = [], [pid]
    while stack:
        for child in children.get(stack.pop(), []):
            found.append(child)
            stack.append(child)
    return found
