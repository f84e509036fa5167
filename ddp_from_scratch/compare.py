"""Prove it: train torch's DDP and ours side by side and compare after every step.

    python -m ddp_from_scratch.compare                                   # small CNN, 2 and 4 ranks
    python -m ddp_from_scratch.compare --model resnet50 --world-sizes 2 --steps 2 --batch-size 2

On each rank, the same model is built from a different seed (so a missing initial broadcast
shows), one copy is wrapped in torch.nn.parallel.DistributedDataParallel and one in ours, and
both train with SGD (momentum 0.9) on the same CIFAR-shaped per-rank batches. After every step
every parameter, every buffer (BatchNorm running statistics) and the loss are compared with
torch.equal on every rank; the table says whether all were equal and the largest parameter
difference. Data here is synthetic (random CIFAR-shaped tensors), and the table says so.
"""

from __future__ import annotations

import argparse
import copy
import sys
from typing import Dict, List, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from tabulate import tabulate
from torch import nn

import collectives

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


def train_side_by_side(env, wrapper, steps: int, model="small", batch_size: int = 4, image: int = 12,
                       torch_comm_hook=None, ddp_kwargs: Optional[dict] = None, set_to_none: bool = True) -> List:
    """On each rank, per step: (params equal, buffers equal, loss equal, largest parameter difference).

    "params equal" covers each parameter and its .grad (both None, or equal).
    `wrapper` is a name in WRAPPERS or a class taking the module (tests pass broken ones);
    `model` a name in MODELS or a callable building one; `ddp_kwargs` go to both torch's DDP and
    ours (find_unused_parameters=..., gradient_as_bucket_view=...); `torch_comm_hook` is
    registered on torch's DDP (e.g. default_hooks.fp16_compress_hook); `set_to_none` is passed to
    zero_grad.
    """
    ddp_kwargs = ddp_kwargs or {}
    torch.manual_seed(100 + env.rank)  # every rank starts from different weights
    base = (MODELS[model] if isinstance(model, str) else model)()
    theirs = nn.parallel.DistributedDataParallel(copy.deepcopy(base), **ddp_kwargs)
    if torch_comm_hook is not None:
        theirs.register_comm_hook(None, torch_comm_hook)
    ours = (WRAPPERS[wrapper] if isinstance(wrapper, str) else wrapper)(base, **ddp_kwargs)
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
            max((p_ours[k] - p_theirs[k]).abs().max().item() for k in p_theirs),
        ))
    return report


def summarise(per_rank: List[List]) -> Dict:
    steps = len(per_rank[0])
    bitwise = all(p and b and l for rank in per_rank for p, b, l, _ in rank)
    first_off = next((s for s in range(steps) if not all(all(rank[s][:3]) for rank in per_rank)), None)
    return {"bitwise": bitwise, "largest_diff": max(d for rank in per_rank for *_, d in rank), "first_step_differing": first_off}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Compare our data-parallel wrappers with torch's DDP, step by step.")
    parser.add_argument("--model", choices=list(MODELS), default="small", help="small CNN or ResNet-50 (10 classes)")
    parser.add_argument("--impl", nargs="+", choices=list(WRAPPERS), default=list(WRAPPERS), help="wrappers to compare")
    parser.add_argument("--world-sizes", nargs="+", type=int, default=[2, 4], help="ranks to spawn, one run each")
    parser.add_argument("--steps", type=int, default=4, help="training steps compared")
    parser.add_argument("--batch-size", type=int, default=4, help="images per rank per step")
    parser.add_argument("--image", type=int, default=None, help="image side in pixels (default 12 small, 32 resnet50)")
    args = parser.parse_args(argv)
    image = args.image or (32 if args.model == "resnet50" else 12)
    rows = []
    for n in args.world_sizes:
        for impl in args.impl:
            print(f"running {impl} on {n} ranks ...", file=sys.stderr, flush=True)
            res = summarise(collectives.run(train_side_by_side, n, args=(impl, args.steps, args.model, args.batch_size, image)))
            rows.append([impl, n, args.steps, "yes" if res["bitwise"] else "no", f"{res['largest_diff']:.3g}",
                         "-" if res["first_step_differing"] is None else res["first_step_differing"]])
    print(f"model {args.model}, synthetic CIFAR-shaped data ({args.batch_size} x 3 x {image} x {image} per rank), "
          "SGD momentum 0.9, Gloo; compared after every step on every rank")
    print(tabulate(rows, headers=["wrapper", "ranks", "steps", "bitwise equal to torch DDP",
                                  "largest param diff", "first step differing"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
