"""Training step time: torch's DDP against our naive, flat and bucketed wrappers, side by side.

    python -m benchmarks.ddp_step_time                        # ResNet-50, batch 32 per rank, 2 ranks
    python -m benchmarks.ddp_step_time --json benchmarks/results/ddp-step-time.json --rounds 7

In each round every variant does one full training step (zero_grad, forward, backward, SGD step)
in a random order that is the same on every rank; each step starts after a barrier and its time
is the slowest rank's. The tables give medians over rounds and the ratio to torch's DDP. A
"torch, no_sync" row (gradient sync switched off) shows what communication costs. Then a
bucket_cap_mb sweep (ours and torch's), and the seeds' table: one process, DDP on 2 and on 4
ranks, DDP on 2 ranks with AMP (bf16 autocast on CPU). Data is synthetic (CIFAR-shaped random
tensors): only the time is measured.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import random
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from tabulate import tabulate
from torch import nn

import collectives
from ddp_from_scratch.ddp import DistributedDataParallel as Bucketed
from ddp_from_scratch.flat import FlatDataParallel
from ddp_from_scratch.naive import NaiveDataParallel
from ddp_from_scratch.resnet import resnet50


def _make(kind: str, cap: float):
    torch.manual_seed(0)
    model = resnet50(num_classes=10)
    if kind == "torch":
        return nn.parallel.DistributedDataParallel(model, bucket_cap_mb=cap)
    if kind == "naive":
        return NaiveDataParallel(model)
    if kind == "flat":
        return FlatDataParallel(model)
    return Bucketed(model, bucket_cap_mb=cap)


def _steps(env, variants, rounds: int, batch: int, amp: bool):
    """{variant label: [slowest-rank seconds per step]} with variants alternated step by step."""
    models = {label: _make(kind, cap) for label, (kind, cap) in variants.items()}
    opts = {label: torch.optim.SGD(m.parameters(), lr=0.001, momentum=0.9) for label, m in models.items()}
    g = torch.Generator().manual_seed(env.rank)
    x, y = torch.randn(batch, 3, 32, 32, generator=g), torch.randint(0, 10, (batch,), generator=g)
    labels = list(variants)
    times = {label: [] for label in labels}
    order = random.Random(0)
    for i in range(rounds + 1):  # the first round warms up
        for label in order.sample(labels, len(labels)):
            model, opt = models[label], opts[label]
            no_sync = model.no_sync() if label.endswith("no_sync") else contextlib.nullcontext()
            dist.barrier()
            start = time.perf_counter()
            with no_sync:
                opt.zero_grad()
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
                    loss = F.cross_entropy(model(x), y)
                loss.backward()
            opt.step()
            elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            if i:
                times[label].append(elapsed.item())
    return times


def _run(world_size, variants, rounds, batch, amp=False):
    print(f"  {world_size} rank(s): {', '.join(variants)}{' (amp)' if amp else ''} ...", file=sys.stderr, flush=True)
    times = collectives.run(_steps, world_size, args=(variants, rounds, batch, amp), timeout=7200)[0]
    return {label: statistics.median(ts) for label, ts in times.items()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5, help="timed steps per variant (alternated)")
    parser.add_argument("--batch-size", type=int, default=32, help="images per rank per step")
    parser.add_argument("--caps", type=float, nargs="+", default=[1, 5, 25, 100], help="bucket_cap_mb values to sweep")
    parser.add_argument("--skip-table", action="store_true", help="skip the seeds-style table (4 ranks, AMP)")
    parser.add_argument("--json", help="write every median and the environment to this file")
    args = parser.parse_args(argv)
    report = {}

    main_variants = {"torch": ("torch", 25), "torch, no_sync": ("torch", 25), "naive": ("naive", 25),
                     "flat": ("flat", 25), "bucketed": ("bucketed", 25)}
    med = _run(2, main_variants, args.rounds, args.batch_size)
    report["comparison"] = med
    rows = [[label, f"{s:.3f}", f"{s / med['torch']:.3f}"] for label, s in med.items()]
    print(f"ResNet-50, batch {args.batch_size} per rank, 2 Gloo ranks with one thread each; median of "
          f"{args.rounds} alternated steps, slowest rank (synthetic data)")
    print(tabulate(rows, headers=["variant", "s / step", "/ torch"]))

    sweep = {}
    for cap in args.caps:
        sweep.update(_run(2, {f"torch cap {cap:g}": ("torch", cap), f"bucketed cap {cap:g}": ("bucketed", cap)},
                          args.rounds, args.batch_size))
    report["bucket_cap_sweep"] = sweep
    print("\nbucket_cap_mb sweep (2 ranks; torch and ours alternated at each cap)")
    print(tabulate([[f"{cap:g}", f"{sweep[f'torch cap {cap:g}']:.3f}", f"{sweep[f'bucketed cap {cap:g}']:.3f}",
                     f"{sweep[f'bucketed cap {cap:g}'] / sweep[f'torch cap {cap:g}']:.3f}"] for cap in args.caps],
                   headers=["bucket_cap_mb", "torch s/step", "ours s/step", "ours / torch"]))

    if not args.skip_table:
        pair = {"torch": ("torch", 25), "bucketed": ("bucketed", 25)}
        table = {"one process": _run(1, pair, args.rounds, args.batch_size),
                 "DDP, 2 ranks": {k: med[k] for k in pair},
                 "DDP, 4 ranks": _run(4, pair, args.rounds, args.batch_size),
                 "DDP, 2 ranks + AMP (bf16)": _run(2, pair, args.rounds, args.batch_size, amp=True)}
        report["seeds_table"] = table
        print("\nthe seeds' table, per step (images per step = batch x ranks); 2 CPU cores shared by all ranks")
        print(tabulate([[cfg, f"{t['torch']:.3f}", f"{t['bucketed']:.3f}", f"{t['bucketed'] / t['torch']:.3f}"]
                        for cfg, t in table.items()], headers=["configuration", "torch DDP s/step", "ours s/step", "ours / torch"]))
    if args.json:
        environment = {"date": datetime.date.today().isoformat(), "torch": torch.__version__, "cpus": os.cpu_count(),
                       "command": "python -m benchmarks.ddp_step_time " + " ".join(sys.argv[1:] if argv is None else argv)}
        with open(args.json, "w") as f:
            json.dump({"environment": environment, "seconds_per_step_median": report}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
