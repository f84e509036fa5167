"""Where the test suite's time goes: pytest's `--durations=0` report, summed per module.

    python -m pytest -n 2 -q -rfEs --durations=0 > suite.log       # the README's command, plus the report
    python -m benchmarks.studies.suite_durations suite.log                  # per module, slowest first
    python -m benchmarks.studies.suite_durations suite.log --tests 20       # and the 20 slowest tests
    python -m benchmarks.studies.suite_durations before.log after.log       # two runs side by side

A module's figure is the sum of its tests' set-up, call and tear-down times (pytest leaves out
the phases under 5 ms unless run with -vv). Under pytest-xdist the workers run at once, so the
sums add up to more than the run's wall time; the last line gives that wall time, from pytest's
summary line.
"""

from __future__ import annotations

import re
import sys
from collections import defaultdict
from typing import Dict, List, Optional, Tuple

from collectives import cli
from collectives.cli import command

LINE = re.compile(r"^(?P<seconds>[\d.]+)s (?P<phase>setup|call|teardown)\s+(?P<test>\S+)")
SUMMARY = re.compile(r"in (?P<seconds>[\d.]+)s(?: \([\d:]+\))?\s*=*\s*$")


def read(path: str) -> Tuple[Dict[str, float], Optional[float]]:
    """{test id: seconds (phases summed)} and the run's wall seconds (None if no summary line)."""
    per_test: Dict[str, float] = defaultdict(float)
    wall = None
    with open(path, errors="replace") as f:
        for line in f:
            m = LINE.match(line)
            if m:
                test = re.sub(r"@\w+$", "", m.group("test"))  # xdist's group suffix
                per_test[test] += float(m.group("seconds"))
            elif ("passed" in line or "failed" in line) and SUMMARY.search(line):
                wall = float(SUMMARY.search(line).group("seconds"))
    return dict(per_test), wall


def per_module(per_test: Dict[str, float]) -> Dict[str, float]:
    modules: Dict[str, float] = defaultdict(float)
    for test, seconds in per_test.items():
        modules[test.split("::")[0]] += seconds
    return dict(modules)


def table(runs: List[Tuple[str, Dict[str, float], Optional[float]]]) -> List[str]:
    """Markdown rows: each module's seconds in each run, slowest (in the first run) first."""
    modules = [per_module(t) for _, t, _ in runs]
    names = sorted(set().union(*modules), key=lambda m: -modules[0].get(m, 0.0))
    lines = ["| module | " + " | ".join(f"{label} s" for label, _, _ in runs) + " |",
             "|---|" + "---|" * len(runs)]
    for name in names:
        lines.append(f"| {name} | " + " | ".join(f"{m.get(name, 0.0):.1f}" for m in modules) + " |")
    lines.append("| all tests, summed | " + " | ".join(f"{sum(t.values()):.1f}" for _, t, _ in runs) + " |")
    lines.append("| wall (pytest's summary) | " + " | ".join("-" if w is None else f"{w:.1f}" for _, _, w in runs) + " |")
    return lines


def build_parser():
    parser = cli.ArgumentParser(prog=cli.program_name(__name__), description=__doc__.split("\n\n")[0])
    parser.add_argument("logs", nargs="+", help="pytest output with a --durations=0 report, one file a run")
    parser.add_argument("--tests", type=int, default=0, help="also list this many slowest tests of the last run")
    return parser


@command
def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    runs = []
    for path in args.logs:
        try:
            per_test, wall = read(path)
        except OSError as exc:
            parser.error(f"{path}: {exc.strerror}")
        if not per_test:
            parser.error(f"{path} has no --durations report (run pytest with --durations=0)")
        runs.append((path, per_test, wall))
    print("\n".join(table(runs)))
    if args.tests:
        print(f"\nthe {args.tests} slowest tests of {runs[-1][0]}:")
        for test, seconds in sorted(runs[-1][1].items(), key=lambda kv: -kv[1])[: args.tests]:
            print(f"{seconds:8.1f} s  {test}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
