"""What the checked wrappers cost: collectives.all_reduce against raw torch.distributed.all_reduce.

Measured side by side in one run on spawned ranks (one thread each): each round times a block of
calls of every variant, in an order that rotates from round to round; a block's time is the
slowest rank's; the table gives the median per call over rounds, and the ratio to raw.

    python -m benchmarks.wrapper_overhead                       # 2 ranks, 4 B / 64 KiB / 16 MiB
    python -m benchmarks.wrapper_overhead --json benchmarks/results/wrapper-overhead.json

Targets (issue 2): at most 1.02x at 64 KiB and above, at most 20 us added per call at 4 B,
with checked mode off. Checked mode's cost is printed too.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import time

import torch
import torch.distributed as dist
from tabulate import tabulate

import collectives

SIZES = {"4 B": 4, "64 KiB": 64 << 10, "16 MiB": 16 << 20}
VARIANTS = ("raw", "wrapper", "checked")


def _calls_per_block(nbytes: int) -> int:
    return 2000 if nbytes <= 4 else 400 if nbytes <= (64 << 10) else 4


def _time_block(variant: str, tensor: torch.Tensor, calls: int) -> float:
    if variant == "raw":
        start = time.perf_counter()
        for _ in range(calls):
            dist.all_reduce(tensor)
    elif variant == "wrapper":
        start = time.perf_counter()
        for _ in range(calls):
            collectives.all_reduce(tensor)
    else:
        with collectives.checked():
            start = time.perf_counter()
            for _ in range(calls):
                collectives.all_reduce(tensor)
    return (time.perf_counter() - start) / calls


def _measure(env, rounds: int):
    """On each rank: {size: {variant: [seconds per call, one per round]}}, slowest rank's per block."""
    out = {}
    for label, nbytes in SIZES.items():
        tensor = torch.ones(max(1, nbytes // 4))  # float32
        calls = _calls_per_block(nbytes)
        times = {v: [] for v in VARIANTS}
        for v in VARIANTS:  # warm-up
            _time_block(v, tensor, max(1, calls // 10))
        for i in range(rounds):
            order = VARIANTS[i % 3:] + VARIANTS[: i % 3]
            for v in order:
                dist.barrier()
                per_call = torch.tensor([_time_block(v, tensor, calls)], dtype=torch.float64)
                dist.all_reduce(per_call, op=dist.ReduceOp.MAX)  # the slowest rank's time
                times[v].append(per_call.item())
        out[label] = times
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, default=2, help="ranks to spawn (default 2)")
    parser.add_argument("--rounds", type=int, default=15, help="alternating rounds per size (default 15)")
    parser.add_argument("--json", help="write the medians, ratios and environment to this file")
    args = parser.parse_args(argv)

    results = collectives.run(_measure, world_size=args.world_size, args=(args.rounds,), timeout=1800)[0]
    rows, report = [], {}
    for label, times in results.items():
        med = {v: statistics.median(ts) * 1e6 for v, ts in times.items()}  # us per call
        report[label] = {
            "raw_us": med["raw"], "wrapper_us": med["wrapper"], "checked_us": med["checked"],
            "wrapper_ratio": med["wrapper"] / med["raw"], "wrapper_added_us": med["wrapper"] - med["raw"],
            "checked_ratio": med["checked"] / med["raw"],
        }
        r = report[label]
        rows.append([label, f"{med['raw']:.1f}", f"{med['wrapper']:.1f}", f"{r['wrapper_ratio']:.3f}x",
                     f"{r['wrapper_added_us']:+.1f}", f"{med['checked']:.1f}", f"{r['checked_ratio']:.2f}x"])
    print(f"all_reduce (float32, sum) on {args.world_size} Gloo ranks, one thread each; "
          f"median of {args.rounds} alternating rounds, slowest rank per block")
    print(tabulate(rows, headers=["size", "raw us", "wrapper us", "wrapper/raw", "added us", "checked us", "checked/raw"]))
    small, large = report["4 B"], [report[k] for k in ("64 KiB", "16 MiB")]
    ok_small = small["wrapper_added_us"] <= 20
    ok_large = all(r["wrapper_ratio"] <= 1.02 for r in large)
    print(f"target: <= 20 us added at 4 B: {'met' if ok_small else 'MISSED'} ({small['wrapper_added_us']:+.1f} us); "
          f"<= 1.02x at 64 KiB and 16 MiB: {'met' if ok_large else 'MISSED'} "
          f"({', '.join('%.3fx' % r['wrapper_ratio'] for r in large)})")
    if args.json:
        environment = {
            "date": datetime.date.today().isoformat(), "torch": torch.__version__, "backend": "gloo",
            "world_size": args.world_size, "cpus": os.cpu_count(), "machine": platform.machine(),
            "command": "python -m benchmarks.wrapper_overhead " + " ".join(argv if argv is not None else os.sys.argv[1:]),
        }
        with open(args.json, "w") as f:
            json.dump({"environment": environment, "results": report}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
