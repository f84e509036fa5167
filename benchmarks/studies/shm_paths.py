"""The shm all_reduce's paths side by side: through the segment with step 3 at once or in pieces,
and cross-memory attach; each against Gloo and against what this machine's memory can move.

    python -m benchmarks.studies.shm_paths --world-size 4
    python -m benchmarks.studies.shm_paths --world-size 2 --variants whole pieces=1M pieces=256K cma=1M cma=256K \\
        -b 1M -e 128M --json out.json

A variant is a path and its piece size: `whole` (the segment, step 3 at once), `pieces=SIZE`
(the segment, step 3 in pieces), `cma=SIZE` (collectives/shm/cma.py, pieces of SIZE; only where
every rank may use it). In one world of spawned ranks the default group is Gloo and every
variant has an shm group of its own over the same ranks. Every call alternates over all of
them, Gloo included, so each call finds the caches as the others left them; each call starts
after a barrier on its own group and is timed as the slowest rank's; medians over iterations.

Memory traffic: the bytes each rank reads and writes in memory for one all_reduce
(collectives.shm.python_path.all_reduce_traffic, counted from the paths' steps): on 2 ranks 4.5 n
(whole), 4 n (pieces), 2 n (cma); on 4 ranks 5.75 n, 4.5 n, 2 n. The roofline: every rank copies
64 MiB buffers at once (beyond the caches), after each size (this machine's memory bandwidth
drifts by half within minutes), and the best bytes read and written by all ranks together per
second are the most the machine's memory moves; an all_reduce cannot take less than p x traffic
/ that. The last column divides Gloo's time by that floor: the speed-up over Gloo that the
variant could reach on this machine at best.
"""

from __future__ import annotations

import argparse
import datetime
import sys

import torch
import torch.distributed as dist
from tabulate import tabulate

import collectives
from collectives import cli, machine
from collectives.cli import command
from collectives.shm import backend_of
from collectives.shm.python_path import all_reduce_traffic, small_limit

from ..parts.sweep import alternate_calls, check_sweep, parse_size, size_list
from ..parts.limits import aggregate_copy_gbps
from ..parts.nccl_format import bandwidths

HUGE = 1 << 62


def parse_variant(text: str):
    """"whole" -> ("whole", 0); "pieces=1M" -> ("pieces", 1048576); "cma=256K" -> ("cma", 262144)."""
    path, _, size = text.partition("=")
    if path == "whole" and not size:
        return ("whole", 0)
    if path in ("pieces", "cma") and size:
        piece = parse_size(size)
        if piece > 0:
            return (path, piece)
    raise argparse.ArgumentTypeError(f"a variant is whole, pieces=SIZE or cma=SIZE (SIZE > 0, e.g. 1M), not {text!r}")


def label(variant) -> str:
    path, piece = variant
    return "whole slice" if path == "whole" else f"{path}, {piece >> 10} KiB"


def run_all(env, config):
    variants = [tuple(v) for v in config["variants"]]
    groups = [None]
    for path, piece in variants:
        group = dist.new_group(backend="shm")
        backend_of(group).state.collectives.piece_bytes = piece or HUGE
        if path != "cma":
            backend_of(group).state.collectives.cma = None  # through the segment
        elif backend_of(group).state.collectives.cma is None:
            raise RuntimeError("cross-memory attach is not available to these ranks (collectives/shm/cma.py says "
                               "when it is): leave the cma variants out")
        groups.append(group)
    rows = []
    for nbytes in size_list(config["minbytes"], config["maxbytes"], config["stepfactor"]):
        iters = config["iters"] or (20 if nbytes <= 8 << 20 else 8 if nbytes <= 32 << 20 else 4)
        numel = max(1, nbytes // 4)
        buffers = [torch.ones(numel) for _ in groups]

        def call(group, buffers=buffers):
            buf = buffers[groups.index(group)]
            return lambda: dist.all_reduce(buf, group=group)

        seconds = alternate_calls([call(g) for g in groups], iters, groups=groups)
        # each buffer was all-reduced 1 + iters times from ones: every element is n ** (1 + iters)
        ok = all(bool((b == float(env.world_size) ** (iters + 1)).all()) for b in buffers)
        rows.append({"size": numel * 4, "gloo_s": seconds[0], "shm_s": list(seconds[1:]),
                     "paths": [backend_of(g).state.collectives.all_reduce_path(numel * 4) for g in groups[1:]], "check": ok,
                     "roofline_gbps": aggregate_copy_gbps(trials=2)})  # the machine's state drifts
        if env.rank == 0:
            print(f"[all_reduce] {numel * 4} B done", file=sys.stderr, flush=True)
    roof = max(row["roofline_gbps"] for row in rows)
    return {"world_size": env.world_size, "variants": variants, "rows": rows, "roofline_gbps": roof}


def report(result) -> str:
    p, roof, lines = result["world_size"], result["roofline_gbps"], []
    trials = [row.get("roofline_gbps", roof) for row in result["rows"]]
    lines.append(f"all_reduce on {p} ranks (float32), Gloo and every shm variant alternated. Roofline: all {p} ranks "
                 f"copying at once move {roof:.1f} GB/s (read + written, all ranks together; the best of trials after "
                 f"each size, which ranged {min(trials):.1f}-{max(trials):.1f})")
    table = []
    for row in result["rows"]:
        n = row["size"]
        _, bus_gloo = bandwidths(n, row["gloo_s"] * 1e6, "all_reduce", p)
        for k, (variant, t, path) in enumerate(zip(result["variants"], row["shm_s"], row["paths"])):
            _, bus = bandwidths(n, t * 1e6, "all_reduce", p)
            if path == "small":  # every rank adds every slot: another model
                model = ["", "", ""]
            else:
                moved = p * all_reduce_traffic(n, p, path)
                model = [f"{moved / t / 1e9:.1f}", f"{moved / t / 1e9 / roof:.0%}",
                         f"{row['gloo_s'] / (moved / (roof * 1e9)):.2f}x"]
            table.append([n if k == 0 else "", f"{row['gloo_s'] * 1e6:.0f} ({bus_gloo:.2f})" if k == 0 else "",
                          label(variant) + ("" if path == variant[0] else f" (took {path})"), f"{t * 1e6:.0f}",
                          f"{bus:.2f}", model[0], model[1], f"{row['gloo_s'] / t:.2f}x", model[2],
                          "ok" if row["check"] else "WRONG"])
    lines.append(tabulate(table, headers=["bytes", "gloo us (busbw)", "shm variant", "shm us", "busbw GB/s",
                                          "memory GB/s", "of roofline", "speed-up", "at the roofline", "result"],
                          disable_numparse=True))
    lines.append("memory GB/s: the bytes all ranks read and write for one call (collectives.shm.python_path.all_reduce_traffic) "
                 "over its time; 'at the roofline': Gloo's time over the least time that variant could take here")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = cli.ArgumentParser(prog="python -m benchmarks.studies.shm_paths", description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, default=4, help="ranks to spawn")
    parser.add_argument("--variants", type=parse_variant, nargs="+",
                        default=[("whole", 0), ("pieces", 1 << 20), ("cma", 1 << 20)],
                        help="whole, pieces=SIZE, cma=SIZE (default: whole pieces=1M cma=1M)")
    parser.add_argument("-b", "--minbytes", type=parse_size, default=parse_size("1M"), help="smallest size, bytes")
    parser.add_argument("-e", "--maxbytes", type=parse_size, default=parse_size("128M"), help="largest size, bytes")
    parser.add_argument("-f", "--stepfactor", type=int, default=4, help="multiply the size by this each step")
    parser.add_argument("--iters", type=int, default=0, help="calls per size and group (0: 20 to 4 by size)")
    parser.add_argument("--json", metavar="FILE", help="write every measurement as JSON")
    return parser


@command
def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    cli.check_outputs(parser, {"--json": args.json})
    if args.world_size < 2 or args.iters < 0:
        parser.error("need --world-size >= 2 and --iters >= 0")
    check_sweep(args, parser)
    if args.minbytes <= small_limit(args.world_size):
        parser.error(f"sizes up to {small_limit(args.world_size) >> 10} KiB take shm's small path on "
                     f"{args.world_size} ranks, the same in every variant: start above it (-b)")
    config = {k: getattr(args, k) for k in ("variants", "minbytes", "maxbytes", "stepfactor", "iters")}
    result = collectives.run(run_all, args.world_size, args=(config,), timeout=6 * 3600)[0]
    print(f"# python -m benchmarks.studies.shm_paths {' '.join(argv)}")
    print(f"# {datetime.date.today().isoformat()}, torch {torch.__version__}, {machine.cpus()} cpus, one thread per rank")
    print(report(result))
    if args.json:
        cli.write_json(args.json, {**result, "command": "python -m benchmarks.studies.shm_paths " + " ".join(argv)})
    return 0 if all(r["check"] for r in result["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
