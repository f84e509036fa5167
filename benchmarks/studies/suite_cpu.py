"""Where the test suite's CPU goes: each test's own processes (launched programs, ranks, torchrun
agents, compilers) and the CPU they used, read from /proc while a command runs.

    python -m benchmarks.studies.suite_cpu -- python -m pytest -n 2 -q -rfEs          # the 30 costliest
    python -m benchmarks.studies.suite_cpu --top 60 --json cpu.json -- python -m pytest -q tests/shm

pytest's --durations (benchmarks.studies.suite_durations) gives each test's wall time; on a busy
machine a test that waits and one that computes look alike there. This gives CPU. Every tenth of
a second it reads each process's CPU (/proc/PID/stat) and charges what it used since the last
read to a test:
- inside pytest (this module is loaded into it as a plugin, through PYTEST_ADDOPTS, and each
  pytest process, xdist's workers included, says which test it runs now in a file of a folder
  the study reads), the test its nearest pytest ancestor, or pytest itself, runs at that moment:
  a pool's ranks, started once and used by many tests, are charged to each test as it runs, and
  so is the CPU of a test's own code. A process that outlives its test is charged to the tests
  that run after it in the same pytest process;
- outside pytest, or before a pytest process's first test, the test in the environment it
  started with (PYTEST_CURRENT_TEST in /proc/PID/environ), which every process a test starts
  inherits; a process forked without a new program carries its forking process's.
A process's last tenth of a second of CPU, or the whole of one that lives less, can be missed,
and the poll's own CPU is not counted. Processes that were running before the command are left out.

Prints the machine's busy CPU over the run (from /proc/stat), the CPU of the processes counted,
the CPU by kind of program (a fork server that imports torch for the ranks it forks, a rank forked
from one, a torchrun agent, pytest and its workers, the compiler, ...), and the costliest tests
with how many processes each was charged for. Linux only.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from typing import Dict, List, Optional, Tuple

from collectives import cli
from collectives.cli import command
from collectives.output_files import check_outputs, write_json, write_output

TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
NO_TEST = "(no test: pytest and its workers)"
NOW_RUNNING = "SUITE_CPU_NOW_RUNNING"  # the folder where each pytest process names the test it runs now


_pytest_config = None


def pytest_configure(config):
    global _pytest_config
    _pytest_config = config


def _say_now_running(test: str) -> None:
    """As a pytest plugin: name the test this pytest process runs now ("" between tests). xdist's
    controller, which hears of every worker's tests, says nothing: its own CPU is no test's."""
    folder = os.environ.get(NOW_RUNNING)
    if folder and not (_pytest_config and _pytest_config.pluginmanager.has_plugin("dsession")):
        write_output(os.path.join(folder, str(os.getpid())), test)


def pytest_runtest_logstart(nodeid, location):
    _say_now_running(_test_name(nodeid))


def pytest_runtest_logfinish(nodeid, location):
    _say_now_running("")


def _test_name(text: str) -> str:
    """A node id as the report lists it: no " (call)" phase and no xdist "@group"."""
    return text.rsplit(" (", 1)[0].split("@")[0]


def _stat(pid: str) -> Optional[Tuple[float, int, str]]:
    """(CPU seconds, start time in ticks since boot, parent pid) of a process, or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()  # the name may hold spaces; fields after it are fixed
    return (int(fields[11]) + int(fields[12])) / TICK, int(fields[19]), fields[1]


def _ancestry(pid: str, parents: Dict[str, str]) -> List[str]:
    """The process and its ancestors, nearest first (from this poll's parent of each process)."""
    chain = [pid]
    while chain[-1] in parents and parents[chain[-1]] not in chain and len(chain) < 64:
        chain.append(parents[chain[-1]])
    return chain


def _now_running(folder: Optional[str]) -> Dict[str, str]:
    """{pid: the test it runs now, "" between tests} of each pytest process that has said."""
    now: Dict[str, str] = {}
    if not folder:
        return now
    for name in os.listdir(folder):
        if name.isdigit():
            try:
                with open(os.path.join(folder, name)) as f:
                    now[name] = f.read()
            except OSError:
                pass
    return now


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
            return _test_name(entry.split(b"=", 1)[1].decode(errors="replace")), argv
    return NO_TEST, argv


FORK_SERVER = "multiprocessing.forkserver import main"
KINDS = (  # (kind, what its command line holds), the first that matches
    ("torchrun agent", ("torch.distributed.run", "bin/torchrun")),
    ("pytest and its workers", ("exec(eval(sys.stdin.readline()))", "-m pytest", "bin/pytest")),
    ("spawned interpreter (a rank or a DataLoader worker)", ("multiprocessing.spawn", "spawn_main")),
    ("compiler and linker", ("cc1plus", "c++ ", "g++ ", "/ld ", "collect2", "ninja", "as --")),
    ("multiprocessing's resource tracker", ("resource_tracker",)),
    ("another Python program", ("python",)),
)


def kind(argv: str, parent_argv: str = "") -> str:
    """The kind of program a command line is. A fork server's forked children (ranks, and their
    DataLoader workers) keep its command line: one whose parent has it too is a forked child."""
    if FORK_SERVER in argv:
        return "forked from a fork server (a rank)" if FORK_SERVER in parent_argv else "fork server (imports torch once)"
    return next((name for name, marks in KINDS if any(m in argv for m in marks)), "other")


def per_kind(processes: Dict[str, dict]) -> Dict[str, Tuple[float, int]]:
    """{kind: (CPU seconds, processes)} over every process counted (its "kind", from `poll`)."""
    totals: Dict[str, list] = defaultdict(lambda: [0.0, 0])
    for entry in processes.values():
        total = totals[entry.get("kind") or kind(entry["argv"])]
        total[0] += entry["cpu"]
        total[1] += 1
    return {name: (cpu, n) for name, (cpu, n) in totals.items()}


def _busy_ticks() -> int:
    with open("/proc/stat") as f:
        values = [int(v) for v in f.readline().split()[1:]]
    return sum(values) - values[3] - values[4]  # all but idle and iowait


def running() -> Dict[str, int]:
    """{pid: start time} of every process now: those that `poll` leaves out."""
    return {pid: s[1] for pid in os.listdir("/proc") if pid.isdigit() and (s := _stat(pid))}


def poll(proc: subprocess.Popen, before: Dict[str, int], interval: float = 0.1,
         folder: Optional[str] = None) -> Dict[str, dict]:
    """{pid:start: {"test", "argv", "kind", "cpu", "charged": {test: CPU s}}} for every process not in
    `before` (from `running()` before `proc` started), until `proc` ends. "test" is the one it
    started under; "charged" splits its CPU between the tests that ran while it used it, as the
    module docstring says, with `folder` the one where pytest processes name their test."""
    me = str(os.getpid())
    seen: Dict[str, dict] = {}
    chains: Dict[str, List[str]] = {}  # each process's ancestry when first seen: it outlives a parent's exit
    while True:
        done = proc.poll() is not None
        now = _now_running(folder)
        stats = {pid: s for pid in os.listdir("/proc") if pid.isdigit() and pid != me and (s := _stat(pid))}
        parents = {pid: s[2] for pid, s in stats.items()}
        for pid, (cpu, start, _) in stats.items():
            if before.get(pid) == start:
                continue  # running before the command
            key = f"{pid}:{start}"
            if key not in seen:
                test, argv = _owner(pid)
                parent = parents.get(pid)  # its command line as seen, or read now (older than the command)
                known = seen.get(f"{parent}:{stats[parent][1]}") if parent in stats else None
                parent_argv = known["argv"] if known else _owner(parent)[1] if parent in stats else ""
                seen[key] = {"test": test, "argv": argv[:300], "kind": kind(argv, parent_argv), "cpu": 0.0,
                             "charged": {}}
                chains[key] = _ancestry(pid, parents)
            entry = seen[key]
            used, entry["cpu"] = cpu - entry["cpu"], cpu
            if used <= 0:
                continue
            runner = next((p for p in chains[key] if p in now), None)
            test = (now[runner] or NO_TEST) if runner is not None else entry["test"]
            entry["charged"][test] = entry["charged"].get(test, 0.0) + used
        if done:
            return seen
        time.sleep(interval)


def per_test(processes: Dict[str, dict]) -> Dict[str, Tuple[float, int]]:
    """{test: (CPU seconds, processes)} summed over the processes charged to each test."""
    totals: Dict[str, list] = defaultdict(lambda: [0.0, 0])
    for entry in processes.values():
        for test, cpu in (entry.get("charged") or {entry["test"]: entry["cpu"]}).items():
            totals[test][0] += cpu
            totals[test][1] += 1
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
    # tmpfs where there is one: a pytest process writes its file twice a test
    folder = tempfile.mkdtemp(prefix="suite-cpu-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    env = {**os.environ, NOW_RUNNING: folder,
           "PYTEST_ADDOPTS": f"{os.environ.get('PYTEST_ADDOPTS', '')} -p benchmarks.studies.suite_cpu".strip()}
    busy, t0 = _busy_ticks(), time.monotonic()
    try:
        before = running()
        proc = subprocess.Popen(args.command, env=env)
        processes = poll(proc, before, folder=folder)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    wall, busy = time.monotonic() - t0, (_busy_ticks() - busy) / TICK
    totals = per_test(processes)
    counted = sum(cpu for cpu, _ in totals.values())
    print(f"\n{' '.join(args.command)}: exit {proc.returncode}, {wall:.1f} s wall; the machine was busy "
          f"{busy:.1f} CPU s ({os.cpu_count()} cores); {len(processes)} processes counted, {counted:.1f} CPU s")
    print(f"{'CPU s':>8} {'procs':>6}  kind of program")
    for name, (cpu, n) in sorted(per_kind(processes).items(), key=lambda kv: -kv[1][0]):
        print(f"{cpu:8.1f} {n:6d}  {name}")
    print(f"\n{'CPU s':>8} {'procs':>6}  test")
    for test, (cpu, n) in sorted(totals.items(), key=lambda kv: -kv[1][0])[: args.top]:
        print(f"{cpu:8.1f} {n:6d}  {test}")
    if args.json:
        write_json(args.json, {"command": args.command, "wall_s": wall, "busy_cpu_s": busy, "processes": processes})
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
