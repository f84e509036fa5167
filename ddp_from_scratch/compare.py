"""Prove it: train torch's DDP and ours side by side and compare after every step.

    python -m ddp_from_scratch.compare                                   # small CNN, 2 and 4 ranks
    python -m ddp_from_scratch.compare --model resnet50 --world-sizes 2 4 --steps 2 --batch-size 2 --show-layout

On each rank, the same model is built from a different seed (so a missing initial broadcast
shows), one copy is wrapped in torch.nn.parallel.DistributedDataParallel and one in ours, and
both train with SGD (momentum 0.9) on the same CIFAR-shaped per-rank batches. After every step
every parameter and its .grad, every buffer (BatchNorm running statistics) and the loss are
compared with torch.equal on every rank; the table says whether all were equal and the largest relative
parameter difference. A second table does the same for the bucketed wrapper's options
(find_unused_parameters, gradient_as_bucket_view, small buckets, fp16/bf16 compression), each
against torch's DDP with the same option. Data here is synthetic (random CIFAR-shaped tensors),
and the output says so. Exit code 1 when a comparison that should be bitwise is not (anything
but naive and flat on more than 2 ranks, whose table note says why they cannot be).
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from functools import partial
from typing import Dict, List, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from tabulate import tabulate
from torch import nn

import collectives
from collectives.cli import command, eta

from .bucket import describe as bucket_describe
from .ddp import DistributedDataParallel
from .flat import FlatDataParallel
from .naive import NaiveDataParallel
from .resnet import resnet50

WRAPPERS = {"naive": NaiveDataParallel, "flat": FlatDataParallel, "bucketed": DistributedDataParallel}


class SmallNet(nn.Module):
    """Two conv + BatchNorm layers and a classifier: enough to exercise buffers and buckets."""

    def __init__(self, num_classes: int = 10):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8)
        self.conv2, self.bn2 = nn.Conv2d(8, 16, 3, stride=2, bias=False), nn.BatchNorm2d(16)
        self.fc = nn.Linear(16, num_classes)

    def forward(self, x):
        x = F.relu(self.bn1(self.conv1(x)))
        x = F.relu(self.bn2(self.conv2(x)))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


class Branchy(SmallNet):
    """SmallNet with two more heads: `extra` is used on rank 0 only, `never` by no rank.

    For find_unused_parameters=True: rank 1 gets no local gradient for `extra` but must end with
    the average; `never`'s gradient must stay None everywhere.
    """

    def __init__(self, num_classes: int = 10):
        super().__init__(num_classes)
        self.extra, self.never = nn.Linear(16, num_classes), nn.Linear(16, num_classes)

    def forward(self, x):
        x = F.relu(self.bn1(self.conv1(x)))
        x = torch.flatten(F.adaptive_avg_pool2d(F.relu(self.bn2(self.conv2(x))), 1), 1)
        out = self.fc(x)
        return out + self.extra(x) if dist.get_rank() == 0 else out


MODELS = {"small": SmallNet, "resnet50": lambda: resnet50(num_classes=10), "branchy": Branchy}


def batch(step: int, rank: int, batch_size: int, image: int = 32):
    """This rank's batch for this step: CIFAR-shaped, the same in every program."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(batch_size, 3, image, image, generator=g), torch.randint(0, 10, (batch_size,), generator=g)


def _same_grad(a: nn.Parameter, b: nn.Parameter) -> bool:
    return (a.grad is None and b.grad is None) or (a.grad is not None and b.grad is not None and torch.equal(a.grad, b.grad))


def _relative_diff(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    """Largest |ours - theirs| over the tensor, relative to the tensor's largest |value|."""
    return ((ours - theirs).abs().max() / theirs.abs().max().clamp_min(1e-30)).item()


def train_side_by_side(env, wrapper, steps: int, model="small", batch_size: int = 4, image: int = 12,
                       torch_comm_hook=None, ddp_kwargs: Optional[dict] = None, set_to_none: bool = True,
                       ours_kwargs: Optional[dict] = None) -> List:
    """On each rank, per step: (params equal, buffers equal, loss equal, largest relative parameter difference).

    The difference is per parameter tensor, max |ours - torch's| / max |torch's|, then the largest
    over parameters: absolute figures mislead where weights grow large (ResNet-50 with batch 2).

    "params equal" covers each parameter and its .grad (both None, or equal).
    `wrapper` is a name in WRAPPERS or a class taking the module (tests pass broken ones);
    `model` a name in MODELS or a callable building one; `ddp_kwargs` go to both torch's DDP and
    ours (find_unused_parameters=..., gradient_as_bucket_view=...), `ours_kwargs` to ours only
    (compress="fp16"); `torch_comm_hook` is
    registered on torch's DDP (e.g. default_hooks.fp16_compress_hook); `set_to_none` is passed to
    zero_grad.
    """
    ddp_kwargs = ddp_kwargs or {}
    torch.manual_seed(100 + env.rank)  # every rank starts from different weights
    base = (MODELS[model] if isinstance(model, str) else model)()
    theirs = nn.parallel.DistributedDataParallel(copy.deepcopy(base), **ddp_kwargs)
    if torch_comm_hook is not None:
        theirs.register_comm_hook(None, torch_comm_hook)
    ours = (WRAPPERS[wrapper] if isinstance(wrapper, str) else wrapper)(base, **ddp_kwargs, **(ours_kwargs or {}))
    opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (ours, theirs)]
    report = []
    for step in range(steps):
        x, y = batch(step, env.rank, batch_size, image)
        losses = []
        for m, opt in zip((ours, theirs), opts):
            opt.zero_grad(set_to_none=set_to_none)
            loss = F.cross_entropy(m(x), y)
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        p_ours, p_theirs = dict(ours.module.named_parameters()), dict(theirs.module.named_parameters())
        b_ours, b_theirs = dict(ours.module.named_buffers()), dict(theirs.module.named_buffers())
        report.append((
            all(torch.equal(p_ours[k], p_theirs[k]) and _same_grad(p_ours[k], p_theirs[k]) for k in p_theirs),
            all(torch.equal(b_ours[k], b_theirs[k]) for k in b_theirs),
            torch.equal(losses[0], losses[1]),
            max(_relative_diff(p_ours[k], p_theirs[k]) for k in p_theirs),
        ))
    return report


def summarise(per_rank: List[List]) -> Dict:
    steps = len(per_rank[0])
    bitwise = all(p and b and l for rank in per_rank for p, b, l, _ in rank)
    first_off = next((s for s in range(steps) if not all(all(rank[s][:3]) for rank in per_rank)), None)
    return {"bitwise": bitwise, "largest_diff": max(d for rank in per_rank for *_, d in rank), "first_step_differing": first_off}


def bf16_compress_hook_on_gloo(state, bucket):
    """torch's bf16_compress_hook, run on Gloo.

    torch refuses the public hook without NCCL ("BF16 all reduce communication hook required
    CUDA 11+ and NCCL 2.10+"), but it is only `_compress_hook(torch.bfloat16, ...)`, the same
    body as fp16_compress_hook; Gloo sums bf16 fine. So we call that body directly.
    """
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    return default_hooks._compress_hook(torch.bfloat16, state, bucket)


def options():
    """The bucketed wrapper's settings compared with torch's: {label: (train_side_by_side kwargs, note)}."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    return {
        "find_unused_parameters": (
            {"model": "branchy", "ddp_kwargs": {"find_unused_parameters": True}},
            "model Branchy: one head used on rank 0 only, one used by no rank; .grad None-ness compared too"),
        "gradient_as_bucket_view": ({"ddp_kwargs": {"gradient_as_bucket_view": True}}, ""),
        "gradient_as_bucket_view, set_to_none=False": (
            {"ddp_kwargs": {"gradient_as_bucket_view": True}, "set_to_none": False},
            "zero_grad(set_to_none=False): the gradients stay bucket views from step to step"),
        "bucket_cap_mb=0.0005": ({"ddp_kwargs": {"bucket_cap_mb": 0.0005}}, "several buckets even for the small model"),
        "compress fp16": (
            {"ours_kwargs": {"compress": "fp16"}, "torch_comm_hook": default_hooks.fp16_compress_hook},
            "ours with compress='fp16' against torch's DDP with fp16_compress_hook"),
        "compress bf16": (
            {"ours_kwargs": {"compress": "bf16"}, "torch_comm_hook": bf16_compress_hook_on_gloo},
            "ours with compress='bf16' against torch's DDP with bf16_compress_hook's body (the hook refuses Gloo by name)"),
    }


def layouts(env, model: str = "small", batch_size: int = 2, image: int = 12, verbose: bool = False) -> Dict:
    """Our bucket layout before and after the rebuild (two steps of our DDP, default settings)."""
    ddp = DistributedDataParallel(MODELS[model]())
    for step in range(2):
        x, y = batch(step, env.rank, batch_size, image)
        F.cross_entropy(ddp(x), y).backward()
    return {when: bucket_describe(layout, ddp.params, ddp.names, verbose) for when, layout in ddp.layout_history.items()}


def _row(label, n, steps, res):
    return [label, n, steps, "yes" if res["bitwise"] else "no", f"{res['largest_diff']:.3g}",
            "-" if res["first_step_differing"] is None else res["first_step_differing"]]


HEADERS = ["wrapper", "ranks", "steps", "bitwise equal to torch DDP", "largest relative param diff",
           "first step differing"]
NOT_BITWISE = """naive and flat are not bitwise equal to torch's DDP on more than 2 ranks, and cannot be: Gloo's ring
all_reduce adds the ranks' values in an order that depends on where an element sits in the buffer,
and they lay gradients out differently from torch's buckets (naive: one message per parameter;
flat: one buffer in definition order, which is torch's layout in the first step only). On 2
ranks a sum of two values does not depend on the order. The bucketed wrapper uses torch's layouts."""


def _validate(args, parser, image: int) -> None:
    """Refuse what would crash the ranks or report a false "not bitwise", before any rank starts."""
    for name in ("steps", "batch_size"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if min(args.world_sizes) < 1:
        parser.error(f"--world-sizes must all be at least 1, got {args.world_sizes}")
    if image < 4:
        parser.error(f"--image must be at least 4 pixels, got {image}")
    if args.model == "resnet50":
        # BatchNorm needs two values per channel; ResNet-50's last stage is image / 32 pixels wide
        side = max(1, -(-image // 32))
        if args.batch_size * side * side < 2:
            parser.error(f"--batch-size {args.batch_size} with --image {image}: ResNet-50's last BatchNorm would see one "
                         "value per channel (torch refuses that in training); use --batch-size 2 or more")


@command
def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Compare our data-parallel wrappers with torch's DDP, step by step.")
    parser.add_argument("--model", choices=list(MODELS), default="small",
                        help="small CNN, ResNet-50 (10 classes), or the small CNN with unused heads")
    parser.add_argument("--impl", nargs="+", choices=list(WRAPPERS), default=list(WRAPPERS), help="wrappers to compare")
    parser.add_argument("--world-sizes", nargs="+", type=int, default=[2, 4], help="ranks to spawn, one run each")
    parser.add_argument("--steps", type=int, default=4, help="training steps compared (at least 1)")
    parser.add_argument("--batch-size", type=int, default=4, help="images per rank per step (at least 1)")
    parser.add_argument("--image", type=int, default=None, help="image side in pixels (default 12 small, 32 resnet50)")
    parser.add_argument("--no-options", action="store_true",
                        help="skip the second table (the bucketed wrapper's options against torch's)")
    parser.add_argument("--show-layout", nargs="?", const="summary", choices=["summary", "full"],
                        help="print our bucket layout before and after the rebuild: one line per bucket, or "
                             "'full': every parameter with its offset, shape and bytes")
    args = parser.parse_args(argv)
    image = args.image or (32 if args.model == "resnet50" else 12)
    _validate(args, parser, image)
    data = f"synthetic CIFAR-shaped data ({args.batch_size} x 3 x {image} x {image} per rank)"
    rows, option_rows = [], []
    runs = len(args.world_sizes) * (len(args.impl) + (0 if args.no_options else len(options())))
    done, start = 0, time.perf_counter()

    def progress(what: str) -> None:
        left = eta(done, runs, time.perf_counter() - start)
        print(f"[{done + 1}/{runs}] running {what} ... {left}".rstrip(), file=sys.stderr, flush=True)

    for n in args.world_sizes:
        with collectives.RankPool(n) as pool:  # one spawn per world size, shared by every comparison
            for impl in args.impl:
                progress(f"{impl} on {n} ranks")
                res = summarise(pool.submit(train_side_by_side, args=(impl, args.steps, args.model, args.batch_size, image),
                                            timeout=3600))
                rows.append(_row(impl, n, args.steps, res))
                done += 1
            for label, (kwargs, _) in ({} if args.no_options else options()).items():
                progress(f"bucketed, {label}, on {n} ranks")
                kwargs = {"model": args.model, "batch_size": args.batch_size, "image": image, **kwargs}
                res = summarise(pool.submit(partial(train_side_by_side, **kwargs), args=("bucketed", args.steps),
                                            timeout=3600))
                option_rows.append(_row(label, n, args.steps, res))
                done += 1
    print(f"model {args.model}, {data}, SGD momentum 0.9, Gloo; parameters, their .grad, buffers and the loss "
          "compared with torch.equal after every step on every rank")
    print(tabulate(rows, headers=HEADERS))
    if any(row[3] == "no" and row[0] in ("naive", "flat") and row[1] > 2 for row in rows):
        print("\n" + NOT_BITWISE)
    if option_rows:
        print("\nthe bucketed wrapper's options, each against torch's DDP with the same option")
        print(tabulate(option_rows, headers=["bucketed, option"] + HEADERS[1:]))
        for label, (_, note) in options().items():
            if note:
                print(f"  {label}: {note}")
    if args.show_layout:
        shown = collectives.run(layouts, 1, args=(args.model, args.batch_size, image, args.show_layout == "full"))[0]
        for when in ("initial", "rebuilt"):
            print(f"\nbucket layout, {when} ({'first iteration' if when == 'initial' else 'from the first backward'}'s "
                  f"order), model {args.model}:\n{shown[when]}")
    return 0 if all(row[3] == "yes" for row in rows + option_rows if row[0] not in ("naive", "flat") or row[1] <= 2) else 1


if __name__ == "__main__":
    sys.exit(main())
