"""What a pytest run's pooled ranks cost while they wait: once the tests have run, and before the
pools close, every thread of pytest's descendants (the pools' ranks, their fork server) is read
for --seconds, and its CPU and wake-ups are summed by thread name. gloo_tcp_loop is the thread
each Gloo group keeps; it wakes a hundred times a second, waiting or not.

    python -m benchmarks.studies.pool_idle -- -m "not slow" tests/collectives tests/shm tests/ddp
    python -m benchmarks.studies.pool_idle --seconds 5 -- tests/collectives/test_ops.py

pytest runs in this process, without xdist (a worker's pools close with the worker). Linux only.
"""

from __future__ import annotations

import os
import sys
import time
from collections import defaultdict
from typing import Dict, Tuple

from collectives import cli
from collectives.cli import command
from collectives.machine import descendants

TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def threads(pids) -> Dict[Tuple[int, str], Tuple[str, float, int]]:
    """{(pid, tid): (thread name, CPU seconds, voluntary context switches)} of every thread of `pids`."""
    out = {}
    for pid in pids:
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                with open(f"/proc/{pid}/task/{tid}/stat") as f:
                    text = f.read()
                with open(f"/proc/{pid}/task/{tid}/status") as f:
                    status = f.read()
            except OSError:
                continue
            fields = text[text.rindex(")") + 2:].split()
            switches = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("voluntary_ctxt_switches"))
            out[(pid, tid)] = (text[text.index("(") + 1:text.rindex(")")], (int(fields[11]) + int(fields[12])) / TICK, switches)
    return out


def idle_by_name(seconds: float, pid: int) -> Dict[str, Tuple[int, float, int]]:
    """{thread name: (threads, CPU s, wake-ups)} of `pid`'s descendants over `seconds`."""
    below = descendants(pid)
    before = threads(below)
    time.sleep(seconds)
    after = threads(below)
    totals: Dict[str, list] = defaultdict(lambda: [0, 0.0, 0])
    for key, (name, cpu, switches) in after.items():
        _, cpu0, switches0 = before.get(key, (name, 0.0, 0))
        totals[name][0] += 1
        totals[name][1] += cpu - cpu0
        totals[name][2] += switches - switches0
    return {name: (n, cpu, woke) for name, (n, cpu, woke) in totals.items()}


class _AtTheEnd:
    """A pytest plugin: measure when the session ends, before the pools close (at exit)."""

    def __init__(self, seconds: float):
        self.seconds, self.result = seconds, {}

    def pytest_sessionfinish(self, session):
        self.result = idle_by_name(self.seconds, os.getpid())


def build_parser():
    parser = cli.ArgumentParser(prog="python -m benchmarks.studies.pool_idle", description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=20.0, help="how long to read the waiting ranks (default 20)")
    parser.add_argument("pytest_args", nargs="+", help="pytest's arguments, after --")
    return parser


@command
def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    cli.check_positive(parser, args, "--seconds", "seconds")
    if not os.path.isdir("/proc/self/task"):
        parser.error("needs Linux's /proc")
    import pytest

    probe = _AtTheEnd(args.seconds)
    # this process imported collectives before pytest could rewrite it: say nothing of that
    code = pytest.main(["-W", "ignore::pytest.PytestAssertRewriteWarning", *args.pytest_args], plugins=[probe])
    print(f"\npytest's descendants over {args.seconds:g} s after its last test (exit {int(code)}):")
    print(f"{'threads':>8} {'CPU s':>7} {'wake-ups':>9}  thread name")
    for name, (n, cpu, woke) in sorted(probe.result.items(), key=lambda kv: -kv[1][1]):
        print(f"{n:8d} {cpu:7.2f} {woke:9d}  {name}")
    return int(code)


if __name__ == "__main__":
    sys.exit(main())
