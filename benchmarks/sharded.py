"""The sharded steps on ResNet-50: memory held per rank by each stage, and step time against torch's fully_shard.

    python -m benchmarks.sharded --world-size 2 --json sharded.json --plot sharded.png
    python -m benchmarks.sharded --world-size 4 --skip-time

Two parts, in one world of spawned Gloo ranks:

1. Memory: each stage (our DDP, with and without gradient_as_bucket_view, ZeRO-1, ZeRO-2 in one
   unit and in 25 MiB buckets, FSDP, and torch's fully_shard) trains ResNet-50 for two steps
   while ddp_from_scratch.parts.memory.HeldBytes
   samples what the rank holds (parameters, gradients, optimizer state; activations excluded);
   the peak of the second step (momentum exists by then) is reported per rank, largest rank, and
   as a ratio to DDP. Beside it, what each wrapper's own accounting predicts (FORMULAS; psi =
   parameter bytes, p = ranks, u = the largest unit's bytes), for SGD with momentum.
2. Step time: ResNet-50, batch 32 per rank, our FSDP and the other stages against torch's
   fully_shard on the same units, alternated step by step (the order shuffled each round, the
   same on every rank), the slowest rank's time, medians and per-round ratios.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys

import torch
import torch.nn.functional as F
from tabulate import tabulate

import collectives
from collectives import cli
from collectives.launcher.start_methods import TRAINING, preload
from collectives.cli import command
from ddp_from_scratch.wrap import SHARDED, STAGES as REGISTRY, wrap
from ddp_from_scratch.steps.fsdp import unit_plan
from ddp_from_scratch.parts.memory import HeldBytes
from ddp_from_scratch.workload.models import MODELS

from .parts.sweep import alternate_steps, summarise

MiB = 1 << 20
BUCKET_MB = 25  # "zero2-bucketed" here: DDP's bucket size
# Each row: a stage of wrap.STAGES (every sharded one, ours then torch's) or a variant of one, with its options.
ROWS = {
    "ddp": ("bucketed", {"timeline": False}),
    "ddp, gradient_as_bucket_view": ("bucketed", {"gradient_as_bucket_view": True, "timeline": False}),
    **{name: (name, {"bucket_cap_mb": BUCKET_MB} if name == "zero2-bucketed" else {}) for name in SHARDED},
    "fsdp, no prefetch": ("fsdp", {"prefetch": False}),
    "torch fully_shard": ("torch-fsdp", {}),
    "fsdp, per block": ("fsdp", {"units": "blocks"}),
    "torch fully_shard, per block": ("torch-fsdp", {"units": "blocks"}),
}
STAGES = list(ROWS)


def build(stage: str, net, lr: float = 0.001):
    """(model, optimizer) for a row; every rank passes the same seeded `net`."""
    name, options = ROWS[stage]
    model = wrap(net, name, **options)
    if REGISTRY[name].sharded and REGISTRY[name].ours:
        return model, model.optimizer(torch.optim.SGD, lr=lr, momentum=0.9)
    return model, torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)


def _step(model, opt, x, y) -> None:
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    opt.step()


def memory(env, stages, batch: int, image: int, model: str = "resnet50") -> dict:
    """Per stage: the peak of the second step's held bytes on this rank, by kind."""
    out = {}
    g = torch.Generator().manual_seed(env.rank)
    x, y = torch.randn(batch, 3, image, image, generator=g), torch.randint(0, 10, (batch,), generator=g)
    for stage in stages:
        torch.manual_seed(0)
        wrapped, opt = build(stage, MODELS[model]())
        held = HeldBytes(wrapped, opt)
        with held.watching_collectives():
            _step(wrapped, opt, x, y)
            held.peak = dict.fromkeys(held.peak, 0)  # the second step: momentum exists
            _step(wrapped, opt, x, y)
        held.sample()
        held.remove()
        out[stage] = dict(held.peak, samples=held.samples)
        del wrapped, opt, held
    net = MODELS[model]()
    params = dict(net.named_parameters())

    def unit_bytes(units):
        return sorted(sum(params[n].numel() * params[n].element_size() for n in names) for _, names in unit_plan(net, units))

    out["param_bytes"] = sum(p.numel() * p.element_size() for p in params.values())
    out["largest_unit_bytes"], out["second_unit_bytes"] = unit_bytes("children")[-2:][::-1]
    out["largest_block_bytes"] = unit_bytes("blocks")[-1]
    return out


def step_times(env, stages, rounds: int, batch: int) -> dict:
    models, opts = {}, {}
    for stage in stages:
        torch.manual_seed(0)
        models[stage], opts[stage] = build(stage, MODELS["resnet50"]())
    return alternate_steps(env, models, rounds, batch, opts=opts)


FORMULAS = {  # what each wrapper keeps at its peak (psi: parameter bytes, p: ranks, u: the largest unit)
    "ddp": "4 psi: params, .grad, buckets, momentum",
    "ddp, gradient_as_bucket_view": "3 psi: the .grad are the buckets",
    "zero1": "3 psi + psi/p + one gather group",
    "zero2": "2 psi + 2 psi/p: params, the packed grads, grad and momentum shards",
    "zero2-bucketed": "psi + 2 psi/p + buckets in flight in backward or one gather group after the step (not one formula)",
    "fsdp": "2 psi/p + 2u + (1+1/p) u2: shards, momentum, a unit, its grads, the next one prefetched",
    "fsdp, no prefetch": "2 psi/p + (1+1/p) u + 2 u2: u's reduce-scatter in flight while u2 computes",
    "torch fully_shard": "as fsdp; FSDP2's buffers in flight are not seen",
    "fsdp, per block": "2 psi/p + a block, its grads, a reduce-scatter in flight, the next prefetched (not one formula)",
    "torch fully_shard, per block": "as fsdp, per block; FSDP2's buffers in flight are not seen",
}


def predicted(stage: str, psi: float, p: int, unit: float, unit2: float, block: float) -> float:
    """The formula above, in bytes (zero1's gather group: up to 25 MiB and its row not included;
    u2: the second largest unit, which in ResNet-50 is the next one in backward)."""
    fsdp = 2 * psi / p + 2 * unit + (1 + 1 / p) * unit2
    return {"ddp": 4 * psi, "ddp, gradient_as_bucket_view": 3 * psi, "zero1": 3 * psi + psi / p,
            "zero2": 2 * psi + 2 * psi / p, "fsdp": fsdp,
            "fsdp, no prefetch": max(2 * psi / p + 2 * unit, 2 * psi / p + (1 + 1 / p) * unit + 2 * unit2),
            "torch fully_shard": fsdp}.get(stage)  # per block, bucketed: what overlaps at the peak varies


def _mib(nbytes) -> str:
    return "-" if nbytes is None else f"{nbytes / MiB:.1f}"


def memory_table(per_rank: list, p: int):
    worst = {stage: max(r[stage]["total"] for r in per_rank) for stage in STAGES if stage in per_rank[0]}
    psi, unit, unit2 = per_rank[0]["param_bytes"], per_rank[0]["largest_unit_bytes"], per_rank[0]["second_unit_bytes"]
    block = per_rank[0]["largest_block_bytes"]
    rows = []
    for stage, total in worst.items():
        r = max(per_rank, key=lambda rr: rr[stage]["total"])[stage]
        rows.append([stage, f"{r['params'] / MiB:.1f}", f"{r['grads'] / MiB:.1f}", f"{r['optimizer'] / MiB:.1f}",
                     f"{r['comm'] / MiB:.1f}",
                     f"{total / MiB:.1f}", f"{total / worst['ddp']:.3f}", _mib(predicted(stage, psi, p, unit, unit2, block)),
                     FORMULAS[stage]])
    return rows, ["stage", "params MiB", "grads MiB", "optimizer MiB", "comm MiB", "peak total MiB", "vs DDP",
                  "predicted MiB", "which is"]


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    per_rank = result["memory"]
    stages = [s for s in STAGES if s in per_rank[0]]
    worst = {s: max(per_rank, key=lambda r: r[s]["total"])[s] for s in stages}
    fig, ax = plt.subplots(figsize=(10, 4.4))
    bottom = [0.0] * len(stages)
    for kind in ("params", "grads", "optimizer", "comm"):
        values = [worst[s][kind] / MiB for s in stages]
        ax.bar(stages, values, bottom=bottom, label=kind)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.set_ylabel("MiB held by one rank (peak of a step)")
    ax.set_title(f"ResNet-50, {result['world_size']} ranks: parameters, gradients, optimizer state")
    ax.legend()
    plt.setp(ax.get_xticklabels(), rotation=20, ha="right")
    fig.tight_layout()
    cli.save_figure(fig, path, dpi=120)


def build_parser():
    p = cli.ArgumentParser(prog="python -m benchmarks.sharded", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--world-size", type=int, default=2, help="ranks to spawn")
    p.add_argument("--rounds", type=int, default=7, help="timed rounds (each trains every stage one step)")
    p.add_argument("--batch", type=int, default=32, help="images per rank per step for the step times")
    p.add_argument("--memory-batch", type=int, default=2, help="images per rank for the memory part (activations "
                   "are not counted, so a small batch gives the same figures faster)")
    p.add_argument("--skip-time", action="store_true", help="only the memory part")
    p.add_argument("--skip-memory", action="store_true", help="only the step times")
    p.add_argument("--time-stages", nargs="+", choices=STAGES,
                   default=["ddp", "zero1", "zero2", "zero2-bucketed", "fsdp", "fsdp, no prefetch", "torch fully_shard", "fsdp, per block",
                            "torch fully_shard, per block"],
                   help="stages in the step-time part")
    p.add_argument("--json", metavar="FILE", help="write every figure as JSON")
    p.add_argument("--from-json", metavar="FILE", help="print the tables (and --plot) of an earlier run's JSON, "
                   "running nothing")
    p.add_argument("--plot", metavar="FILE.png", help="draw the memory part as stacked bars")
    return p


@command
def main(argv=None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    cli.check_outputs(p, {"--json": args.json, "--plot": args.plot})
    cli.check_at_least(p, args, {"--world-size": 1, "--rounds": 1, "--batch": 1, "--memory-batch": 1})
    if args.world_size < 2:
        p.error("--world-size must be at least 2: sharding over one rank shards nothing")
    if args.skip_time and args.skip_memory:
        p.error("--skip-time and --skip-memory together leave nothing to run")
    if args.from_json:
        result = cli.load_json(p, "--from-json", args.from_json, keys=("world_size", "machine", "date"),
                               what="benchmarks.sharded --json run")
        if "memory" not in result and "step_time" not in result:
            p.error(f"--from-json {args.from_json}: the run has neither 'memory' nor 'step_time' figures")
        n = result["world_size"]
        args.time_stages = list(result.get("step_time", {})) or args.time_stages
    else:
        preload(*TRAINING)  # every rank builds an optimizer: the fork server imports what that needs, once
        result = run(args)
        n = result["world_size"]
    report(result, args, n)
    return 0


def run(args) -> dict:
    n = args.world_size
    result = {"world_size": n, "batch": args.batch, "date": datetime.date.today().isoformat(), "torch": torch.__version__,
              "machine": f"{platform.machine()}, {os.cpu_count()} CPUs", "command": cli.command_line("benchmarks.sharded")}
    with collectives.RankPool(n, backend="gloo") as pool:
        if not args.skip_memory:
            print(f"[memory] {len(STAGES)} stages, 2 steps each ...", file=sys.stderr, flush=True)
            result["memory"] = pool.submit(memory, args=(STAGES, args.memory_batch, 32), timeout=3600)
        if not args.skip_time:
            print(f"[step time] {len(args.time_stages)} stages x {args.rounds + 1} rounds of ResNet-50 batch "
                  f"{args.batch} ...", file=sys.stderr, flush=True)
            times = pool.submit(step_times, args=(args.time_stages, args.rounds, args.batch), timeout=24 * 3600)[0]
            result["step_time"] = summarise(times, "torch fully_shard" if "torch fully_shard" in times
                                            else args.time_stages[0])
    return result


def report(result: dict, args, n: int) -> None:
    print(f"# sharded steps on ResNet-50 ({sum(q.numel() for q in MODELS['resnet50']().parameters()):,} parameters, "
          f"fp32), {n} Gloo ranks, torch {torch.__version__}, {result['machine']}, {result['date']}")
    if "memory" in result:
        rows, headers = memory_table(result["memory"], n)
        print("\n## memory held by one rank (the largest rank), peak of a training step, SGD momentum 0.9\n")
        print(tabulate(rows, headers=headers))
        psi, unit = result["memory"][0]["param_bytes"], result["memory"][0]["largest_unit_bytes"]
        unit2 = result["memory"][0]["second_unit_bytes"]
        print(f"\n(psi = {psi / MiB:.1f} MiB of parameters, u = {unit / MiB:.1f} MiB in the largest unit (layer4), u2 = "
              f"{unit2 / MiB:.1f} MiB in the next (layer3); gradients "
              "include DDP's buckets, the packed\nreduce-scatter inputs and the shards; comm: a collective's own "
              "buffers; activations are not counted)")
    if "step_time" in result:
        reference = "torch fully_shard" if "torch fully_shard" in result["step_time"] else args.time_stages[0]
        rounds = len(next(iter(result["step_time"].values()))["steps"])
        print(f"\n## step time, ResNet-50 batch {result.get('batch', args.batch)} per rank, {rounds} rounds, alternated; "
              f"ratio to {reference} per round\n")
        print(tabulate([[label, f"{v['median_s']:.3f}", f"{v['ratio']:.3f}", f"{v['ratio_q1']:.3f}-{v['ratio_q3']:.3f}"]
                        for label, v in result["step_time"].items()],
                       headers=["stage", "median s", "ratio", "ratio q1-q3"]))
    if args.json and not args.from_json:
        cli.write_json(args.json, result)
    if args.plot and "memory" in result:
        plot(result, args.plot)


if __name__ == "__main__":
    sys.exit(main())
