"""How a rank waits for the others in shared memory, and notices when one of them is gone.

The ranks meet at barriers: rank r announces step k by writing k into its own word (no other
rank writes it, so no atomic operation is needed), then waits until every rank's word is at
least k (in the order of `behind`: the int32 words wrap after 2**31 steps). How it waits is the
question when ranks outnumber cores:

    spin   re-read the words in a loop: fastest when every rank has a core, but a waiting rank
           burns its core, which the rank it waits for may need
    yield  the same, giving the core away between reads (os.sched_yield)
    sleep  the same, sleeping 50 us between reads
    futex  spin up to 1 ms while every rank has a core of its own (not at all when they share
           cores, and no longer once more threads than the ranks' cores have been runnable at
           3 reads of /proc/loadavg in a row: one of them may be the rank it waits for), yield
           for 2 ms, then sleep in the kernel on the word of the first rank still missing
           (FUTEX_WAIT on the shared page) until that rank writes it and wakes it (FUTEX_WAKE);
           no core is spent on a long wait

`python -m benchmarks.studies.shm_wait --world-size N` measures all four side by side (latency and CPU
time per call); `futex` is the default, after those measurements (benchmarks/RESULTS.md, "Why are the shm backend's defaults what they are?").

Faults: while it waits, a rank checks every FAULT_CHECK_S that the others' processes are alive
and that no rank has raised the abort word; then it raises `PeerFailure` naming the rank. A
rank that fails, or times out waiting for a late rank, sets the abort word, so the others stop
at once instead of at their timeout; every call checks it after its first barrier too, so a
rank that never has to wait (the late one, whose peers are ahead) raises as well instead of
running a collective the others have given up.
"""

from __future__ import annotations

import os
import time
from typing import Optional

from ..errors import CollectiveError
from ..machine import alive, cpus
from . import futex
from .config import WAIT_STRATEGIES
from .segment import ABORT, ABORT_SEEN_BY, ABORT_WHY, STEP0, Segment

FAULT_CHECK_S = 0.05
# futex: how long to spin before sleeping in the kernel. A futex wake-up costs tens of
# microseconds, so when every rank has a core of its own a short spin is cheaper; when ranks
# outnumber cores a spinning rank takes the core from the rank it waits for, so it sleeps at once.
SPIN_S_OWN_CORE = 1e-3
SPIN_S_SHARED = 0.0
# then give the core away (sched_yield) between reads for this long before sleeping: where ranks
# share cores a yield answers sooner than a futex wake-up (benchmarks.studies.shm_wait measures both)
YIELD_S = 2e-3
# while it spins, a rank reads the machine this often, and stops spinning once more threads than
# the ranks' cores were runnable at this many reads in a row (a moment's extra thread does not stop it)
LOOK_S = 2e-5
FULL_LOOKS = 3
STRATEGIES = WAIT_STRATEGIES  # the settings (config.py) read the same names

DIED, FAILED, LATE = 0, 1, 2  # why a group was broken (the ABORT_WHY word)
_HALF, _MASK = 1 << 31, (1 << 32) - 1


def after(step: int) -> int:
    """The step after `step`. The counters are int32 words, so they wrap from 2**31 - 1 to
    -2**31: a long job passes 2**31 barriers (hours of small calls back to back)."""
    return step + 1 if step < _HALF - 1 else -_HALF


def ahead_by(a: int, b: int) -> int:
    """a - b for two such counters, across the wrap (the ranks' steps, the mailboxes' sent and
    taken counts): they are never 2**31 apart, so the 32-bit difference says it."""
    return ((a - b + _HALF) & _MASK) - _HALF


def behind(word: int, step: int) -> bool:
    """Whether a rank whose counter reads `word` has not reached `step` yet, across the wrap."""
    return ahead_by(word, step) < 0


class PeerFailure(CollectiveError):
    """A rank of the shared-memory group died or gave up while this rank waited for it."""


process_alive = alive  # a peer's process runs (machine.py: one answer for every part that asks)


_loadavg_fd: Optional[int] = None


def runnable_threads() -> int:
    """Threads running or waiting for a core on the whole machine now (/proc/loadavg's "3/612 ...":
    3), or -1 where it cannot be read."""
    global _loadavg_fd
    try:
        if _loadavg_fd is None:
            _loadavg_fd = os.open("/proc/loadavg", os.O_RDONLY | os.O_CLOEXEC)
        return int(os.pread(_loadavg_fd, 128, 0).split()[3].split(b"/")[0])
    except (OSError, IndexError, ValueError):
        return -1


class Waiter:
    """Barriers on one segment, waiting with one of STRATEGIES.

    The spin reads the machine: it stops (then yields, then sleeps) once more threads than
    `cores` (the CPUs the group's ranks may run on between them; layout.agree) have been runnable
    at FULL_LOOKS reads in a row, since one of them may be the rank it waits for, kept off a core
    by the spinner. native_wait.h does the same, and also watches that rank's run delay."""

    def __init__(self, segment: Segment, rank: int, strategy: Optional[str] = None, timeout_s: float = 600.0,
                 cores: Optional[int] = None):
        strategy = strategy or "futex"  # ShmConfig.wait, from the process group
        if strategy not in STRATEGIES:
            raise ValueError(f"wait strategy must be one of {', '.join(STRATEGIES)}, got {strategy!r}")
        if strategy == "futex" and not futex.AVAILABLE:
            strategy = "yield"  # no futex number known for this machine
        self.segment, self.rank, self.strategy, self.timeout_s = segment, rank, strategy, timeout_s
        own = cpus()
        self.spin_s_idle = SPIN_S_OWN_CORE if segment.world_size <= own else SPIN_S_SHARED
        self.spin_s = self.spin_s_idle  # the process group sets 0 while its caller computes
        # the cores the machine's runnable threads are held against
        self.machine_cores = min(cores or own, os.cpu_count() or own)
        self.step = int(segment.steps[rank])
        self.what = ""  # the collective under way, for error messages
        self.slept = self.woken = 0  # futex sleeps, and those a peer's wake ended (not the 50 ms timeout)
        self.spun = self.spins_cut = 0  # waits that spun, and those whose spin the machine reading cut short

    # -- the barrier ------------------------------------------------------------------------------
    def barrier(self) -> None:
        """Announce the next step and wait until every rank has announced it."""
        seg = self.segment
        self.step = after(self.step)
        seg.steps[self.rank] = self.step
        # the syscall only when someone sleeps (native_wait.h fences between this store and this read;
        # Python has no fence to put here)
        if self.strategy == "futex" and any(seg.sleeping):
            futex.wake(seg.address(STEP0 + self.rank))
        self.wait_for(self.step)

    def wait_for(self, step: int) -> None:
        """Until every rank's word is at least `step` (or a peer fails, or the timeout)."""
        steps = self.segment.steps
        start = time.monotonic()
        next_check = start + FAULT_CHECK_S
        spin_until = time.perf_counter() + self.spin_s
        next_look, full, spinning = spin_until - self.spin_s + LOOK_S, 0, False  # a short wait reads nothing
        while True:
            missing = -1
            for r in range(len(steps)):
                if ((int(steps[r]) - step) & _MASK) >= _HALF:  # behind(steps[r], step), inline: a spinning loop
                    missing = r
                    break
            if missing < 0:
                return
            now = time.monotonic()
            if now >= next_check:
                self._check_peers(missing, now - start)
                next_check = now + FAULT_CHECK_S
            if self.strategy == "spin":
                continue
            if self.strategy == "yield":
                os.sched_yield()
            elif self.strategy == "sleep":
                time.sleep(50e-6)
            elif (now_p := time.perf_counter()) < spin_until:
                if not spinning:
                    spinning = True
                    self.spun += 1
                if now_p >= next_look:  # more runnable threads than cores, FULL_LOOKS reads in a row
                    next_look = now_p + LOOK_S
                    full = full + 1 if runnable_threads() > self.machine_cores else 0
                    if full >= FULL_LOOKS:
                        spin_until = now_p
                        self.spins_cut += 1
                continue
            elif now_p < spin_until + YIELD_S:
                os.sched_yield()
            else:  # futex: sleep on the missing rank's word
                seen = int(steps[missing])
                if behind(seen, step):
                    # Say so first: the rank that writes the word wakes sleepers only. If it wrote
                    # in between, the kernel finds the word changed and does not sleep at all.
                    self.segment.sleeping[self.rank] = 1
                    self.slept += 1
                    self.woken += futex.wait(self.segment.address(STEP0 + missing), seen, FAULT_CHECK_S)
                    self.segment.sleeping[self.rank] = 0

    # -- faults -----------------------------------------------------------------------------------
    def _check_peers(self, missing: int, waited: float, late: str = "") -> None:
        """A peer's process gone, or `missing` later than the timeout: PeerFailure (and the abort
        word set). `late` says what the missing rank did not do (default: reach this step)."""
        seg = self.segment
        self.check_abort()
        for r, pid in enumerate(seg.pids):
            if r != self.rank and pid and not process_alive(int(pid)):
                self.abort(culprit=r, why=DIED)
                raise PeerFailure(f"{self.what} on rank {self.rank}: rank {r} (pid {pid}) died while this rank "
                                  f"waited for it")
        if waited > self.timeout_s:
            self.abort(culprit=missing, why=LATE)
            raise PeerFailure(f"{self.what} on rank {self.rank}: rank {missing} {late or f'did not reach step {self.step}'}"
                              f" within the {self.timeout_s:g} s timeout (is it in another collective, or stuck?)")

    def check_abort(self, what: str = "") -> None:
        """Raise PeerFailure if the group is broken (the abort word), naming the call (`what`,
        else the collective under way), the rank and why."""
        seg = self.segment
        culprit = int(seg.control[ABORT]) - 1
        if culprit < 0:
            return
        seen_by, why = int(seg.control[ABORT_SEEN_BY]) - 1, int(seg.control[ABORT_WHY])
        if why == LATE:
            how = (f"did not reach a collective within rank {seen_by}'s timeout, which gave up on it "
                   f"(a late rank breaks the group, as on Gloo)")
        elif why == FAILED or seen_by == culprit:
            how = "failed (its error is on that rank)"
        else:
            how = f"died (rank {seen_by} saw it)"
        raise PeerFailure(f"{what or self.what} on rank {self.rank}: rank {culprit} {how}, so this call cannot "
                          "run: the group is broken, make a new one")

    def abort(self, culprit: Optional[int] = None, why: int = FAILED) -> None:
        """Tell every other rank to stop waiting: they raise PeerFailure naming `culprit` (the rank
        that died or was late, or this rank when its own collective failed) and `why`."""
        seg = self.segment
        if not seg.control[ABORT]:
            seg.control[ABORT_SEEN_BY] = self.rank + 1
            seg.control[ABORT_WHY] = why
            seg.control[ABORT] = (self.rank if culprit is None else culprit) + 1
        if futex.AVAILABLE:
            for r in range(seg.world_size):
                futex.wake(seg.address(STEP0 + r))
