"""What PowerSGD buys and costs, against plain DDP and fp16 compression, on our bucketed DDP.

    python -m benchmarks.powersgd bytes                          # elements all-reduced per step, counted
    python -m benchmarks.powersgd curves --world-size 2 --steps 300 --plot curves.png --json curves.json
    torchrun --nnodes 2 ... -m benchmarks.powersgd time --model small   # step time, on each host (see below)

Three parts:

- bytes: for each model and rank r, the elements one rank all-reduces in a compressed step,
  counted by PowerSGD itself, beside the closed form (r (rows + cols) per compressed rows x cols
  gradient, the others whole) and beside plain DDP's (every parameter). Runs 3 steps on 1 rank.
- curves: the same training (the small CNN on synthetic CIFAR-10, the same seeds) with plain
  DDP, fp16, PowerSGD rank 1 with and without error feedback, and rank 4; the loss of every step
  (averaged over the ranks) for each, and a plot. What the approximation costs in accuracy, and
  what error feedback does about it.
- time: step time of plain DDP, fp16 and PowerSGD, one step each per round in a shuffled order
  (the same on every rank), the slowest rank's, medians and per-round ratios to plain DDP. Made
  for ranks on hosts joined by a slow link: `bash benchmarks/across_hosts.sh` runs it on two
  namespace hosts with their links shaped (`python -m collectives.cluster up --link 500mbit`).

PowerSGD starts at step 2 in every part (start_powerSGD_iter=2): plain DDP before that.
"""

from __future__ import annotations

import copy
import os
import statistics

import torch
import torch.nn.functional as F
from tabulate import tabulate

import collectives
from collectives import cli
from collectives.launcher.start_methods import TRAINING, preload
from collectives.cli import command
from ddp_from_scratch.workload.models import MODELS, batch
from ddp_from_scratch.steps.powersgd import PowerSGD, compressed_numel
from ddp_from_scratch.wrap import wrap

from .parts.sweep import alternate_steps, summarise

START = 2  # start_powerSGD_iter in every part


def variants(ranks=(1,)):
    """{label: our DDP's compress option}: plain, fp16, PowerSGD at each rank."""
    out = {"plain": None, "fp16": "fp16"}
    for r in ranks:
        out[f"powersgd rank {r}"] = PowerSGD(matrix_approximation_rank=r, start_powerSGD_iter=START)
    return out


# -- bytes -----------------------------------------------------------------------------------------
def closed_form(model, rank: int, min_compression_rate: float = 2) -> int:
    """Elements one rank all-reduces in a compressed step: r (rows + cols) for each gradient that
    PowerSGD compresses, every element of the others."""
    total = 0
    for p in model.parameters():
        rows, cols = p.shape[0], p[0].numel() if p.dim() else 1
        r = min(rows, cols, rank)
        compress = (rows + cols) * r * min_compression_rate < rows * cols
        total += compressed_numel(rows, cols, rank) if compress else p.numel()
    return total


def count_bytes(env, model_name: str, ranks) -> list:
    rows = []
    for r in ranks:
        torch.manual_seed(0)
        ddp = wrap(MODELS[model_name](), "bucketed", compress=PowerSGD(matrix_approximation_rank=r,
                                                                        start_powerSGD_iter=START))
        counted = []
        for step in range(START + 1):
            before = ddp.compress.numel_all_reduced
            x, y = batch(step, env.rank, 2, 32)
            F.cross_entropy(ddp(x), y).backward()
            counted.append(ddp.compress.numel_all_reduced - before)
        plain = sum(p.numel() for p in ddp.parameters())
        rows.append({"model": model_name, "rank": r, "plain": plain, "counted": counted[-1],
                     "closed_form": closed_form(ddp.module, r), "plain_steps": counted[:START]})
    return rows


# -- curves ----------------------------------------------------------------------------------------
def curves(env, steps: int, batch_size: int, lr: float) -> dict:
    from ddp_from_scratch.workload.cifar10 import SyntheticCIFAR10

    data = SyntheticCIFAR10(steps * batch_size * env.world_size, seed=0)
    runs = {**variants((1, 4)),
            "powersgd rank 1, no error feedback": PowerSGD(matrix_approximation_rank=1, start_powerSGD_iter=START,
                                                           use_error_feedback=False)}
    losses = {}
    for label, compress in runs.items():
        torch.manual_seed(0)
        model = wrap(MODELS["small"](), "bucketed", compress=copy.deepcopy(compress))
        opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
        seen = []
        for step in range(steps):
            at = (step * env.world_size + env.rank) * batch_size
            x = torch.stack([data[i][0] for i in range(at, at + batch_size)])
            y = torch.tensor([data[i][1] for i in range(at, at + batch_size)])
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            seen.append(loss.detach())
        mean = torch.stack(seen)
        collectives.all_reduce(mean, op="avg")
        losses[label] = mean.tolist()
    return losses


def plot_curves(losses: dict, path: str, window: int = 10) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for label, ys in losses.items():
        smooth = [statistics.fmean(ys[max(0, i - window + 1):i + 1]) for i in range(len(ys))]
        ax.plot(range(1, len(ys) + 1), smooth, label=label, lw=1.2)
    ax.set_xlabel("step")
    ax.set_ylabel(f"loss ({window}-step mean over ranks)")
    ax.set_title("small CNN, synthetic CIFAR-10: PowerSGD from step 2 against plain DDP")
    ax.legend(fontsize=8)
    fig.tight_layout()
    cli.save_figure(fig, path, dpi=120)


# -- time ------------------------------------------------------------------------------------------
def step_times(env, model_name: str, rounds: int, batch_size: int, rank: int) -> dict:
    models = {}
    for label, compress in variants((rank,)).items():
        torch.manual_seed(0)
        models[label] = wrap(MODELS[model_name](), "bucketed", compress=compress)
    for step in range(START):  # past the plain steps, and past DDP's bucket rebuild
        for m in models.values():
            x, y = batch(step, env.rank, batch_size, 32)
            F.cross_entropy(m(x), y).backward()
    times = alternate_steps(env, models, rounds, batch_size)
    summary = summarise(times, "plain")
    hosts = [None] * env.world_size
    torch.distributed.all_gather_object(hosts, os.uname().nodename)
    return {"summary": summary, "hosts": hosts}


def build_parser():
    parser = cli.ArgumentParser(prog="python -m benchmarks.powersgd", description=__doc__.splitlines()[0])
    parser.add_argument("part", choices=["bytes", "curves", "time"])
    parser.add_argument("--world-size", type=int, default=2, help="ranks to spawn when not under torchrun (default 2)")
    parser.add_argument("--model", choices=sorted(MODELS), default="small", help="time: the model (default small)")
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4], help="bytes: PowerSGD ranks (default 1 2 4)")
    parser.add_argument("--rank", type=int, default=1, help="time: PowerSGD's rank (default 1)")
    parser.add_argument("--rounds", type=int, default=15, help="time: rounds of alternation (default 15)")
    parser.add_argument("--batch-size", type=int, default=16, help="images per rank per step (default 16)")
    parser.add_argument("--steps", type=int, default=300, help="curves: steps per run (default 300)")
    parser.add_argument("--lr", type=float, default=0.01, help="curves: SGD's learning rate (default 0.01)")
    parser.add_argument("--json", metavar="FILE", help="also write the results here")
    parser.add_argument("--plot", metavar="FILE.png", help="curves: draw the loss curves")
    return parser


@command
def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    cli.check_at_least(parser, args, {"--world-size": 1, "--rounds": 1, "--rank": 1, "--batch-size": 1, "--steps": 1})
    if min(args.ranks) < 1:
        parser.error(f"--ranks must all be at least 1, got {args.ranks}")
    if args.plot and args.part != "curves":
        parser.error("--plot draws the curves part only")
    cli.check_outputs(parser, {"--json": args.json, "--plot": args.plot})
    command_line = cli.command_line("benchmarks.powersgd", argv)
    if args.part != "bytes":
        preload(*TRAINING)  # every rank builds an optimizer: the fork server imports what that needs, once
    if args.part == "bytes":
        rows = [row for name in ("small", "resnet50")
                for row in collectives.run(count_bytes, 1, args=(name, args.ranks), backend="gloo")[0]]
        print(tabulate([[r["model"], r["rank"], r["plain"], r["counted"], r["closed_form"],
                         f"{r['plain'] / r['counted']:.1f}x"] for r in rows],
                       headers=["model", "rank", "plain DDP", "PowerSGD, counted", "closed form", "fewer"]))
        result = {"rows": rows}
    elif args.part == "curves":
        losses = collectives.run_or_join(curves, args.world_size, args=(args.steps, args.batch_size, args.lr),
                                         timeout=24 * 3600)
        if losses is None:
            return 0
        last = 50 if args.steps >= 100 else max(1, args.steps // 5)
        print(tabulate([[label, f"{statistics.fmean(ys[:10]):.4f}", f"{statistics.fmean(ys[-last:]):.4f}"]
                        for label, ys in losses.items()],
                       headers=["run", "loss, first 10 steps", f"loss, last {last} steps"]))
        if args.plot:
            plot_curves(losses, args.plot)
        result = {"losses": losses, "world_size": args.world_size, "steps": args.steps, "lr": args.lr}
    else:
        out = collectives.run_or_join(step_times, args.world_size, args=(args.model, args.rounds, args.batch_size,
                                                                       args.rank), timeout=24 * 3600)
        if out is None:
            return 0
        plain = out["summary"]["plain"]["median_s"]
        print(f"# {args.model}, batch {args.batch_size} per rank, ranks on hosts {out['hosts']}")
        print(tabulate([[label, f"{s['median_s']:.4f}", f"{s['ratio']:.3f} ({s['ratio_q1']:.3f}-{s['ratio_q3']:.3f})"]
                        for label, s in out["summary"].items()],
                       headers=["variant", "s / step (median)", "/ plain (q1-q3)"]))
        result = {**out, "model": args.model, "plain_median_s": plain}
    if args.json:
        cli.write_json(args.json, {"command": command_line, **result})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
