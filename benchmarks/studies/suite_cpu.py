"""Where the test suite's CPU goes: each test's own processes (launched programs, ranks, torchrun
agents, compilers) and the CPU they used, read from /proc while a command runs.

    python -m benchmarks.studies.suite_cpu -- python -m pytest -n 2 -q -rfEs          # the 30 costliest
    python -m benchmarks.studies.suite_cpu --top 60 --json cpu.json -- python -m pytest -q tests/shm

pytest's --durations (benchmarks.studies.suite_durations) gives each test's wall time; on a busy
machine a test that waits and one that computes look alike there. This gives CPU. Every tenth of
a second it reads each process's CPU (/proc/PID/stat) and, the first time it sees one, the test
it belongs to: PYTEST_CURRENT_TEST in the environment it started with (/proc/PID/environ), which
every process a test starts inherits. A process forked without a new program (a rank from a pool's
fork server) carries its forking process's starting environment, so a pool's ranks are charged to
the test that started the pool. A process's last tenth of a second of CPU, or the whole of one that
lives less, can be missed, and the poll's own CPU is not counted. Processes that were running before the command are left out.

Prints the machine's busy CPU over the run (from /proc/stat), the CPU of the processes counted,
and the costliest tests with how many processes each started. Linux only.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections import defaultdict
from typing import Dict, Optional, Tuple

from collectives import cli
from collectives.cli import command
from collectives.output_files import check_outputs, write_json

TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
NO_TEST = "(no test: pytest and its workers)"


def _stat(pid: str) -> Optional[Tuple[float, int]]:
    """(CPU seconds, start time in ticks since boot) of a process, or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()  # the name may hold spaces; fields after it are fixed
    return (int(fields[11]) + int(fields[12])) / TICK, int(fields[19])


def _owner(pid: str) -> Tuple[str, str]:
    """(the test a process belongs to, its command line), from what it started with."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            environ = f.read().split(b"\0")
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return NO_TEST, "?"
    for entry in environ:
        if entry.startswith(b"PYTEST_CURRENT_TEST="):
            test = entry.split(b"=", 1)[1].decode(errors="replace")
            return test.rsplit(" (", 1)[0].split("@")[0], argv  # drop " (call)" and xdist's "@group"
    return NO_TEST, argv


def _busy_ticks() -> int:
    with open("/proc/stat") as f:
        values = [int(v) for v in f.readline().split()[1:]]
    return sum(values) - values[3] - values[4]  # all but idle and iowait


def poll(proc: subprocess.Popen, interval: float = 0.1) -> Dict[str, dict]:
    """{pid:start: {"test", "argv", "cpu"}} for every process started after the poll began, until
    `proc` ends."""
    started = {pid: s[1] for pid in os.listdir("/proc") if pid.isdigit() and (s := _stat(pid))}
    me = str(os.getpid())
    seen: Dict[str, dict] = {}
    while True:
        done = proc.poll() is not None
        for pid in os.listdir("/proc"):
            if not pid.isdigit() or pid == me:
                continue
            s = _stat(pid)
            if s is None or started.get(pid) == s[1]:
                continue  # gone, or running before the command
            key = f"{pid}:{s[1]}"
            if key not in seen:
                test, argv = _owner(pid)
                seen[key] = {"test": test, "argv": argv[:300], "cpu": 0.0}
            seen[key]["cpu"] = s[0]
        if done:
            return seen
        time.sleep(interval)


def per_test(processes: Dict[str, dict]) -> Dict[str, Tuple[float, int]]:
    """{test: (CPU seconds, processes)} summed over the processes each test started."""
    totals: Dict[str, list] = defaultdict(lambda: [0.0, 0])
    for entry in processes.values():
        totals[entry["test"]][0] += entry["cpu"]
        totals[entry["test"]][1] += 1
    return {test: (cpu, n) for test, (cpu, n) in totals.items()}


def build_parser():
    parser = cli.ArgumentParser(prog="python -m benchmarks.studies.suite_cpu", description=__doc__.split("\n\n")[0])
    parser.add_argument("--top", type=int, default=30, help="tests to list, costliest first (default 30)")
    parser.add_argument("--json", metavar="PATH", help="also write every process counted (test, command line, CPU s)")
    parser.add_argument("command", nargs="+", help="the command to run, after --")
    return parser


@command
def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    cli.check_at_least(parser, args, {"--top": 1})
    check_outputs(parser, [("--json", args.json)])
    if not os.path.isdir("/proc/self"):
        parser.error("needs Linux's /proc")
    busy, t0 = _busy_ticks(), time.monotonic()
    proc = subprocess.Popen(args.command)
    processes = poll(proc)
    wall, busy = time.monotonic() - t0, (_busy_ticks() - busy) / TICK
    totals = per_test(processes)
    counted = sum(cpu for cpu, _ in totals.values())
    print(f"\n{' '.join(args.command)}: exit {proc.returncode}, {wall:.1f} s wall; the machine was busy "
          f"{busy:.1f} CPU s ({os.cpu_count()} cores); {len(processes)} processes counted, {counted:.1f} CPU s")
    print(f"{'CPU s':>8} {'procs':>6}  test")
    for test, (cpu, n) in sorted(totals.items(), key=lambda kv: -kv[1][0])[: args.top]:
        print(f"{cpu:8.1f} {n:6d}  {test}")
    if args.json:
        write_json(args.json, {"command": args.command, "wall_s": wall, "busy_cpu_s": busy, "processes": processes})
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
