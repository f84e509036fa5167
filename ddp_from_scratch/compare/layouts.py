"""The compare program's layouts table (python -m ddp_from_scratch.compare --impl layouts): the
training program's transformer run on every layout, 8 steps on real text, against the one-rank
model: every step's loss, the validation loss and every final parameter.

    python -m ddp_from_scratch.compare --impl layouts                 # 8 steps each; exit 1 on a row out of bounds
    python -m ddp_from_scratch.compare --impl layouts --steps 4

Each layout trains the same model (the same seed), on the same global batch of 8 sequences a
step (each data-parallel replica taking its rows), from Python's documentation; each writes its
checkpoint at the end, and its final parameters are put back into the one-rank model's order from
the shards (train/places.py). A row gives the largest difference from the one-rank run and the
bound it must stay within, with the reason:

- bitwise, where the arithmetic is the one rank's: a pipeline of one microbatch (the stages only
  pass the activations on);
- float32 rounding (losses within 1e-5 relative, parameters within 1e-6 absolute after 8 SGD
  steps with momentum, lr 0.05; measured: losses 2 ulps, parameters 6e-8), where a sum is split
  over ranks and added in another order: the replicas' means averaged (DP), the row-parallel
  layers' partial sums and the vocabulary shards' softmax sums (TP, SP), the microbatches' means
  averaged and their gradients accumulated (PP), the ring's blocks merged (CP).

`layout_rows(steps, runner=...)` runs each layout with `runner(loop, ranks, args=(config,))`:
collectives.run by default (fresh ranks), the test harness's pooled ranks in the tests.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import sys
import tempfile
from typing import List, Optional, Tuple

import torch

import collectives

from ..train.args import TrainConfig, build_parser
from ..train.cp import train_cp
from ..train.pp import train_pp
from ..train.sharded_checkpoint import one_rank_vector
from ..train.tp import train_tp

LAYOUTS_IMPL = "layouts"
GLOBAL_BATCH = 8
LOSS_RTOL, LOSS_ATOL, PARAM_ATOL = 1e-5, 1e-6, 1e-6
LAYOUT_HEADERS = ["layout", "ranks", "steps", "max |loss diff|", "|validation diff|", "max |parameter diff|", "bound",
                  "within", "why the bound"]

WHY_SUMS = {
    "dp": "the replicas' mean losses averaged, their gradients summed by all_reduce: another order of addition",
    "tp": "row-parallel partial sums all-reduced, the vocabulary shards' softmax sums: another order of addition",
    "pp": "the microbatches' mean losses averaged, their gradients accumulated: another order of addition",
    "cp": "the ring's blocks merged by their log-sum-exp: another order of addition in attention",
}


@dataclasses.dataclass(frozen=True)
class Layout:
    name: str
    loop: object
    ranks: int
    flags: Tuple[str, ...]
    bitwise: bool
    why: str


LAYOUTS = [
    Layout("PP 2, GPipe, 1 microbatch", train_pp, 2, ("--pp", "2", "--schedule", "gpipe", "--microbatches", "1"), True,
           "the one rank's products and sums: the stages only pass the activations on"),
    Layout("DP 2", train_tp, 2, ("--tp", "1"), False, WHY_SUMS["dp"]),
    Layout("TP 2", train_tp, 2, ("--tp", "2"), False, WHY_SUMS["tp"]),
    Layout("TP 2 + SP", train_tp, 2, ("--tp", "2", "--sequence-parallel"), False, WHY_SUMS["tp"]),
    Layout("TP 2 x DP 2", train_tp, 4, ("--tp", "2"), False, WHY_SUMS["tp"] + "; " + WHY_SUMS["dp"]),
    Layout("PP 2, GPipe", train_pp, 2, ("--pp", "2", "--schedule", "gpipe", "--microbatches", "4"), False,
           WHY_SUMS["pp"]),
    Layout("PP 2, 1F1B", train_pp, 2, ("--pp", "2", "--schedule", "1f1b", "--microbatches", "4"), False, WHY_SUMS["pp"]),
    Layout("PP 2, interleaved (2 chunks)", train_pp, 2, ("--pp", "2", "--schedule", "interleaved", "--microbatches", "4"),
           False, WHY_SUMS["pp"]),
    Layout("PP 2, zero bubble (2 chunks)", train_pp, 2, ("--pp", "2", "--schedule", "zero-bubble", "--microbatches", "4"),
           False, WHY_SUMS["pp"]),
    Layout("PP 2 x DP 2", train_pp, 4, ("--pp", "2", "--microbatches", "2"), False,
           WHY_SUMS["pp"] + "; " + WHY_SUMS["dp"]),
    Layout("PP 2 x TP 2 x DP 2", train_pp, 8, ("--pp", "2", "--tp", "2", "--microbatches", "2"), False,
           "; ".join(WHY_SUMS[k] for k in ("pp", "tp", "dp"))),
    Layout("CP 2", train_cp, 2, ("--cp", "2"), False, WHY_SUMS["cp"]),
]
ONE_RANK = Layout("one rank", train_tp, 1, ("--tp", "1"), True, "the reference")


def _config(layout: Layout, steps: int, folder: str) -> TrainConfig:
    replicas = layout.ranks
    for flag in ("--tp", "--pp", "--cp"):
        if flag in layout.flags:
            replicas //= int(layout.flags[layout.flags.index(flag) + 1])
    argv = [*layout.flags, "--batch-size", str(GLOBAL_BATCH // replicas), "--train-size", str(GLOBAL_BATCH * steps),
            "--lr", "0.05", "--eval-every", str(steps), "--checkpoint", folder]
    return TrainConfig.from_args(build_parser().parse_args(argv))


def run_layout(layout: Layout, steps: int, folder: str, runner=None) -> Tuple[dict, torch.Tensor]:
    """Rank 0's summary of `layout`'s run, and its final parameters in the one-rank model's order."""
    runner = runner or (lambda loop, n, args: collectives.run(loop, n, args=args, timeout=3600))
    summary = runner(layout.loop, layout.ranks, args=(_config(layout, steps, folder),))[0]
    return summary, one_rank_vector(folder)


def row(layout: Layout, got: Tuple[dict, torch.Tensor], ref: Tuple[dict, torch.Tensor]) -> Tuple[list, bool]:
    (summary, params), (one, one_params) = got, ref
    a, b = torch.tensor(summary["losses"]), torch.tensor(one["losses"])
    loss_diff = (a - b).abs().max().item()
    validation_diff = abs(summary["validation_loss"] - one["validation_loss"])
    param_diff = (params - one_params).abs().max().item()
    if layout.bitwise:
        within, bound = torch.equal(a, b) and validation_diff == 0 and torch.equal(params, one_params), "bitwise"
    else:
        within = (bool(((a - b).abs() <= LOSS_ATOL + LOSS_RTOL * b.abs()).all())
                  and validation_diff <= LOSS_ATOL + LOSS_RTOL * abs(one["validation_loss"])
                  and param_diff <= PARAM_ATOL)
        bound = f"loss {LOSS_RTOL:g} rel, params {PARAM_ATOL:g}"
    return [layout.name, layout.ranks, len(summary["losses"]), f"{loss_diff:.2e}", f"{validation_diff:.2e}",
            f"{param_diff:.2e}", bound, "yes" if within else "NO", layout.why], within


def layout_rows(steps: int = 8, layouts: Optional[List[Layout]] = None, progress: bool = True,
                runner=None) -> Tuple[list, bool]:
    """Every layout's row, and whether all are within their bounds."""
    layouts = LAYOUTS if layouts is None else layouts
    folder = tempfile.mkdtemp(prefix="compare-layouts-")
    try:
        ref = run_layout(ONE_RANK, steps, os.path.join(folder, "one-rank"), runner)
        rows, ok = [], True
        for i, layout in enumerate(layouts):
            if progress:
                print(f"[{i + 1}/{len(layouts)}] {layout.name} on {layout.ranks} ranks ...", file=sys.stderr, flush=True)
            r, within = row(layout, run_layout(layout, steps, os.path.join(folder, f"layout-{i}"), runner), ref)
            rows.append(r)
            ok = ok and within
        return rows, ok
    finally:
        shutil.rmtree(folder, ignore_errors=True)
