"""What the checked wrappers cost: collectives.all_reduce against raw torch.distributed.all_reduce.

Measured side by side in one run on spawned ranks (one thread each). Four variants alternate
call by call, in a random order each time: raw, the wrapper, the wrapper in checked mode, and a
control (the raw call after busy-waiting as long as the wrapper's own Python work, measured in
the same run). Every call is timed on every rank and the slowest rank's time is kept; the table
gives medians over calls; 'added' is the median over iterations of the difference to the raw call
of the same iteration (a paired comparison, which cancels slow drift). The whole measurement is
repeated in freshly spawned ranks (--repeats, 3 by default) and the table gives the median of
the runs with the range of the ratio, because one run on 2 shared cores moves by a few percent.

Why the control: on Gloo, any Python work just before a call costs several times its own
duration, because the peer rank waits longer and drops from spinning to sleeping. If the control
costs what the wrapper costs, the difference is that effect, not the wrapper's code.

    python -m benchmarks.wrapper_overhead                       # 2 ranks, 4 B / 64 KiB / 16 MiB
    python -m benchmarks.wrapper_overhead --json benchmarks/results/wrapper-overhead.json

What it is for: telling whether the wrappers stay within 1.02x of raw torch.distributed at 64 KiB
and above, and within 20 us per call at 4 B, with checked mode off. Checked mode's cost is printed too.
"""

from __future__ import annotations

import datetime
import os
import platform
import random
import statistics
import sys
import time
import timeit

import torch
import torch.distributed as dist
from tabulate import tabulate

import collectives
from collectives import cli
from collectives.cli import command

SIZES = {"4 B": 4, "64 KiB": 64 << 10, "16 MiB": 16 << 20}
VARIANTS = ("raw", "wrapper", "checked", "control")


def _calls(nbytes: int) -> int:
    return 6000 if nbytes <= 4 else 2000 if nbytes <= (64 << 10) else 400


def _python_cost_s(tensor: torch.Tensor) -> float:
    """The wrapper's own Python time per call: the wrapper with the torch call stubbed out."""
    real = dist.all_reduce
    dist.all_reduce = lambda *args, **kwargs: None
    try:
        return min(timeit.repeat(lambda: collectives.all_reduce(tensor), number=20000, repeat=5)) / 20000
    finally:
        dist.all_reduce = real


_control_s = 0.0


def _one_call(variant: str, tensor: torch.Tensor) -> float:
    if variant == "control":  # raw, after busy-waiting as long as the wrapper's own Python work
        start = time.perf_counter()
        while time.perf_counter() - start < _control_s:
            pass
        dist.all_reduce(tensor)
    elif variant == "raw":
        start = time.perf_counter()
        dist.all_reduce(tensor)
    elif variant == "wrapper":
        start = time.perf_counter()
        collectives.all_reduce(tensor)
    else:
        start = time.perf_counter()
        with collectives.checked():
            collectives.all_reduce(tensor)
    return time.perf_counter() - start


def _measure(env, scale: float):
    """{size: {variant: [seconds, one per call]}}: calls alternate variant by variant (the order
    rotating each time), each call is timed on every rank, and the slowest rank's time is kept."""
    global _control_s
    _control_s = _python_cost_s(torch.ones(1))
    out = {"python_us": _control_s * 1e6}
    for label, nbytes in SIZES.items():
        tensor = torch.ones(max(1, nbytes // 4))  # float32
        calls = max(3, int(_calls(nbytes) * scale))
        for v in VARIANTS:  # warm-up
            for _ in range(max(1, calls // 10)):
                _one_call(v, tensor)
        mine = torch.zeros(len(VARIANTS), calls, dtype=torch.float64)  # (variant, call)
        # A fresh random order for every call, the same on every rank (same seed). A fixed
        # rotation would always run each variant right after the same other one, and whatever
        # one call leaves behind (a checked call's extra all_gather) would land on one variant.
        order = random.Random(nbytes)
        for i in range(calls):
            for v in order.sample(range(len(VARIANTS)), len(VARIANTS)):
                mine[v, i] = _one_call(VARIANTS[v], tensor)
        dist.all_reduce(mine, op=dist.ReduceOp.MAX)  # the slowest rank's time for each call
        out[label] = {v: mine[j].tolist() for j, v in enumerate(VARIANTS)}
    return out


def _summarise(results) -> dict:
    """Per size: medians per variant (us), and paired differences to raw (us) with ratios."""
    out = {"python_us": results.pop("python_us")}
    for label, times in results.items():
        med = {v: statistics.median(ts) * 1e6 for v, ts in times.items()}  # us per call

        def paired(v):  # median over iterations of (v - raw) in the same iteration: cancels drift
            return statistics.median(a - b for a, b in zip(times[v], times["raw"])) * 1e6

        added, control, checked = paired("wrapper"), paired("control"), paired("checked")
        out[label] = {
            "raw_us": med["raw"], "wrapper_us": med["wrapper"], "checked_us": med["checked"], "control_us": med["control"],
            "wrapper_added_us": added, "wrapper_ratio": 1 + added / med["raw"],
            "checked_added_us": checked, "checked_ratio": 1 + checked / med["raw"],
            "control_added_us": control,
        }
    return out


def build_parser():
    parser = cli.ArgumentParser(prog=cli.program_name(__name__), description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, default=2, help="ranks to spawn (default 2)")
    parser.add_argument("--scale", type=float, default=1.0,
                        help="multiply the calls per size (6000 at 4 B, 2000 at 64 KiB, 400 at 16 MiB) by this")
    parser.add_argument("--repeats", type=int, default=3,
                        help="whole measurements, each in freshly spawned ranks; the table is their median (default 3)")
    parser.add_argument("--json", help="write the medians, ratios, every run and the environment to this file")
    return parser


@command
def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    cli.check_outputs(parser, {"--json": args.json})

    runs = []  # one {size: figures} per run, each run in freshly spawned ranks
    for i in range(args.repeats):
        results = collectives.run(_measure, world_size=args.world_size, args=(args.scale,), timeout=1800)[0]
        runs.append(_summarise(results))
        print(f"run {i + 1}/{args.repeats}: " + ", ".join(
            f"{k} {v['wrapper_ratio']:.3f}x" for k, v in runs[-1].items() if k in SIZES), file=sys.stderr, flush=True)
    keys = [k for k in runs[0]["4 B"]]
    report = {"wrapper_python_us": statistics.median(r["python_us"] for r in runs), "runs": runs}
    rows = []
    for label in SIZES:
        med = {k: statistics.median(r[label][k] for r in runs) for k in keys}  # median over runs
        lo, hi = min(r[label]["wrapper_ratio"] for r in runs), max(r[label]["wrapper_ratio"] for r in runs)
        report[label] = med
        rows.append([label, f"{med['raw_us']:.1f}", f"{med['wrapper_us']:.1f}", f"{med['wrapper_added_us']:+.1f}",
                     f"{med['wrapper_ratio']:.3f}x", f"{lo:.3f}-{hi:.3f}", f"{med['control_added_us']:+.1f}",
                     f"{med['checked_us']:.1f}", f"{med['checked_ratio']:.2f}x"])
    print(f"all_reduce (float32, sum) on {args.world_size} Gloo ranks, one thread each; calls alternated one by one "
          f"in random order; slowest rank per call; median of {args.repeats} runs")
    print(tabulate(rows, headers=["size", "raw us", "wrapper us", "added us", "wrapper/raw", "range over runs",
                                 "control added us", "checked us", "checked/raw"]))
    print(f"added = median over iterations of (variant - raw) within the same iteration; ratio = 1 + added / raw.\n"
          f"the wrapper's own Python work: {report['wrapper_python_us']:.2f} us per call (torch call stubbed out); "
          f"'control' is the raw call after busy-waiting that long, so its 'added' shows this machine's noise")
    small, large = report["4 B"], [report[k] for k in ("64 KiB", "16 MiB")]
    print(f"the wrapper adds {small['wrapper_added_us']:+.1f} us at 4 B; it takes "
          f"{', '.join('%.3fx' % r['wrapper_ratio'] for r in large)} the raw call's time at 64 KiB and 16 MiB")
    if args.json:
        environment = {
            "date": datetime.date.today().isoformat(), "torch": torch.__version__, "backend": "gloo",
            "world_size": args.world_size, "cpus": os.cpu_count(), "machine": platform.machine(),
            "command": "python -m benchmarks.wrapper_overhead " + " ".join(argv if argv is not None else sys.argv[1:]),
        }
        cli.write_json(args.json, {"environment": environment, "results": report}, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
