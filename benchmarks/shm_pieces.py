"""The shm all_reduce's reduce step in pieces that stay in cache against the whole slice at once,
side by side, and how close each comes to what this machine's memory can move.

    python -m benchmarks.shm_pieces --world-size 4
    python -m benchmarks.shm_pieces --world-size 2 --pieces 0 1M 256K 64K -b 1M -e 128M --json out.json

In one world of spawned ranks the default group is Gloo, and every piece size has an shm group of
its own over the same ranks (0: the whole slice in one piece, as before pieces). Every call
alternates over all of them, Gloo included, so each call finds the caches as the others left
them; each call starts after a barrier on its own group and is timed as the slowest rank's;
medians over iterations.

Memory traffic: the bytes each rank reads and writes in memory for one all_reduce
(collectives.shm.ops.all_reduce_traffic, counted from the algorithm's steps): 4.5 n with the
whole slice or 4 n in pieces on 2 ranks, 5.75 n or 4.5 n on 4, for n bytes. The roofline: every rank
copies 64 MiB buffers at once (beyond the caches), after each size (this machine's memory
bandwidth drifts by half within minutes), and the best bytes read and written by all ranks
together per second are the most the machine's memory moves; an all_reduce cannot take less
than p x traffic / that. The last column divides Gloo's time by that floor: the speed-up over
Gloo that shm could reach on this machine at best.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

import torch
import torch.distributed as dist
from tabulate import tabulate

import collectives
from collectives.cli import command

from .bandwidth import parse_size, size_list
from .limits import aggregate_copy_gbps
from .nccl_format import bandwidths
from .shm import _timed
from collectives.shm.ops import all_reduce_traffic


def _label(piece: int) -> str:
    return "whole slice" if piece == 0 else f"{piece >> 10} KiB pieces"


def run_all(env, config):
    pieces = config["pieces"]
    groups = [None]
    for piece in pieces:
        group = dist.new_group(backend="shm")
        group._shm.piece_bytes = piece or (1 << 62)
        groups.append(group)
    rows = []
    for nbytes in size_list(config["minbytes"], config["maxbytes"], config["stepfactor"]):
        iters = config["iters"] or (20 if nbytes <= 8 << 20 else 8 if nbytes <= 32 << 20 else 4)
        numel = max(1, nbytes // 4)
        buffers = [torch.ones(numel) for _ in groups]

        def call(group, buffers=buffers):
            buf = buffers[groups.index(group)]
            return lambda: dist.all_reduce(buf, group=group)

        seconds = _timed(groups, call, iters)
        # each buffer was all-reduced 1 + iters times from ones: every element is n ** (1 + iters)
        ok = all(bool((b == float(env.world_size) ** (iters + 1)).all()) for b in buffers)
        rows.append({"size": numel * 4, "gloo_s": seconds[0], "shm_s": dict(zip(map(str, pieces), seconds[1:])),
                     "check": ok, "roofline_gbps": aggregate_copy_gbps(trials=2)})  # the machine's state drifts
        if env.rank == 0:
            print(f"[all_reduce] {numel * 4} B done", file=sys.stderr, flush=True)
    roof = max(row["roofline_gbps"] for row in rows)
    return {"world_size": env.world_size, "pieces": pieces, "rows": rows, "roofline_gbps": roof}


def report(result) -> str:
    p, roof, lines = result["world_size"], result["roofline_gbps"], []
    trials = [row.get("roofline_gbps", roof) for row in result["rows"]]
    lines.append(f"all_reduce on {p} ranks (float32), Gloo and shm with each piece size alternated. Roofline: all "
                 f"{p} ranks copying at once move {roof:.1f} GB/s (read + written, all ranks together; the best of "
                 f"trials after each size, which ranged {min(trials):.1f}-{max(trials):.1f})")
    table = []
    for row in result["rows"]:
        n = row["size"]
        _, bus_gloo = bandwidths(n, row["gloo_s"] * 1e6, "all_reduce", p)
        for k, piece in enumerate(result["pieces"]):
            t = row["shm_s"][str(piece)]
            moved = p * all_reduce_traffic(n, p, pieces=piece != 0)
            floor = moved / (roof * 1e9)
            _, bus = bandwidths(n, t * 1e6, "all_reduce", p)
            table.append([n if k == 0 else "", f"{row['gloo_s'] * 1e6:.0f} ({bus_gloo:.2f})" if k == 0 else "",
                          _label(piece), f"{t * 1e6:.0f}", f"{bus:.2f}", f"{moved / t / 1e9:.1f}",
                          f"{moved / t / 1e9 / roof:.0%}", f"{row['gloo_s'] / t:.2f}x", f"{row['gloo_s'] / floor:.2f}x",
                          "ok" if row["check"] else "WRONG"])
    lines.append(tabulate(table, headers=["bytes", "gloo us (busbw)", "shm step 3", "shm us", "busbw GB/s",
                                          "memory GB/s", "of roofline", "speed-up", "at the roofline", "result"],
                          disable_numparse=True))
    lines.append("memory GB/s: the bytes all ranks read and write for one call (collectives.shm.ops.all_reduce_traffic) "
                 "over its time; 'at the roofline': Gloo's time over the least time shm could take here")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.shm_pieces", description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, default=4, help="ranks to spawn")
    parser.add_argument("--pieces", type=parse_size, nargs="+", default=[0, 256 << 10],
                        help="step 3's piece sizes to compare (0: the whole slice at once)")
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
    if args.world_size < 2 or args.iters < 0 or any(k < 0 for k in args.pieces):
        parser.error("need --world-size >= 2, --iters >= 0 and piece sizes >= 0")
    if args.minbytes <= 16 << 10:
        parser.error("sizes up to 16 KiB take shm's small path, which has no step 3: start above it (-b)")
    config = {k: getattr(args, k) for k in ("pieces", "minbytes", "maxbytes", "stepfactor", "iters")}
    result = collectives.run(run_all, args.world_size, args=(config,), timeout=6 * 3600)[0]
    print(f"# python -m benchmarks.shm_pieces {' '.join(argv)}")
    print(f"# {datetime.date.today().isoformat()}, torch {torch.__version__}, {os.cpu_count()} cpus, one thread per rank")
    print(report(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**result, "command": "python -m benchmarks.shm_pieces " + " ".join(argv)}, f, indent=1)
    return 0 if all(r["check"] for r in result["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
