"""Where the shm all_reduce's small path should stop: native groups made with several small-path
limits, timed side by side on the same ranks at sizes around them.

    python -m benchmarks.studies.shm_small_path --world-size 2
    python -m benchmarks.studies.shm_small_path --world-size 8 --limits 16K 32K 64K -b 4K -e 128K --json out.json

On the small path every rank adds all the slots itself, in rank order: one barrier, but each rank
reads every slot, so what it reads grows with the ranks. Past the limit, each rank reduces one
slice and copies the others' (two barriers, each slot read once). The library's limit is
collectives.shm.python_path.small_limit(world size); here each group is made with a limit of its own
(python_path.small_limit is replaced while the group is made, on every rank alike). The first limit
given is the baseline.

Each round, for each size, the groups take turns, in an order that reverses from round to round.
A turn is a barrier on the group, then --iters calls of t.fill_(1) and collectives.shm.all_reduce(t)
(the native call without torch's dispatch, so the path's own cost shows), timed together. A cell is
the median over rounds of the slowest rank's microseconds per call. The ratio is the median, with
quartiles, of the per-round ratio to the baseline. Every call's result is checked against the
world size.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

import collectives
import collectives.shm as shm
from collectives import cli, machine
from collectives.shm import backend_of, new_group_with, python_path

from ..parts.sweep import check_sweep, parse_size, size_list


def _group_with_limit(limit: int):
    """A native shm group whose small path stops at `limit` bytes (half its round at most)."""
    kept = python_path.small_limit
    python_path.small_limit = lambda world_size: limit
    try:
        return new_group_with({"COLLECTIVES_SHM_PATH": "native"})
    finally:
        python_path.small_limit = kept


def measure(env, config) -> dict:
    torch.set_num_threads(1)
    limits, sizes = config["limits"], config["sizes"]
    groups = {limit: _group_with_limit(limit) for limit in limits}
    times = {f"{limit}/{nbytes}": [] for limit in limits for nbytes in sizes}
    wrong = 0
    for rnd in range(config["rounds"] + 1):
        for nbytes in sizes:
            t = torch.empty(max(1, nbytes // 4))
            for limit in (limits if rnd % 2 else limits[::-1]):
                group = groups[limit]
                dist.barrier(group=group)
                start = time.perf_counter()
                for _ in range(config["iters"]):
                    t.fill_(1.0)
                    shm.all_reduce(t, group=group)
                per = torch.tensor([(time.perf_counter() - start) / config["iters"] * 1e6], dtype=torch.float64)
                wrong += int((t != env.world_size).sum())
                dist.all_reduce(per, op=dist.ReduceOp.MAX)  # on the Gloo world, outside what is timed
                if rnd:  # the first round warms up
                    times[f"{limit}/{nbytes}"].append(per.item())
    total = torch.tensor([wrong])
    dist.all_reduce(total)
    paths = {f"{limit}/{nbytes}": backend_of(groups[limit]).state.collectives.all_reduce_path(nbytes)  # "small" or not
             for limit in limits for nbytes in sizes}
    return {"world_size": env.world_size, "limits": limits, "sizes": sizes, "times_us": times, "paths": paths,
            "wrong": int(total.item()), "library_limit": python_path.small_limit(env.world_size), "cores": machine.cpus()}


def _kib(nbytes: int) -> str:
    return f"{nbytes >> 10} KiB" if nbytes % 1024 == 0 else f"{nbytes} B"


def report(result: dict) -> str:
    limits, times = result["limits"], result["times_us"]
    base = limits[0]
    head = ["bytes"] + [f"limit {_kib(limits[0])} us"] + [f"limit {_kib(x)} us (/ {_kib(base)})" for x in limits[1:]]
    rows = []
    for nbytes in result["sizes"]:
        a = times[f"{base}/{nbytes}"]
        small = {limit: "*" if result["paths"][f"{limit}/{nbytes}"] == "small" else "" for limit in limits}
        row = [_kib(nbytes), f"{statistics.median(a):.1f}{small[base]}"]
        for limit in limits[1:]:
            b = times[f"{limit}/{nbytes}"]
            r = sorted(y / x for x, y in zip(a, b))
            q = len(r) // 4
            row.append(f"{statistics.median(b):.1f}{small[limit]} ({statistics.median(r):.3f}, {r[q]:.3f}-{r[-1 - q]:.3f})")
        rows.append(row)
    widths = [max(len(str(r[i])) for r in rows + [head]) for i in range(len(head))]
    lines = [f"float32 sum all_reduce (collectives.shm.all_reduce) on {result['world_size']} ranks, {result['cores']} "
             "cores: us per call, the slowest rank's, median over rounds; in brackets the per-round ratio to the "
             "first limit, median and quartiles; * the small path"]
    lines += ["  ".join(str(c).rjust(w) for c, w in zip(r, widths)) for r in [head] + rows]
    lines.append(f"the library's limit on {result['world_size']} ranks: {_kib(result['library_limit'])} "
                 f"(collectives.shm.python_path.small_limit); wrong elements: {result['wrong']}")
    return "\n".join(lines)


def build_parser():
    parser = cli.ArgumentParser(prog="python -m benchmarks.studies.shm_small_path", description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2, help="ranks to spawn (default 2)")
    parser.add_argument("--limits", nargs="+", type=parse_size, default=[16 << 10, 32 << 10, 64 << 10],
                        help="small-path limits to compare, the first the baseline (default 16K 32K 64K)")
    parser.add_argument("-b", "--minbytes", type=parse_size, default=parse_size("4K"), help="smallest size (default 4K)")
    parser.add_argument("-e", "--maxbytes", type=parse_size, default=parse_size("128K"),
                        help="largest size (default 128K)")
    parser.add_argument("-f", "--stepfactor", type=int, default=2, help="multiply the size by this (default 2)")
    parser.add_argument("--rounds", type=int, default=15, help="rounds (default 15); one more warms up")
    parser.add_argument("--iters", type=int, default=100, help="calls per turn (default 100)")
    parser.add_argument("--json", default=None, help="also write every round's times here")
    return parser


@cli.command
def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    cli.check_at_least(parser, args, {"--world-size": 2, "--rounds": 1, "--iters": 1, "--minbytes": 4})
    check_sweep(args, parser)
    cli.check_outputs(parser, {"--json": args.json})
    sizes = size_list(args.minbytes, args.maxbytes, args.stepfactor, with_end=True)
    config = {"limits": list(dict.fromkeys(args.limits)), "sizes": sizes, "rounds": args.rounds, "iters": args.iters}
    result = collectives.run(measure, args.world_size, backend="gloo", args=(config,), timeout=3600)[0]
    print(report(result))
    if args.json:
        result["command"] = cli.command_line("benchmarks.studies.shm_small_path", argv)
        cli.write_json(args.json, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
