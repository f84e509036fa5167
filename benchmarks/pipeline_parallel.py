"""Pipeline schedules side by side: step time, the bubble each rank measured, and the activations
it held, against microbatches, beside the closed forms.

    python -m benchmarks.pipeline_parallel --stages 2 -m 2 4 8 16
    python -m benchmarks.pipeline_parallel --stages 2 -m 2 4 8 16 --json pp.json --timeline pp-timeline

An MLP of --depth Linear+Tanh layers (--width wide, and a last Linear to 10 classes) is cut into
--stages stages balanced by parameters (ddp_from_scratch/pipeline_parallel/split.py), one a rank,
each rank pinned to a core of its own where there are enough. Each round every schedule runs one
step (forward and backward of every microbatch of --microbatch-size rows) for every microbatch
count, in a shuffled order the same on every rank, after a barrier; a cell is the median over
--rounds rounds (after one warm-up round). Per rank, the executor's own timestamps give the share
of the step it spent not computing (its idle share: also the messages' time) and autograd's saved
tensors give the most activation bytes it held (measured, parameters excluded). The bubble is the
busiest rank's idle share: the closed form takes every stage as long as every other, and a stage
lighter than the busiest idles its difference as well (the first stage computes no gradient for
the model's input, so it is lighter here). Beside them:
(p-1)/(m+p-1), the bubble of GPipe and 1F1B when every stage's forward and backward take the same
time, and the microbatches each schedule holds at most (GPipe m, 1F1B min(m, p)).
--timeline PREFIX draws each schedule's last step at --timeline-m microbatches (PREFIX-<schedule>.png
and .json, a Chrome trace).
"""

from __future__ import annotations

import os
import random
import statistics
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import collectives
from collectives import cli
from collectives.launcher.start_methods import TRAINING, preload
from ddp_from_scratch.pipeline_parallel.schedule import SCHEDULES, bubble
from ddp_from_scratch.pipeline_parallel.split import split
from ddp_from_scratch.pipeline_parallel.stage import Stage


def _model(config) -> nn.Sequential:
    torch.manual_seed(0)
    w = config["width"]
    layers = [m for _ in range(config["depth"]) for m in (nn.Linear(w, w), nn.Tanh())]
    return nn.Sequential(*layers, nn.Linear(w, 10))


def measure(env, config) -> dict:
    torch.set_num_threads(1)
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) >= env.world_size:  # a core each: the bubble is the schedule's, not the scheduler's
        os.sched_setaffinity(0, {cpus[env.rank]})
    p, r = env.world_size, env.rank
    group = dist.new_group(backend=config["backend"])
    module = split(_model(config), p)[r]
    stage = Stage(module, r, p, group=group, loss_fn=F.cross_entropy)
    g = torch.Generator().manual_seed(1)
    rows = config["microbatch_size"]
    largest = max(config["counts"])
    x = torch.randn(largest * rows, config["width"], generator=g)
    y = torch.randint(0, 10, (largest * rows,), generator=g)
    stage.agree_shapes(x[:rows] if r == 0 else None)
    cells = [(name, m) for name in config["schedules"] for m in config["counts"]]
    order = random.Random(0)
    out = {f"{name} {m}": {"step_s": [], "idle": [], "compute_s": [], "saved": [], "in_flight": []} for name, m in cells}
    timelines = {}
    for k in range(config["rounds"] + 1):
        for name, m in order.sample(cells, len(cells)):
            xs, ys = list(x[:m * rows].split(rows)), list(y[:m * rows].split(rows))
            module.zero_grad(set_to_none=True)
            dist.barrier(group=group)
            result = stage.run(SCHEDULES[name](p, m)[r], xs if r == 0 else None, ys if r == p - 1 else None)
            if k == 0:
                continue  # warm-up
            cell = out[f"{name} {m}"]
            cell["step_s"].append(result.step_s)
            cell["idle"].append(result.idle_share)
            cell["compute_s"].append(result.compute_s)
            cell["saved"].append(result.peak_saved_bytes)
            cell["in_flight"].append(result.peak_in_flight)
            if m == config["timeline_m"]:
                timelines[name] = result
    return {"rank": r, "cells": out, "timelines": timelines}


def summarise(per_rank, config) -> list:
    rows = []
    p = len(per_rank)
    for name in config["schedules"]:
        for m in config["counts"]:
            key = f"{name} {m}"
            step = [max(rank["cells"][key]["step_s"][i] for rank in per_rank) for i in range(config["rounds"])]
            idle = [statistics.median(rank["cells"][key]["idle"]) for rank in per_rank]
            compute = [statistics.median(rank["cells"][key]["compute_s"]) * 1e3 for rank in per_rank]
            busiest = max(range(p), key=lambda q: compute[q])
            rows.append({"schedule": name, "microbatches": m, "step_ms": statistics.median(step) * 1e3,
                         "bubble": idle[busiest], "bubble_per_rank": idle, "compute_ms_per_rank": compute,
                         "closed_form": bubble(p, m),
                         "saved_bytes_per_rank": [max(rank["cells"][key]["saved"]) for rank in per_rank],
                         "in_flight_per_rank": [max(rank["cells"][key]["in_flight"]) for rank in per_rank]})
    return rows


def report(rows, p: int) -> str:
    from tabulate import tabulate

    table = [[r["schedule"], r["microbatches"], f"{r['step_ms']:.2f}", f"{r['bubble']:.3f}", f"{r['closed_form']:.3f}",
              " ".join(f"{b:.3f}" for b in r["bubble_per_rank"]), " ".join(f"{c:.1f}" for c in r["compute_ms_per_rank"]),
              " ".join(f"{b / 2**20:.2f}" for b in r["saved_bytes_per_rank"]),
              " ".join(map(str, r["in_flight_per_rank"]))] for r in rows]
    return tabulate(table, headers=["schedule", "m", "step ms", "bubble", f"(p-1)/(m+p-1), p={p}", "idle by rank",
                                    "compute ms by rank", "saved MiB by rank", "held by rank"])


def build_parser():
    parser = cli.ArgumentParser(prog="python -m benchmarks.pipeline_parallel",
                                description="GPipe and 1F1B side by side: step time, measured bubble and "
                                            "activations against microbatches.")
    parser.add_argument("--stages", type=int, default=2, help="pipeline stages, one a rank (default 2)")
    parser.add_argument("-m", "--microbatches", type=int, nargs="+", default=[2, 4, 8, 16],
                        help="microbatch counts (default 2 4 8 16: p to 8p for 2 stages)")
    parser.add_argument("--schedules", nargs="+", choices=sorted(SCHEDULES), default=["gpipe", "1f1b"],
                        help="schedules (default both)")
    parser.add_argument("--backend", choices=["gloo", "shm"], default="shm", help="the pipeline group's (default shm)")
    parser.add_argument("--width", type=int, default=512, help="layer width (default 512)")
    parser.add_argument("--depth", type=int, default=8, help="Linear+Tanh layers (default 8)")
    parser.add_argument("--microbatch-size", type=int, default=32, help="rows a microbatch (default 32)")
    parser.add_argument("--rounds", type=int, default=9, help="rounds after the warm-up one (default 9)")
    parser.add_argument("--json", default=None, help="also write every row here")
    parser.add_argument("--timeline", default=None, metavar="PREFIX",
                        help="draw each schedule's step as PREFIX-<schedule>.png and .json")
    parser.add_argument("--timeline-m", type=int, default=None, help="the microbatches drawn (default the median -m)")
    return parser


@cli.command
def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    cli.check_at_least(parser, args, {"--stages": 1, "--width": 1, "--depth": 1, "--microbatch-size": 1,
                                      "--rounds": 1})
    if min(args.microbatches) < 1:
        parser.error(f"-m: every microbatch count must be at least 1, got {args.microbatches}")
    if args.stages > 2 * args.depth + 1:
        parser.error(f"--stages {args.stages}: the model has {2 * args.depth + 1} layers (--depth {args.depth}), "
                     "at least one a stage")
    if "1f1b" in args.schedules and min(args.microbatches) < args.stages:
        parser.error(f"-m {min(args.microbatches)}: 1F1B needs at least as many microbatches as stages "
                     f"({args.stages})")
    counts = sorted(set(args.microbatches))
    timeline_m = args.timeline_m or counts[len(counts) // 2]
    if args.timeline and timeline_m not in counts:
        parser.error(f"--timeline-m {timeline_m} is not one of -m {counts}")
    outputs = {"--json": args.json}
    if args.timeline:
        outputs.update({f"--timeline ({name})": f"{args.timeline}-{name}.png" for name in args.schedules})
    cli.check_outputs(parser, outputs)
    config = {"stages": args.stages, "counts": counts, "schedules": list(dict.fromkeys(args.schedules)),
              "backend": args.backend, "width": args.width, "depth": args.depth,
              "microbatch_size": args.microbatch_size, "rounds": args.rounds, "timeline_m": timeline_m}
    preload(*TRAINING)
    per_rank = collectives.run(measure, args.stages, backend="gloo", args=(config,), timeout=3600)
    rows = summarise(per_rank, config)
    print(f"# {cli.command_line('benchmarks.pipeline_parallel', argv)}")
    print(f"# {args.stages} stages on {args.backend}, MLP {args.depth} x {args.width}, {args.microbatch_size} rows a "
          f"microbatch, {cli.cpus()} cpus, median over {args.rounds} rounds; idle: a rank's share of its step spent "
          "not computing (median); bubble: the busiest rank's idle share (a lighter stage idles that and its "
          "imbalance too); saved: the most activation bytes autograd held for backward")
    print(report(rows, args.stages))
    if args.timeline:
        from ddp_from_scratch.pipeline_parallel.timeline import plot, write_chrome_trace

        for name in config["schedules"]:
            results = [rank["timelines"][name] for rank in per_rank]
            plot(results, f"{args.timeline}-{name}.png", f"{name}, {args.stages} stages, {timeline_m} microbatches, "
                 f"one step as it ran on {args.backend}", "--timeline")
            write_chrome_trace(results, f"{args.timeline}-{name}.json", "--timeline")
    if args.json:
        cli.write_json(args.json, {"command": cli.command_line("benchmarks.pipeline_parallel", argv),
                                   "config": config, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
