"""How many multi-rank test cases a minute: ranks started per test (spawned, or forked from the
fork server) against the pooled harness.

Each "test case" runs the same body on 2 ranks (an all_reduce checked against its closed form).
The three ways are alternated in one run: a case on freshly spawned ranks (`collectives.run`
with start_method="spawn", what torch.multiprocessing.spawn-style tests do), a case on ranks
forked from the fork server (`collectives.run`'s default), then a block of pooled cases
(`collectives.testing.run_on_ranks`), and so on; medians per case are reported.

    python -m benchmarks.studies.harness_speed                 # 2 ranks, 5 rounds
    python -m benchmarks.studies.harness_speed --json benchmarks/results/harness-speed.json
"""

from __future__ import annotations

import datetime
import os
import platform
import statistics
import time

import torch

import collectives
from collectives import cli
from collectives.cli import command
from collectives.testing import close_pools, get_pool, run_on_ranks


def _case(env):
    t = torch.tensor([env.rank + 1.0])
    collectives.all_reduce(t)
    assert t.item() == env.world_size * (env.world_size + 1) / 2
    return True


def build_parser():
    parser = cli.ArgumentParser(prog=cli.program_name(__name__), description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, default=2, help="ranks per test case (default 2)")
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds (default 5)")
    parser.add_argument("--pooled-per-round", type=int, default=50, help="pooled cases per round (default 50)")
    parser.add_argument("--json", help="write the figures and environment to this file")
    return parser


@command
def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    cli.check_outputs(parser, {"--json": args.json})

    per_test = {"spawn": [], "forkserver": []}
    pooled_s = []
    first_pool_start = time.perf_counter()
    get_pool(args.world_size).start()
    pool_start_s = time.perf_counter() - first_pool_start
    for i in range(args.rounds):
        for method, times in per_test.items():
            start = time.perf_counter()
            collectives.run(_case, world_size=args.world_size, start_method=method)
            times.append(time.perf_counter() - start)
        for _ in range(args.pooled_per_round):
            start = time.perf_counter()
            run_on_ranks(_case, args.world_size)
            pooled_s.append(time.perf_counter() - start)
        print(f"round {i + 1}/{args.rounds}: spawned {per_test['spawn'][-1]:.2f} s/case, forked "
              f"{per_test['forkserver'][-1]:.2f} s/case, pooled "
              f"{statistics.median(pooled_s[-args.pooled_per_round:]) * 1e3:.2f} ms/case", flush=True)
    close_pools()
    spawn, forked = statistics.median(per_test["spawn"]), statistics.median(per_test["forkserver"])
    pooled = statistics.median(pooled_s)
    total = args.rounds * args.pooled_per_round
    amortised = (pool_start_s + sum(pooled_s)) / total  # the pool's own start-up spread over its cases
    report = {
        "world_size": args.world_size,
        "spawn_per_test_s": spawn, "forkserver_per_test_s": forked, "pooled_per_test_s": pooled,
        "pool_start_s": pool_start_s, "pooled_amortised_per_test_s": amortised,
        "cases_per_minute_spawn": 60 / spawn, "cases_per_minute_forkserver": 60 / forked,
        "cases_per_minute_pooled": 60 / amortised,
        "spawn_over_forkserver": spawn / forked, "spawn_over_pooled": spawn / amortised,
    }
    print(f"\n{args.world_size}-rank test cases, medians over {args.rounds} cases started each way and {total} "
          "pooled cases:")
    print(f"  ranks spawned per test          : {spawn:.2f} s/case  = {60 / spawn:7.1f} cases/min")
    print(f"  ranks forked per test (default) : {forked:.2f} s/case  = {60 / forked:7.1f} cases/min "
          f"({spawn / forked:.1f}x the spawned rate)")
    print(f"  pooled harness                  : {pooled * 1e3:.2f} ms/case median; with the pool's {pool_start_s:.1f} s "
          f"start spread over {total} cases {amortised * 1e3:.1f} ms/case = {60 / amortised:7.0f} cases/min "
          f"({spawn / amortised:.0f}x the spawned rate)")
    if args.json:
        environment = {
            "date": datetime.date.today().isoformat(), "torch": torch.__version__, "backend": "gloo",
            "cpus": os.cpu_count(), "machine": platform.machine(),
            "command": cli.command_line("benchmarks.studies.harness_speed", argv),
        }
        cli.write_json(args.json, {"environment": environment, "results": report}, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
