"""Training step time: torch's DDP against our naive, flat and bucketed wrappers, side by side.

    python -m benchmarks.ddp_step_time                        # ResNet-50, batch 32 per rank, 2 ranks
    python -m benchmarks.ddp_step_time --model small --rounds 3 --caps --skip-table   # a quick look
    python -m benchmarks.ddp_step_time --json benchmarks/results/ddp-step-time.json --rounds 21

In each round every variant does one full training step (zero_grad, forward, backward, SGD step)
in a random order that is the same on every rank; each step starts after a barrier and its time
is the slowest rank's. The tables give medians over rounds and the median of the per-round
ratios to torch's DDP, with quartiles. A "torch again" row (a second, identical torch DDP) is
the control: its ratio is what noise alone does. A "torch, no_sync" row (gradient sync switched
off) shows what communication costs. Then a
bucket_cap_mb sweep (ours and torch's), and the configurations of the timing table in the tutorial
"Understanding Distributed Training in PyTorch" (2024): one process, DDP on 2 and on 4 ranks, DDP on
2 ranks with AMP (bf16 autocast on CPU). Data is synthetic (CIFAR-shaped random
tensors): only the time is measured.
"""

from __future__ import annotations

import datetime
import os
import sys
from typing import Optional

import torch
from tabulate import tabulate

import collectives
from collectives import cli
from collectives.launcher.start_methods import TRAINING, preload
from collectives.cli import command
from ddp_from_scratch.workload.models import MODELS
from ddp_from_scratch.wrap import wrap

from .parts.sweep import alternate_steps, summarise


# --variants name: (row label, (kind, bucket_cap_mb[, timeline]))
MAIN_VARIANTS = {"torch": ("torch", ("torch", None)), "control": ("torch again (control)", ("torch", None)),
                 "no_sync": ("torch, no_sync", ("torch", None)), "naive": ("naive", ("naive", None)),
                 "flat": ("flat", ("flat", None)), "bucketed": ("bucketed", ("bucketed", None)),
                 "no_timeline": ("bucketed, timeline=False", ("bucketed", None, False))}


# branchy is left out: a head no rank uses needs find_unused_parameters, which these variants do not set
MODEL_NAMES = {"resnet50": "ResNet-50", "small": "the small CNN (ddp_from_scratch.workload.models.SmallNet)"}


def _make(model: str, kind: str, cap: Optional[float], timeline: bool = True):
    torch.manual_seed(0)
    return wrap(MODELS[model](), kind, bucket_cap_mb=cap, timeline=None if timeline else False)


def _steps(env, model, variants, rounds: int, batch: int, amp: bool):
    """{variant label: [slowest-rank seconds per step, one per round]}, variants alternated step by step."""
    return alternate_steps(env, {label: _make(model, *spec) for label, spec in variants.items()}, rounds, batch, amp)


def _run(model, world_size, variants, rounds, batch, amp=False):
    print(f"  {world_size} rank(s): {', '.join(variants)}{' (amp)' if amp else ''} ...", file=sys.stderr, flush=True)
    return collectives.run(_steps, world_size, args=(model, variants, rounds, batch, amp), timeout=7200)[0]


def _ratio(entry) -> str:
    return f"{entry['ratio']:.3f} ({entry['ratio_q1']:.3f}-{entry['ratio_q3']:.3f})"


def build_parser():
    parser = cli.ArgumentParser(prog=cli.program_name(__name__), description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=list(MODEL_NAMES), default="resnet50", help="the model trained (default resnet50)")
    parser.add_argument("--rounds", type=int, default=11, help="timed steps per variant (alternated)")
    parser.add_argument("--batch-size", type=int, default=32, help="images per rank per step")
    parser.add_argument("--caps", type=float, nargs="*", default=[1, 5, 25, 100],
                        help="bucket_cap_mb values to sweep (none: no sweep)")
    parser.add_argument("--variants", nargs="+", choices=list(MAIN_VARIANTS), default=list(MAIN_VARIANTS),
                        help="rows of the first table (torch is always run: it is the reference)")
    parser.add_argument("--skip-table", action="store_true", help="skip the tutorial's configurations (4 ranks, AMP)")
    parser.add_argument("--json", help="write every step time, median and ratio, and the environment to this file")
    return parser


@command
def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    cli.check_outputs(parser, {"--json": args.json})
    report = {}
    how = (f"median of {args.rounds} rounds; in each round every variant does one step, in random order; "
           "'/ torch' is the median of the per-round ratios, with quartiles")

    main_variants = dict(v for k, v in MAIN_VARIANTS.items() if k == "torch" or k in args.variants)
    preload(*TRAINING)  # every rank builds an optimizer: the fork server imports what that needs, once
    med = summarise(_run(args.model, 2, main_variants, args.rounds, args.batch_size), "torch")
    report["comparison"] = med
    rows = [[label, f"{e['median_s']:.3f}", _ratio(e)] for label, e in med.items()]
    print(f"{MODEL_NAMES[args.model]}, batch {args.batch_size} per rank, 2 Gloo ranks with one thread each, slowest rank, "
          f"default bucket_cap_mb (synthetic data); {how}")
    print(tabulate(rows, headers=["variant", "s / step", "/ torch"]))
    print("'torch again' is a second, identical torch DDP: its ratio shows how far noise alone moves a ratio.")

    sweep = {}
    for cap in args.caps:
        sweep[cap] = summarise(_run(args.model, 2, {"torch": ("torch", cap), "bucketed": ("bucketed", cap)}, args.rounds,
                                    args.batch_size), "torch")
    if sweep:
        report["bucket_cap_sweep"] = {f"{cap:g}": v for cap, v in sweep.items()}
        print("\nbucket_cap_mb sweep (2 ranks; torch and ours alternated at each cap, every bucket that size)")
        print(tabulate([[f"{cap:g}", f"{v['torch']['median_s']:.3f}", f"{v['bucketed']['median_s']:.3f}",
                         _ratio(v["bucketed"])] for cap, v in sweep.items()],
                       headers=["bucket_cap_mb", "torch s/step", "ours s/step", "ours / torch"]))

    if not args.skip_table:
        pair = {"torch": ("torch", None), "bucketed": ("bucketed", None)}
        table = {"one process": summarise(_run(args.model, 1, pair, args.rounds, args.batch_size), "torch"),
                 "DDP, 2 ranks": ({k: med[k] for k in pair} if "bucketed" in med else
                                  summarise(_run(args.model, 2, pair, args.rounds, args.batch_size), "torch")),
                 "DDP, 4 ranks": summarise(_run(args.model, 4, pair, args.rounds, args.batch_size), "torch"),
                 "DDP, 2 ranks + AMP (bf16)": summarise(_run(args.model, 2, pair, args.rounds, args.batch_size, amp=True), "torch")}
        report["seeds_table"] = table
        print("\nthe configurations of a DDP tutorial's timing table, per step (images per step = batch x ranks); 2 CPU "
              "cores shared by all ranks")
        print(tabulate([[cfg, f"{t['torch']['median_s']:.3f}", f"{t['bucketed']['median_s']:.3f}", _ratio(t["bucketed"])]
                        for cfg, t in table.items()], headers=["configuration", "torch DDP s/step", "ours s/step", "ours / torch"]))
    if args.json:
        environment = {"date": datetime.date.today().isoformat(), "torch": torch.__version__, "cpus": os.cpu_count(),
                       "command": cli.command_line("benchmarks.ddp_step_time", argv)}
        cli.write_json(args.json, {"environment": environment, "seconds_per_step": report})
    return 0


if __name__ == "__main__":
    sys.exit(main())
