"""The reaper: one small process per RankPool that kills everything the pool's ranks started,
however the pool ends, without asking any rank to do it.

    python -I -S collectives/launcher/reaper.py MARK     # stdin: a pipe whose only writer is the launcher
                                                # (the ranks' pids, one a line)

The launcher (pool.py) starts the reaper first, then starts its ranks with `MARK=1` in their
environment, and writes each rank's pid to the reaper's stdin, one a line. Every process a rank
starts inherits that environment: DataLoader workers, a `subprocess` child, a grandchild that
left for a session of its own (`start_new_session=True`), a nested pool's ranks. When the
reaper's stdin reads end-of-file (the launcher closed the pool, or died in any way, SIGKILL
included) it SIGKILLs every process whose environment, as `/proc/PID/environ` shows it, holds the
mark, and every process in a rank's process group (each rank leads one), and scans again until a
scan finds none.

It also removes the folders the launcher names (the ranks' temporary folder, where their
multiprocessing sockets live, and, if the launcher itself was killed, the launcher's own
multiprocessing folder with the fork server's socket): a SIGKILLed process removes nothing.

Why the pids as well: `/proc/PID/environ` is the environment a process was *exec'd* with. A rank
forked from the fork server (start_methods.rank_context) and whatever it forks without exec (DataLoader
workers) show the server's, which has no mark; they stay in the rank's process group, and what
they exec carries the mark again.

Why not something inside the ranks: a rank's watcher thread needs the rank's interpreter, and a
rank in one long C call that holds Python's global lock never runs it; a process group misses a
grandchild in a session of its own; PR_SET_PDEATHSIG kills only the rank, and fires when the
*thread* that started it exits. The mark is Jenkins' ProcessTreeKiller idea (it marks builds with
BUILD_ID). What escapes it: a process that starts a child with an empty environment (`env -i`), and, with
forked ranks, a process a rank forks without exec that then leaves the rank's process group.
Needs /proc (Linux); elsewhere the reaper exits at once and the ranks' process groups are all
that is killed.

Stdlib only, run by path with -S: it starts in tens of milliseconds and imports neither torch
nor this package.
"""

import os
import shutil
import signal
import subprocess
import sys
import time

MARK_PREFIX = "COLLECTIVES_RUN_"
SETTLE_S = 0.2  # a process forked but not yet exec'd shows its parent's environment: after a kill, look again


def marked(mark: bytes):
    """Pids of the processes whose environment holds `mark` (bytes such as b"COLLECTIVES_RUN_ab12=1")."""
    me = os.getpid()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                variables = f.read().split(b"\0")
        except OSError:  # gone already, or another user's
            continue
        if mark in variables:
            found.append(int(entry))
    return found


def in_groups(groups):
    """Pids of the processes whose process group is one of `groups` (a set of process group ids)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                pgrp = int(f.read().rsplit(")", 1)[1].split()[2])
        except (OSError, IndexError, ValueError):
            continue
        if pgrp in groups:
            found.append(int(entry))
    return found


def sweep(mark: bytes, ranks=(), give_up_after: float = 10.0) -> int:
    """SIGKILL every marked process, and every rank in `ranks` with its process group, until a
    scan finds none (and, once something was killed, a second scan SETTLE_S later finds none too);
    returns how many were killed."""
    killed, settled = set(), False
    ranks = set(ranks) - {os.getpid()}
    deadline = time.monotonic() + give_up_after
    while time.monotonic() < deadline:
        pids = sorted(set(marked(mark)) | (set(in_groups(ranks)) | {p for p in ranks if _exists(p)}) - {os.getpid()})
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
                killed.add(pid)
            except (ProcessLookupError, PermissionError):
                pass
        if pids:
            settled = False
            time.sleep(0.02)
        elif not killed or settled:
            break
        else:
            settled = True
            time.sleep(SETTLE_S)
    return len(killed)


def _load_machine():
    """collectives/machine.py, loaded by path: this file runs by path with -I -S, where no package imports."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "_collectives_machine", os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "machine.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_exists = _load_machine().alive  # a process with this pid runs (not a zombie)


class Reaper:
    """The launcher's handle: `Reaper()` starts the process; put `reaper.mark` in the environment
    of what it must clean up after; `reaper.sweep_now()` closes the pipe and waits for the sweep."""

    def __init__(self):
        self.mark = MARK_PREFIX + os.urandom(8).hex()
        env = {k: v for k, v in os.environ.items() if not k.startswith(MARK_PREFIX)}  # the reaper is nobody's target
        self._proc = subprocess.Popen([sys.executable, "-I", "-S", os.path.abspath(__file__), self.mark],
                                      stdin=subprocess.PIPE, env=env, start_new_session=True)

    def watch(self, pid: int) -> None:
        """Kill this rank, and its process group, too when the sweep comes."""
        if self._proc.stdin and not self._proc.stdin.closed:
            try:
                self._proc.stdin.write(f"{pid}\n".encode())
                self._proc.stdin.flush()
            except (BrokenPipeError, OSError):  # the reaper is gone: the ranks' own lifelines remain
                pass

    def remove_after(self, folder: str, only_if_launcher_died: bool = False) -> None:
        """Remove this folder after the sweep (with only_if_launcher_died: only when the
        launcher is dead by then, for a folder the launcher itself still uses while it lives)."""
        if self._proc.stdin and not self._proc.stdin.closed:
            try:
                self._proc.stdin.write(f"{'launcher-' if only_if_launcher_died else ''}folder {folder}\n".encode())
                self._proc.stdin.flush()
            except (BrokenPipeError, OSError):
                pass

    def sweep_now(self, timeout: float = 15.0) -> None:
        if self._proc.stdin and not self._proc.stdin.closed:
            self._proc.stdin.close()
        try:
            self._proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()


def main(argv) -> int:
    if len(argv) != 2 or not argv[1].startswith(MARK_PREFIX):
        print(f"usage: python {os.path.basename(__file__)} {MARK_PREFIX}<hex>  (stdin: the launcher's pipe)",
              file=sys.stderr)
        return 2
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the launcher; the reaper cleans up after it
    if not os.path.isdir("/proc"):
        return 0
    launcher = os.getppid()
    ranks, folders, launcher_folders = set(), [], []
    for line in sys.stdin.buffer:  # the ranks' pids and folders to remove; end-of-file is the signal
        line = line.rstrip(b"\n")
        if line.strip().isdigit():
            ranks.add(int(line))
        elif line.startswith(b"folder "):
            folders.append(os.fsdecode(line[len(b"folder "):]))
        elif line.startswith(b"launcher-folder "):
            launcher_folders.append(os.fsdecode(line[len(b"launcher-folder "):]))
    sweep(f"{argv[1]}=1".encode(), ranks)
    if not _exists(launcher):  # killed: its own folder (the fork server's socket) has nobody left to remove it
        folders += launcher_folders
    for folder in folders:
        shutil.rmtree(folder, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
