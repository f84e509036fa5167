"""How an shm rank waits for the others: latency and CPU time of an 8-byte all_reduce under each
wait strategy (collectives/shm/wait.py), side by side in one run.

    python -m benchmarks.shm_wait --world-size 2
    python -m benchmarks.shm_wait --world-size 4 --json benchmarks/results/shm-wait.json

One shm group per strategy (COLLECTIVES_SHM_WAIT, read when a group is made) over the same ranks;
the groups take turns in a shuffled order each round, `--iters` calls each, after a barrier on
their own group. Per round and strategy: microseconds per call and CPU microseconds per call
(the process's CPU time, every thread), each the slowest rank's; the table gives the medians over
rounds. With more ranks than cores, a rank that spins holds the core the rank it waits for needs.
"""

from __future__ import annotations

import json
import os
import random
import statistics
import sys
import time

import torch
import torch.distributed as dist

import collectives
from collectives import cli
from collectives.shm.wait import STRATEGIES


def _group(strategy: str):
    saved = os.environ.get("COLLECTIVES_SHM_WAIT")
    os.environ["COLLECTIVES_SHM_WAIT"] = strategy
    try:
        return dist.new_group(backend="shm")
    finally:
        if saved is None:
            del os.environ["COLLECTIVES_SHM_WAIT"]
        else:
            os.environ["COLLECTIVES_SHM_WAIT"] = saved


def _slowest(*values: float):
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)  # on the Gloo world, outside what is timed
    return t.tolist()


def measure(env, strategies, rounds: int, iters: int) -> dict:
    groups = {s: _group(s) for s in strategies}
    order = random.Random(0)
    per = {s: {"us": [], "cpu_us": []} for s in strategies}
    x = torch.ones(1, dtype=torch.float64)
    for i in range(rounds + 1):
        for strategy in order.sample(list(groups), len(groups)):
            group = groups[strategy]
            dist.barrier(group=group)
            wall, cpu = time.perf_counter(), time.process_time()
            for _ in range(iters):
                dist.all_reduce(x, group=group)
            wall, cpu = _slowest(time.perf_counter() - wall, time.process_time() - cpu)
            if i:  # the first round warms up
                per[strategy]["us"].append(wall / iters * 1e6)
                per[strategy]["cpu_us"].append(cpu / iters * 1e6)
    return per


def summarise(raw: dict) -> dict:
    return {s: {k: statistics.median(v) for k, v in per.items()} | {"rounds": len(per["us"])} for s, per in raw.items()}


def report(summary: dict, world_size: int) -> str:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    lines = [f"8-byte all_reduce on shm, {world_size} ranks on {cores} cores, medians over rounds (slowest rank):",
             f"  {'strategy':<8} {'us/call':>10} {'CPU us/call':>12}"]
    for strategy, s in summary.items():
        lines.append(f"  {strategy:<8} {s['us']:>10.1f} {s['cpu_us']:>12.1f}")
    return "\n".join(lines)


def build_parser():
    parser = cli.ArgumentParser(prog="python -m benchmarks.shm_wait", description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--strategies", nargs="+", default=list(STRATEGIES), choices=STRATEGIES,
                        help=f"the wait strategies to compare (default: all of {', '.join(STRATEGIES)})")
    parser.add_argument("--rounds", type=int, default=21, help="rounds of alternation (default 21)")
    parser.add_argument("--iters", type=int, default=200, help="calls per round and strategy (default 200)")
    parser.add_argument("--json", default=None, help="also write the rounds and the summary here")
    return parser


@cli.command
def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    cli.check_at_least(parser, args, {"--world-size": 2, "--rounds": 1, "--iters": 1})
    cli.check_outputs(parser, {"--json": args.json})
    raw = collectives.run(measure, args.world_size, backend="gloo",
                          args=(list(dict.fromkeys(args.strategies)), args.rounds, args.iters), timeout=3600)[0]
    summary = summarise(raw)
    print(report(summary, args.world_size))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": " ".join(["python -m benchmarks.shm_wait", *(argv or sys.argv[1:])]),
                       "world_size": args.world_size, "summary": summary, "raw": raw}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
