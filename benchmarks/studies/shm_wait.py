"""How an shm rank waits for the others: latency and CPU time of an 8-byte all_reduce under each
wait strategy (collectives/shm/wait.py), side by side in one run.

    python -m benchmarks.studies.shm_wait --world-size 2
    python -m benchmarks.studies.shm_wait --world-size 4 --json benchmarks/results/shm-wait.json
    python -m benchmarks.studies.shm_wait --busy 1 --bytes 8 4M --gloo   # a process busy beside the ranks, against Gloo

One shm group per strategy (COLLECTIVES_SHM_WAIT, read when a group is made) over the same ranks;
the groups take turns in a shuffled order each round, `--iters` calls each, after a barrier on
their own group. Per round and strategy: microseconds per call and CPU microseconds per call
(the process's CPU time, every thread), each the slowest rank's; the table gives the medians over
rounds. With more ranks than cores, a rank that spins holds the core the rank it waits for needs.
--busy K keeps K more processes busy (a loop each) while it measures, as a loaded machine does;
--gloo adds Gloo over the same ranks, alternated with the rest; --bytes times other sizes too.
"""

from __future__ import annotations

import random
import statistics
import subprocess
import sys
import time

import torch
import torch.distributed as dist

import collectives
from collectives import cli, machine
from collectives.shm import new_group_with
from collectives.shm.wait import STRATEGIES

from ..parts.sweep import parse_size


def _group(strategy: str):
    return new_group_with({"COLLECTIVES_SHM_WAIT": strategy})


def _slowest(*values: float):
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)  # on the Gloo world, outside what is timed
    return t.tolist()


def measure(env, strategies, rounds: int, iters: int, sizes=(8,), busy: int = 0, gloo: bool = False) -> dict:
    groups = {s: _group(s) for s in strategies}
    if gloo:
        groups["gloo"] = dist.new_group(backend="gloo")
    order = random.Random(0)
    keys = [(name, nbytes) for name in groups for nbytes in sizes]
    per = {f"{name} {nbytes}": {"us": [], "cpu_us": []} for name, nbytes in keys}
    buffers = {nbytes: torch.ones(max(1, nbytes // 8), dtype=torch.float64) for nbytes in sizes}
    loops = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(busy if env.rank == 0 else 0)]
    try:
        for i in range(rounds + 1):
            for name, nbytes in order.sample(keys, len(keys)):
                group, x = groups[name], buffers[nbytes]
                n = iters if nbytes <= 4096 else max(1, iters // 20)
                dist.barrier(group=group)
                wall, cpu = time.perf_counter(), time.process_time()
                for _ in range(n):
                    dist.all_reduce(x, group=group)
                wall, cpu = _slowest(time.perf_counter() - wall, time.process_time() - cpu)
                if i:  # the first round warms up
                    per[f"{name} {nbytes}"]["us"].append(wall / n * 1e6)
                    per[f"{name} {nbytes}"]["cpu_us"].append(cpu / n * 1e6)
    finally:
        for p in loops:
            p.kill()
            p.wait()
    return per


def summarise(raw: dict) -> dict:
    return {s: {k: statistics.median(v) for k, v in per.items()} | {"rounds": len(per["us"])} for s, per in raw.items()}


def report(summary: dict, world_size: int, busy: int = 0) -> str:
    cores = machine.cpus()
    loaded = f", {busy} process(es) busy beside them" if busy else ""
    lines = [f"float64 all_reduce on shm (by wait strategy), {world_size} ranks on {cores} cores{loaded}, medians over "
             "rounds (slowest rank):", f"  {'strategy, bytes':<16} {'us/call':>10} {'CPU us/call':>12}"]
    for strategy, s in summary.items():
        lines.append(f"  {strategy:<16} {s['us']:>10.1f} {s['cpu_us']:>12.1f}")
    return "\n".join(lines)


def build_parser():
    parser = cli.ArgumentParser(prog="python -m benchmarks.studies.shm_wait", description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--strategies", nargs="+", default=list(STRATEGIES), choices=STRATEGIES,
                        help=f"the wait strategies to compare (default: all of {', '.join(STRATEGIES)})")
    parser.add_argument("--rounds", type=int, default=21, help="rounds of alternation (default 21)")
    parser.add_argument("--iters", type=int, default=200, help="calls per round and strategy (default 200)")
    parser.add_argument("--bytes", nargs="+", type=parse_size, default=[8], help="sizes to time (default 8)")
    parser.add_argument("--busy", type=int, default=0, help="processes kept busy beside the ranks (default 0)")
    parser.add_argument("--gloo", action="store_true", help="also time Gloo over the same ranks")
    parser.add_argument("--json", default=None, help="also write the rounds and the summary here")
    return parser


@cli.command
def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    cli.check_at_least(parser, args, {"--world-size": 2, "--rounds": 1, "--iters": 1, "--busy": 0})
    cli.check_outputs(parser, {"--json": args.json})
    raw = collectives.run(measure, args.world_size, backend="gloo",
                          args=(list(dict.fromkeys(args.strategies)), args.rounds, args.iters,
                                tuple(dict.fromkeys(args.bytes)), args.busy, args.gloo), timeout=3600)[0]
    summary = summarise(raw)
    print(report(summary, args.world_size, args.busy))
    if args.json:
        cli.write_json(args.json, {"command": " ".join(["python -m benchmarks.studies.shm_wait", *(argv or sys.argv[1:])]),
                                   "world_size": args.world_size, "summary": summary, "raw": raw})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
