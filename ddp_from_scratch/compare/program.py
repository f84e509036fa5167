"""Prove it: train torch's DDP and ours side by side and compare after every step.

    python -m ddp_from_scratch.compare                                   # small CNN, 2 and 4 ranks
    python -m ddp_from_scratch.compare --model resnet50 --world-sizes 2 4 --steps 2 --batch-size 2 --show-layout
    python -m ddp_from_scratch.compare --impl zero1 zero2 fsdp --world-sizes 2 3 4 --no-options --show-layout
    python -m ddp_from_scratch.compare --impl tp --world-sizes 2 4 --no-options     # tensor parallelism's table

On each rank, the same model is built from a different seed (so a missing initial broadcast
shows), one copy is wrapped in torch.nn.parallel.DistributedDataParallel and one in ours, and
both train with SGD (momentum 0.9) on the same CIFAR-shaped per-rank batches. After every step
every parameter and its .grad, every buffer (BatchNorm running statistics) and the loss are
compared bit for bit on every rank (identical NaNs count as equal: a run that overflows on both
sides the same way is still bitwise equal, and the "values" column says it overflowed); the
table says whether all were equal and the largest relative parameter difference. A second table does the same for the bucketed wrapper's options
(find_unused_parameters, gradient_as_bucket_view, small buckets, fp16/bf16 compression), each
against torch's DDP with the same option; its "compared" column says which steps the option acted in (a
run that stops before it acts, e.g. before PowerSGD's start iteration, says so instead of a verdict), and
the PowerSGD rows run on shm (torch's hook dies on Gloo with two or more buckets: docs/powersgd.md). Data here is synthetic (random CIFAR-shaped tensors),
and the output says so. Exit code 1 when a comparison that should be bitwise is not (anything
but naive and flat on more than 2 ranks, whose table note says why they cannot be).

The sharded steps (--impl zero1 zero2 fsdp) get a table of their own: each against torch's
fully_shard (FSDP2, cut into the same units) and against torch's DDP, every rank starting from the
same weights; whole parameters, buffers and the loss compared after every step. Which pairs must
be bitwise at every world size and which only at 2 ranks is in the table, and why under it.

Tensor parallelism (--impl tp, in the default run) gets a table too: its blocks against torch's
parallelize_module, bit for bit, and the split transformer (TP, TP + SP, TP x DP) trained beside
the one-rank model within float32 rounding (tp.py).
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from functools import partial
from typing import Dict, List, Optional

import torch
import torch.nn.functional as F
from tabulate import tabulate

from collectives import cli
import collectives
from collectives.cli import command, eta
from collectives.launcher.start_methods import TRAINING, preload

from ..parts.bucket import describe as bucket_describe
from ..steps.ddp import DistributedDataParallel
from ..workload.models import MODELS, batch, check_batch_fits, check_batchnorm_fits
from ..parts.step_check import StepCheck, count_nonfinite, relative_diff, same_bits, summarise, table_row
from .sharded import (PARITY_IMPLS, SHARDED_HEADERS, SHARDED_NOTE, must_be_bitwise, shard_layout_text,
                             train_sharded_side_by_side)
from .options import options, what_was_compared
from .pp import PP_HEADERS, PP_IMPL, pp_checks
from .pp import table_rows as pp_table_rows
from .tp import ATTENTION_NOTE, TP_HEADERS, TP_IMPL, table_rows, tp_checks
from .layouts import GLOBAL_BATCH, LAYOUT_HEADERS, LAYOUTS_IMPL, layout_rows
from ..wrap import WRAPPERS, wrap

def train_side_by_side(env, wrapper, steps: int, model="small", batch_size: int = 4, image: int = 12,
                       torch_comm_hook=None, ddp_kwargs: Optional[dict] = None, set_to_none: bool = True,
                       ours_kwargs: Optional[dict] = None, lr: float = 0.05,
                       device: Optional[torch.device] = None) -> List[StepCheck]:
    """Train ours and torch's DDP side by side on this rank; one StepCheck per step.

    The difference is per parameter tensor, max |ours - torch's| / max |torch's|, then the largest
    over parameters: absolute figures mislead where weights grow large (ResNet-50 with batch 2).

    `wrapper` is a name in WRAPPERS or a class taking the module (tests pass broken ones);
    `model` a name in MODELS or a callable building one; `ddp_kwargs` go to both torch's DDP and
    ours (find_unused_parameters=..., gradient_as_bucket_view=...), `ours_kwargs` to ours only
    (compress="fp16"); `torch_comm_hook` is registered on torch's DDP (e.g.
    default_hooks.fp16_compress_hook); `set_to_none` is passed to zero_grad; `lr` to SGD;
    `device` is where the model and batches live (default: env.device, cuda with NCCL; a CUDA
    device on Gloo runs 2 ranks on one GPU).
    """
    ddp_kwargs = ddp_kwargs or {}
    device = env.device if device is None else torch.device(device)
    torch.manual_seed(100 + env.rank)  # every rank starts from different weights
    base = (MODELS[model] if isinstance(model, str) else model)().to(device)
    theirs = wrap(copy.deepcopy(base), "torch", **ddp_kwargs)
    if torch_comm_hook is not None:  # a hook, or (its state or a callable making it, the hook)
        state, hook = torch_comm_hook if isinstance(torch_comm_hook, tuple) else (None, torch_comm_hook)
        theirs.register_comm_hook(state() if callable(state) else state, hook)
    ours = wrap(base, wrapper, **ddp_kwargs, **(ours_kwargs or {}))
    opts = [torch.optim.SGD(m.parameters(), lr=lr, momentum=0.9) for m in (ours, theirs)]
    report = []
    for step in range(steps):
        x, y = (t.to(device) for t in batch(step, env.rank, batch_size, image))
        losses = []
        for m, opt in zip((ours, theirs), opts):
            opt.zero_grad(set_to_none=set_to_none)
            loss = F.cross_entropy(m(x), y)
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        p_ours, p_theirs = dict(ours.module.named_parameters()), dict(theirs.module.named_parameters())
        b_ours, b_theirs = dict(ours.module.named_buffers()), dict(theirs.module.named_buffers())
        report.append(StepCheck(
            params=all(same_bits(p_ours[k], p_theirs[k]) and same_bits(p_ours[k].grad, p_theirs[k].grad) for k in p_theirs),
            buffers=all(same_bits(b_ours[k], b_theirs[k]) for k in b_theirs),
            loss=same_bits(losses[0], losses[1]),
            # parameters and gradients: a gradient can differ for steps before its parameter shows it
            largest_diff=max(max(relative_diff(p_ours[k].detach(), p_theirs[k].detach()),
                                 _grad_diff(p_ours[k].grad, p_theirs[k].grad)) for k in p_theirs),
            nonfinite_ours=count_nonfinite(p_ours.values()),
            nonfinite_theirs=count_nonfinite(p_theirs.values()),
        ))
    return report


def _grad_diff(ours: Optional[torch.Tensor], theirs: Optional[torch.Tensor]) -> float:
    """relative_diff of two gradients; 0 where both are None, 1 where only one is."""
    if ours is None or theirs is None:
        return 0.0 if ours is None and theirs is None else 1.0
    return relative_diff(ours.detach(), theirs.detach())


def layouts(env, model: str = "small", batch_size: int = 2, image: int = 12, verbose: bool = False) -> Dict:
    """Our bucket layout before and after the rebuild (two steps of our DDP, default settings)."""
    ddp = DistributedDataParallel(MODELS[model]())
    for step in range(2):
        x, y = batch(step, env.rank, batch_size, image)
        F.cross_entropy(ddp(x), y).backward()
    return {when: bucket_describe(layout, ddp.params, ddp.names, verbose) for when, layout in ddp.layout_history.items()}


HEADERS = ["wrapper", "ranks", "steps", "bitwise equal to torch DDP", "largest relative diff (params, grads)",
           "first step differing", "values"]
NOT_BITWISE = """naive and flat are not bitwise equal to torch's DDP on more than 2 ranks, and cannot be: Gloo's ring
all_reduce adds the ranks' values in an order that depends on where an element sits in the buffer,
and they lay gradients out differently from torch's buckets (naive: one message per parameter;
flat: one buffer in definition order, which is torch's layout in the first step only). On 2
ranks a sum of two values does not depend on the order. The bucketed wrapper uses torch's layouts."""


# which rows each flag acts on: "wrappers" (naive, flat, bucketed and the bucketed wrapper's
# options), "sharded" (zero1, zero2, zero2-bucketed, fsdp), "tp"; the pp rows take none of them
FLAG_ROWS = {"--model": ("wrappers", "sharded"), "--batch-size": ("wrappers", "sharded"),
             "--image": ("wrappers", "sharded"), "--steps": ("wrappers", "sharded", "tp", LAYOUTS_IMPL),
             "--units": ("sharded",), "--show-layout": ("wrappers", "sharded"), "--no-options": ("bucketed",),
             "--world-sizes": ("wrappers", "sharded", "tp", "pp", "bucketed")}


def rows_asked(impls) -> set:
    """The kinds of rows `--impl` asks for (FLAG_ROWS' words)."""
    kinds = {"wrappers" if i in WRAPPERS else "sharded" if i in PARITY_IMPLS else i for i in impls}
    return kinds | ({"bucketed"} if "bucketed" in impls else set())


def check_flags_used(parser, args) -> None:
    """A usage error for a flag given (set away from its default) that acts on none of the rows
    asked for: `--impl pp --steps 8` would otherwise print the pipeline table as if it had taken 8."""
    asked = rows_asked(args.impl)
    for flag, rows in FLAG_ROWS.items():
        action = next(a for a in parser._actions if flag in a.option_strings)
        if getattr(args, action.dest) != action.default and not asked & set(rows):
            parser.error(f"{flag} has no effect on the rows asked for (--impl {' '.join(args.impl)}): it acts on "
                         f"{', '.join(FLAG_ROWS_SAY[r] for r in rows)}")


FLAG_ROWS_SAY = {"wrappers": "the wrappers' rows (naive, flat, bucketed)",
                 "sharded": "the sharded steps' rows (zero1, zero2, zero2-bucketed, fsdp)",
                 "tp": "the tensor-parallel rows (tp)", "bucketed": "the bucketed wrapper's options table (bucketed)",
                 "pp": "the pipeline schedules' rows (pp)",
                 LAYOUTS_IMPL: "the transformer run's layouts table (layouts), on its own ranks"}


def _validate(args, parser, image: int) -> None:
    """Refuse what would crash the ranks or report a false "not bitwise", before any rank starts."""
    check_flags_used(parser, args)
    cli.check_at_least(parser, args, {"--steps": 1, "--batch-size": 1})
    if min(args.world_sizes) < 1:
        parser.error(f"--world-sizes must all be at least 1, got {args.world_sizes}")
    if image < 4:
        parser.error(f"--image must be at least 4 pixels, got {image}")
    check_batch_fits(parser, args.model, args.batch_size, max(args.world_sizes), image)
    check_batchnorm_fits(parser, args.model, args.batch_size, image)


def build_parser() -> argparse.ArgumentParser:
    parity_impls = PARITY_IMPLS
    parser = cli.ArgumentParser(prog=cli.program_name(__name__), description="Compare our data-parallel wrappers with torch's DDP, step by step.")
    parser.add_argument("--model", choices=list(MODELS), default="small",
                        help="small CNN, ResNet-50 (10 classes), or the small CNN with unused heads")
    parser.add_argument("--impl", nargs="+", choices=list(WRAPPERS) + parity_impls + [TP_IMPL, PP_IMPL, LAYOUTS_IMPL],
                        default=list(WRAPPERS) + [TP_IMPL],
                        help="wrappers to compare; zero1, zero2, zero2-bucketed (in buckets of a quarter of the "
                             "model) and fsdp (the sharded steps) go into a table of their own, each against "
                             "torch's fully_shard and torch's DDP; tp: tensor parallelism's table (its blocks "
                             "against torch's parallelize_module, the split transformer against the one-rank model); "
                             "pp: the pipeline schedules against torch.distributed.pipelining's and the one-rank "
                             "model (not in the default)")
    parser.add_argument("--world-sizes", nargs="+", type=int, default=[2, 4], help="ranks to spawn, one run each")
    parser.add_argument("--units", choices=["children", "blocks"], default="children",
                        help="how fsdp (and fully_shard beside it) cut the model into units: each child with "
                             "parameters, or one level deeper inside containers (ResNet-50's bottleneck blocks)")
    parser.add_argument("--steps", type=int, default=None,
                        help="training steps compared (at least 1; default 4, and 8 for the layouts table)")
    parser.add_argument("--batch-size", type=int, default=4, help="images per rank per step (at least 1)")
    parser.add_argument("--image", type=int, default=None, help="image side in pixels (default 12 small, 32 resnet50)")
    parser.add_argument("--no-options", action="store_true",
                        help="skip the second table (the bucketed wrapper's options against torch's)")
    parser.add_argument("--show-layout", nargs="?", const="summary", choices=["summary", "full"],
                        help="print our bucket layout before and after the rebuild: one line per bucket, or "
                             "'full': every parameter with its offset, shape and bytes")
    return parser


class _Runs:
    """Runs the comparisons, world size by world size, with a progress line on stderr."""

    def __init__(self, args, image: int, chosen: dict, plain: list, sharded: list):
        self.args, self.image, self.chosen, self.plain, self.sharded = args, image, chosen, plain, sharded
        self.tp, self.pp = TP_IMPL in args.impl, PP_IMPL in args.impl
        self.total = len(args.world_sizes) * (len(plain) + 2 * len(sharded) + len(chosen) + self.tp + self.pp)
        self.done, self.start = 0, time.perf_counter()
        self.rows, self.option_rows, self.sharded_rows, self.tp_rows = [], [], [], []
        self.tp_ok = self.pp_ok = True
        self.pp_rows = []

    def _progress(self, what: str) -> None:
        left = eta(self.done, self.total, time.perf_counter() - self.start)
        print(f"[{self.done + 1}/{self.total}] running {what} ... {left}".rstrip(), file=sys.stderr, flush=True)

    def run(self) -> "_Runs":
        if not self.total:  # only the layouts table, which starts its own ranks
            return self
        on = lambda backend: [label for label, o in self.chosen.items() if o.backend == backend]  # noqa: E731
        for n in self.args.world_sizes:
            with collectives.RankPool(n) as pool:  # one spawn per world size, shared by every comparison
                self._plain(pool, n)
                self._options(pool, n, on("gloo"))
                self._sharded(pool, n)
                self._tensor_parallel(pool, n)
                self._pipeline(pool, n)
            for backend in sorted({o.backend for o in self.chosen.values()} - {"gloo"}):
                if any(what_was_compared(self.chosen[label], self.args.steps) for label in on(backend)):
                    with collectives.RankPool(n, backend=backend) as pool:
                        self._options(pool, n, on(backend))
                else:
                    self._options(None, n, on(backend))
        order = list(self.chosen)
        self.option_rows.sort(key=lambda row: (row[1], order.index(row[0])))
        return self

    def _plain(self, pool, n: int) -> None:
        a = self.args
        for impl in self.plain:
            self._progress(f"{impl} on {n} ranks")
            res = summarise(pool.submit(train_side_by_side, args=(impl, a.steps, a.model, a.batch_size, self.image),
                                        timeout=3600))
            self.rows.append(table_row(impl, n, a.steps, res))
            self.done += 1

    def _options(self, pool, n: int, labels: List[str]) -> None:
        a = self.args
        for label in labels:
            option = self.chosen[label]
            compared = what_was_compared(option, a.steps)
            if compared is None:  # the run stops before the option acts: nothing of it to compare
                self.option_rows.append([label, n, a.steps, "not compared", "-", "-", "-", option.backend,
                                         f"{option.idle} (from step {option.acts_from_step}: run --steps "
                                         f"{option.acts_from_step + 1} or more)"])
                self.done += 1
                continue
            self._progress(f"bucketed, {label}, on {n} ranks")
            kwargs = {"model": a.model, "batch_size": a.batch_size, "image": self.image, **option.kwargs}
            res = summarise(pool.submit(partial(train_side_by_side, **kwargs), args=("bucketed", a.steps), timeout=3600))
            self.option_rows.append(table_row(label, n, a.steps, res) + [option.backend, compared])
            self.done += 1

    def _tensor_parallel(self, pool, n: int) -> None:
        if not self.tp:
            return
        self._progress(f"tensor parallelism on {n} ranks")
        per_rank = pool.submit(tp_checks, args=(self.args.steps,), timeout=3600)
        rows, ok = table_rows(per_rank, n, self.args.steps)
        self.tp_rows += rows
        self.tp_ok = self.tp_ok and ok
        self.done += 1

    def _pipeline(self, pool, n: int) -> None:
        if not self.pp:
            return
        self._progress(f"pipeline schedules on {n} ranks")
        rows, ok = pp_table_rows(pool.submit(pp_checks, timeout=3600), n)
        self.pp_rows += rows
        self.pp_ok = self.pp_ok and ok
        self.done += 1

    def _sharded(self, pool, n: int) -> None:
        a = self.args
        for impl in self.sharded:
            for against in ("torch-fsdp", "torch"):
                self._progress(f"{impl} against {against} on {n} ranks")
                res = summarise(pool.submit(
                    partial(train_sharded_side_by_side, against=against, model=a.model, batch_size=a.batch_size,
                            image=self.image, units=a.units),
                    args=(impl, a.steps), timeout=3600))
                must = must_be_bitwise(impl, against, n)
                row = table_row(impl, n, a.steps, res)
                self.sharded_rows.append([impl, "torch fully_shard" if against == "torch-fsdp" else "torch DDP"]
                                         + row[1:4] + ["yes" if must else "-"] + row[4:])
                self.done += 1


def _print_tables(runs: _Runs, data: str) -> None:
    if runs.rows or runs.option_rows or runs.sharded_rows:
        print(f"model {runs.args.model}, {data}, SGD momentum 0.9, Gloo (the options' rows: their backend column); "
              "parameters, their .grad, buffers and the loss compared bit for bit after every step on every rank")
    if runs.rows:
        print(tabulate(runs.rows, headers=HEADERS))
    if any(row[3] == "no" and row[0] in ("naive", "flat") and row[1] > 2 for row in runs.rows):
        print("\n" + NOT_BITWISE)
    if runs.option_rows:
        print("\nthe bucketed wrapper's options, each against torch's DDP with the same option")
        print(tabulate(runs.option_rows, headers=["bucketed, option"] + HEADERS[1:] + ["backend", "compared"]))
        for label, option in runs.chosen.items():
            if option.note:
                print(f"  {label}: {option.note}")
    if runs.sharded_rows:
        print("\nthe sharded steps (ZeRO-1, ZeRO-2, FSDP), each against torch's fully_shard and torch's DDP "
              "(every rank starts from the same weights; whole parameters compared, gradients are shards)")
        print(tabulate(runs.sharded_rows, headers=SHARDED_HEADERS))
        print("\n" + SHARDED_NOTE)
    if runs.tp_rows:
        print("\ntensor parallelism (ddp_from_scratch/tensor_parallel), each block against torch's parallelize_module "
              "(Gloo, one step) and the split transformer against the one-rank model (SGD, momentum 0.9)")
        print(tabulate(runs.tp_rows, headers=TP_HEADERS, disable_numparse=True))
        print("\n" + ATTENTION_NOTE)
    if runs.pp_rows:
        print("\npipeline parallelism (ddp_from_scratch/pipeline_parallel), each schedule against torch.distributed."
              "pipelining's and against the one-rank model: every loss and every gradient of every rank, bit for bit "
              "(an MLP of Linear+Tanh, Gloo)")
        print(tabulate(runs.pp_rows, headers=PP_HEADERS, disable_numparse=True))


def _print_layouts(args, image: int, plain: list, sharded: list) -> None:
    if args.show_layout and sharded:
        print(f"\nshard layout on {max(args.world_sizes)} ranks, model {args.model} (fsdp's units; "
              f"ZeRO-1/2 cut each parameter the same way):\n"
              f"{shard_layout_text(args.model, max(args.world_sizes), args.units)}")
    if args.show_layout and plain:
        shown = collectives.run(layouts, 1, args=(args.model, args.batch_size, image, args.show_layout == "full"))[0]
        for when in ("initial", "rebuilt"):
            print(f"\nbucket layout, {when} ({'first iteration' if when == 'initial' else 'from the first backward'}'s "
                  f"order), model {args.model}:\n{shown[when]}")


@command
def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    image = args.image or (32 if args.model == "resnet50" else 12)
    _validate(args, parser, image)
    layout_steps, args.steps = args.steps or 8, args.steps or 4
    data = f"synthetic CIFAR-shaped data ({args.batch_size} x 3 x {image} x {image} per rank)"
    chosen = {} if args.no_options or "bucketed" not in args.impl else options(args.model, args.batch_size)
    preload(*TRAINING)  # every rank builds an optimizer: the fork server imports what that needs, once
    plain = [impl for impl in args.impl if impl not in PARITY_IMPLS and impl not in (TP_IMPL, PP_IMPL, LAYOUTS_IMPL)]
    sharded = [impl for impl in args.impl if impl in PARITY_IMPLS]
    runs = _Runs(args, image, chosen, plain, sharded).run()
    _print_tables(runs, data)
    _print_layouts(args, image, plain, sharded)
    layouts_ok = True
    if LAYOUTS_IMPL in args.impl:
        rows, layouts_ok = layout_rows(layout_steps)
        print(f"\nthe training program's transformer run on every layout against the one-rank model: {layout_steps} "
              f"steps on Python's documentation, a global batch of {GLOBAL_BATCH} sequences, SGD momentum 0.9, Gloo; "
              "every step's loss, the validation loss, every final parameter (from the checkpoint's shards)")
        print(tabulate(rows, headers=LAYOUT_HEADERS, disable_numparse=True))
    sharded_ok = all(row[4] == "yes" for row in runs.sharded_rows if row[5] == "yes")
    compared = [row for row in runs.option_rows if row[3] != "not compared"]  # stopped before the option acted
    return 0 if sharded_ok and runs.tp_ok and runs.pp_ok and layouts_ok and all(row[3] == "yes" for row in runs.rows + compared
                                   if row[0] not in ("naive", "flat") or row[1] <= 2) else 1
