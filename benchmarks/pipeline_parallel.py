"""Pipeline schedules side by side: step time, the bubble each rank measured, and the activations
it held, against microbatches, beside the closed forms.

    python -m benchmarks.pipeline_parallel --stages 2 -m 2 4 8 16
    python -m benchmarks.pipeline_parallel --stages 2 -m 2 4 8 16 --json pp.json --timeline pp-timeline
    torchrun --nnodes 2 --nproc-per-node 1 ... -m benchmarks.pipeline_parallel --stages 2 --backend gloo   # across hosts

An MLP of --depth Linear+Tanh layers (--width wide, and a last Linear to 10 classes) is cut into
stages balanced by parameters (ddp_from_scratch/pipeline_parallel/split.py): --stages of them, one
a rank, for GPipe, 1F1B and zero bubble (so zero bubble and 1F1B run the same stages); --stages x
--chunks for interleaved 1F1B, rank r holding stages r, p + r, ... Each rank is pinned to a core of its own where there are enough. Each round every
schedule runs one step (forward and backward of every microbatch of --microbatch-size rows) for
every microbatch count, in a shuffled order the same on every rank, after a barrier; a cell is the
median over --rounds rounds (after one warm-up round). Per rank, the executor's own timestamps give
the share of the step it spent not computing (its idle share: also the messages' time) and
autograd's saved tensors give the most activation bytes it held (measured, parameters excluded, in
the warm-up round: the timed rounds run uncounted, as torch's schedules run, since counting runs
Python on every saved tensor; --count-saved counts in them too, to time what that costs).
The bubble is the least idle rank's share (the busiest stage's): the closed form takes every
stage as long as every other, and a stage lighter than the busiest idles its difference as well
(the first stage computes no gradient for the model's input, so it is lighter here). Beside them the closed form,
the bubble when every stage's forward and backward take the same time: (p-1)/(m+p-1) for GPipe
and 1F1B, (p-1)/(v m+p-1) interleaved, (p-1)/(3m+p-1) zero bubble (a forward, an input-gradient I
and a weight-gradient W each as long: in an MLP each is one matrix product a layer); and the
microbatches each holds at most (GPipe m, 1F1B min(m, p)).
--timeline PREFIX draws each schedule's last step at --timeline-m microbatches (PREFIX-<schedule>.png
and .json, a Chrome trace).
"""

from __future__ import annotations

import os
import random
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import collectives
from collectives import cli, machine
from collectives.launcher.env import read_env
from collectives.launcher.start_methods import TRAINING, preload
from ddp_from_scratch.pipeline_parallel.schedule import CHUNKED, SCHEDULES, bubble, make, rounds_of, stage_index
from ddp_from_scratch.pipeline_parallel.split import split
from ddp_from_scratch.pipeline_parallel.stage import Stage


def model(config) -> nn.Sequential:
    torch.manual_seed(0)
    w = config["width"]
    layers = [m for _ in range(config["depth"]) for m in (nn.Linear(w, w), nn.Tanh())]
    return nn.Sequential(*layers, nn.Linear(w, 10))


def memory_needed(stages: int, microbatches: int, rows: int, width: int, depth: int) -> int:
    """Bytes the run holds at most, all ranks together: every rank draws the inputs of the largest
    microbatch count (rows x width float32 each), and under GPipe the ranks between them save
    every microbatch's activations through the model's 2 depth + 1 layers (a Linear's input and a
    Tanh's output each: two rows x width tensors a layer), before any backward frees them."""
    one = rows * width * 4
    return stages * microbatches * one + microbatches * one * 2 * (2 * depth + 1)


def measure(env, config) -> dict:
    torch.set_num_threads(1)
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) >= env.world_size:  # a core each: the bubble is the schedule's, not the scheduler's
        os.sched_setaffinity(0, {cpus[env.rank]})  # (hosts on one machine, as namespaces, share its cores)
    p, r = env.world_size, env.rank
    group = dist.new_group(backend=config["backend"])
    v = config["chunks"]
    # GPipe and 1F1B: the model in p stages, one a rank; interleaved: in p*v, rank r holding r, p+r, ...
    cut = split(model(config), p * v)
    executors = {name: Stage([cut[stage_index(c, r, p)] for c in range(v)], r, p, group=group, loss_fn=F.cross_entropy)
                 if name == "interleaved" else Stage(split(model(config), p)[r], r, p, group=group,
                                                     loss_fn=F.cross_entropy)
                 for name in config["schedules"]}
    g = torch.Generator().manual_seed(1)
    rows = config["microbatch_size"]
    largest = max(config["counts"])
    x = torch.randn(largest * rows, config["width"], generator=g)
    y = torch.randint(0, 10, (largest * rows,), generator=g)
    for stage in executors.values():
        stage.agree_shapes(x[:rows] if r == 0 else None)
    cells = [(name, m) for name in config["schedules"] for m in config["counts"]]
    cells += [("torch " + name, m) for name, m in cells] if config["torch"] else []
    order = random.Random(0)
    out = {f"{name} {m}": {"step_s": [], "idle": [], "compute_s": [], "saved": [], "in_flight": [], "kinds_ms": []}
           for name, m in cells}
    timelines = {}
    torch_runs: dict = {}
    for k in range(config["rounds"] + 1):
        for name, m in order.sample(cells, len(cells)):
            if name.startswith("torch "):  # torch.distributed.pipelining's schedule on copies of the same chunks
                step_s = _torch_step(torch_runs, executors[name[6:]], name[6:], m, x[:m * rows], y[:m * rows], group)
                if k:
                    out[f"{name} {m}"]["step_s"].append(step_s)
                continue
            xs, ys = list(x[:m * rows].split(rows)), list(y[:m * rows].split(rows))
            stage = executors[name]
            for chunk in stage.chunks:
                chunk.zero_grad(set_to_none=True)
            dist.barrier(group=group)
            # the warm-up round counts the activations saved; the timed rounds run as torch's do, uncounted
            result = stage.run(make(name, p, m, v if name == "interleaved" else 1), xs if r == 0 else None,
                               ys if r == p - 1 else None, count_saved=k == 0 or config["count_saved"])
            cell = out[f"{name} {m}"]
            if k == 0:
                cell["saved"].append(result.peak_saved_bytes)
                continue
            cell["step_s"].append(result.step_s)
            cell["idle"].append(result.idle_share)
            cell["compute_s"].append(result.compute_s)
            cell["in_flight"].append(result.peak_in_flight)
            kinds: dict = {}  # compute ms by action kind (F, B, I, W) this step
            for action, _, began, ended in result.timeline:
                kinds[action.kind] = kinds.get(action.kind, 0.0) + (ended - began) * 1e3
            cell["kinds_ms"].append(kinds)
            if m == config["timeline_m"]:
                timelines[name] = result
    everyone = [None] * p  # every rank's cells on every rank: under torchrun only rank 0's result comes back
    dist.all_gather_object(everyone, {"rank": r, "cells": out, "timelines": timelines})
    return everyone


def _torch_step(runs: dict, ours: Stage, name: str, m: int, x, y, group) -> float:
    """One step of torch.distributed.pipelining's schedule `name` over `m` microbatches, on deep
    copies of the chunks our executor runs (made once per schedule and count), on the same group:
    this rank's seconds from the barrier's end to the step's end."""
    import copy

    import torch.distributed.pipelining as pipelining

    from ddp_from_scratch.pipeline_parallel.parity import TORCH_SCHEDULES

    p, r = ours.ranks, ours.rank
    if (name, m) not in runs:
        chunks = [copy.deepcopy(c) for c in ours.chunks]
        stages = [pipelining.PipelineStage(c, stage_index(i, r, p), p * len(chunks), torch.device("cpu"), group=group)
                  for i, c in enumerate(chunks)]
        schedule = getattr(pipelining, TORCH_SCHEDULES[name])(stages if name in CHUNKED else stages[0], m,
                                                              loss_fn=F.cross_entropy)
        runs[(name, m)] = (schedule, chunks)
    schedule, chunks = runs[(name, m)]
    for c in chunks:
        c.zero_grad(set_to_none=True)
    dist.barrier(group=group)
    start = time.perf_counter()
    if r == 0:
        schedule.step(x)
    elif r == p - 1:
        schedule.step(target=y)
    else:
        schedule.step()
    return time.perf_counter() - start


def summarise(per_rank, config) -> list:
    rows = []
    p = len(per_rank)
    for name in config["schedules"]:
        for m in config["counts"]:
            key = f"{name} {m}"
            step = [max(rank["cells"][key]["step_s"][i] for rank in per_rank) for i in range(config["rounds"])]
            idle = [statistics.median(rank["cells"][key]["idle"]) for rank in per_rank]
            compute = [statistics.median(rank["cells"][key]["compute_s"]) * 1e3 for rank in per_rank]
            torch_ms = None
            if config["torch"]:
                theirs = [max(rank["cells"][f"torch {key}"]["step_s"][i] for rank in per_rank)
                          for i in range(config["rounds"])]
                torch_ms = statistics.median(theirs) * 1e3
                ratio = statistics.median(a / b for a, b in zip(step, theirs))
            kinds = {kind: [statistics.median(s.get(kind, 0.0) for s in rank["cells"][key]["kinds_ms"])
                            for rank in per_rank] for kind in ("F", "B", "I", "W")}
            rows.append({"schedule": name, "microbatches": m, "step_ms": statistics.median(step) * 1e3,
                         "torch_step_ms": torch_ms, "ours_over_torch": ratio if config["torch"] else None,
                         "compute_ms_by_kind_per_rank": kinds,
                         "bubble": min(idle), "bubble_per_rank": idle, "compute_ms_per_rank": compute,
                         "closed_form": bubble(p, m, config["chunks"] if name == "interleaved" else 1,
                                               split=name == "zero-bubble"),
                         "saved_bytes_per_rank": [max(rank["cells"][key]["saved"]) for rank in per_rank],
                         "in_flight_per_rank": [max(rank["cells"][key]["in_flight"]) for rank in per_rank]})
    return rows


def report(rows, p: int) -> str:
    from tabulate import tabulate

    table = [[r["schedule"], r["microbatches"], f"{r['step_ms']:.2f}", f"{r['bubble']:.3f}", f"{r['closed_form']:.3f}",
              " ".join(f"{b:.3f}" for b in r["bubble_per_rank"]), " ".join(f"{c:.1f}" for c in r["compute_ms_per_rank"]),
              " ".join(f"{b / 2**20:.2f}" for b in r["saved_bytes_per_rank"]),
              " ".join(map(str, r["in_flight_per_rank"]))] for r in rows]
    text = tabulate(table, headers=["schedule", "m", "step ms", "bubble", f"closed form, p={p}", "idle by rank",
                                    "compute ms by rank", "saved MiB by rank", "held by rank"])
    if rows and rows[0]["torch_step_ms"] is not None:
        side = [[r["schedule"], r["microbatches"], f"{r['step_ms']:.2f}", f"{r['torch_step_ms']:.2f}",
                 f"{r['ours_over_torch']:.3f}"] for r in rows]
        text += "\n\nthe same stages under torch.distributed.pipelining's schedules, in the same rounds\n"
        text += tabulate(side, headers=["schedule", "m", "ours ms", "torch ms", "ours / torch (per-round median)"])
    split_rows = [(r, f) for r in rows if r["schedule"] == "zero-bubble"
                  for f in [next((o for o in rows if o["schedule"] == "1f1b" and o["microbatches"] == r["microbatches"]),
                                 None)] if f is not None]
    if split_rows:
        lines = ["", "zero bubble's I + W against 1F1B's B, compute ms a step by rank (the same stages and products):"]
        for zb, whole in split_rows:
            k, b = zb["compute_ms_by_kind_per_rank"], whole["compute_ms_by_kind_per_rank"]["B"]
            ratios = " ".join(f"{(i + w) / bb:.2f}" if bb else "-" for i, w, bb in zip(k["I"], k["W"], b))
            lines.append(f"  m={zb['microbatches']}: I + W {' '.join(f'{i + w:.1f}' for i, w in zip(k['I'], k['W']))}"
                         f", B {' '.join(f'{bb:.1f}' for bb in b)}: (I + W) / B {ratios}")
        text += "\n".join(lines)
    return text


def build_parser():
    parser = cli.ArgumentParser(prog="python -m benchmarks.pipeline_parallel",
                                description="GPipe, 1F1B, interleaved 1F1B and zero bubble side by side: step time, "
                                            "measured bubble and activations against microbatches.")
    parser.add_argument("--stages", type=int, default=2, help="pipeline stages, one a rank (default 2)")
    parser.add_argument("-m", "--microbatches", type=int, nargs="+", default=[2, 4, 8, 16],
                        help="microbatch counts (default 2 4 8 16: p to 8p for 2 stages)")
    parser.add_argument("--schedules", nargs="+", choices=sorted(SCHEDULES), default=list(SCHEDULES),
                        help="schedules (default all four)")
    parser.add_argument("--chunks", type=int, default=2,
                        help="model chunks a rank for interleaved (v; the model is cut into stages x v; default 2)")
    parser.add_argument("--backend", choices=["gloo", "shm"], default="shm", help="the pipeline group's (default shm)")
    parser.add_argument("--width", type=int, default=512, help="layer width (default 512)")
    parser.add_argument("--depth", type=int, default=8, help="Linear+Tanh layers (default 8)")
    parser.add_argument("--microbatch-size", type=int, default=32, help="rows a microbatch (default 32)")
    parser.add_argument("--rounds", type=int, default=9, help="rounds after the warm-up one (default 9)")
    parser.add_argument("--json", default=None, help="also write every row here")
    parser.add_argument("--no-torch", action="store_true",
                        help="leave out torch.distributed.pipelining's schedules (by default each is timed on "
                             "copies of the same stages, in the same rounds)")
    parser.add_argument("--count-saved", action="store_true",
                        help="count the saved activations in the timed rounds too (by default only the warm-up "
                             "round counts them): what counting costs, against a run without this")
    parser.add_argument("--timeline", default=None, metavar="PREFIX",
                        help="draw each schedule's step as PREFIX-<schedule>.png and .json")
    parser.add_argument("--timeline-m", type=int, default=None, help="the microbatches drawn (default the median -m)")
    return parser


@cli.command
def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    cli.check_at_least(parser, args, {"--stages": 1, "--width": 1, "--depth": 1, "--microbatch-size": 1,
                                      "--rounds": 1, "--chunks": 1})
    if "interleaved" not in args.schedules:
        args.chunks = 1  # the stages are cut for one chunk a rank
    if min(args.microbatches) < 1:
        parser.error(f"-m: every microbatch count must be at least 1, got {args.microbatches}")
    if args.stages * args.chunks > 2 * args.depth + 1:
        parser.error(f"--stages {args.stages} x --chunks {args.chunks}: the model has {2 * args.depth + 1} layers "
                     f"(--depth {args.depth}), at least one a stage")
    for m in args.microbatches:
        for name in CHUNKED:  # the schedules whose rounds of about p must divide m
            if name in args.schedules and m >= 1 and m % rounds_of(args.stages, m):
                parser.error(f"-m {m}: {name} runs the microbatches in rounds of about one a stage, and "
                             f"{rounds_of(args.stages, m)} rounds do not divide {m}")
    if "1f1b" in args.schedules and min(args.microbatches) < args.stages:
        parser.error(f"-m {min(args.microbatches)}: 1F1B needs at least as many microbatches as stages "
                     f"({args.stages})")
    counts = sorted(set(args.microbatches))
    cli.check_memory(parser, "-m", memory_needed(args.stages, max(counts), args.microbatch_size, args.width,
                                                 args.depth),
                     f"{args.stages} ranks, each with the {max(counts)} microbatches' inputs of {args.microbatch_size}"
                     f" x {args.width} floats, and their activations saved under GPipe")
    timeline_m = args.timeline_m or counts[len(counts) // 2]
    if args.timeline and timeline_m not in counts:
        parser.error(f"--timeline-m {timeline_m} is not one of -m {counts}")
    outputs = {"--json": args.json}
    if args.timeline:
        outputs.update({f"--timeline ({name})": f"{args.timeline}-{name}.png" for name in args.schedules})
    cli.check_outputs(parser, outputs)
    config = {"stages": args.stages, "chunks": args.chunks, "counts": counts, "schedules": list(dict.fromkeys(args.schedules)),
              "backend": args.backend, "width": args.width, "depth": args.depth,
              "microbatch_size": args.microbatch_size, "rounds": args.rounds, "timeline_m": timeline_m,
              "torch": not args.no_torch, "count_saved": args.count_saved}
    preload(*TRAINING)
    cores = machine.cpus()  # before the ranks pin themselves to a core each (under torchrun, this process is one)
    launched = read_env(os.environ)
    if launched["master_addr"] is not None and launched["world_size"] != args.stages:
        parser.error(f"--stages {args.stages}: under torchrun or srun the pipeline has one stage a rank, and the job "
                     f"has {launched['world_size']} ranks")
    per_rank = collectives.run_or_join(measure, args.stages, backend="gloo", args=(config,), timeout=3600)
    if per_rank is None:  # a torchrun/srun rank other than 0: rank 0 reports
        return 0
    rows = summarise(per_rank, config)
    print(f"# {cli.command_line('benchmarks.pipeline_parallel', argv)}")
    print(f"# {args.stages} stages on {args.backend}, MLP {args.depth} x {args.width}, {args.microbatch_size} rows a "
          f"microbatch, {cores} cpus, median over {args.rounds} rounds; idle: a rank's share of its step spent "
          "not computing (median); bubble: the least idle rank's share (a lighter stage idles that and its "
          "imbalance too); saved: the most activation bytes autograd held for backward (counted in the warm-up "
          f"round{' and the timed ones' if args.count_saved else ''})")
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
