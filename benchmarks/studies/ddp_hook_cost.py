"""What a Python gradient hook costs ResNet-50's backward, in one process with one thread.

    python -m benchmarks.studies.ddp_hook_cost --rounds 15

Four copies of the model, their backwards alternated in a random order each round:
no hooks; 161 no-op `register_post_accumulate_grad_hook` hooks; and 161 hooks that scale each
gradient into a flat bucket buffer (`torch.mul(grad, 0.5, out=slot)`, what our DDP's hook does
and what torch's C++ reducer does too), with and without our hook's bookkeeping (an index
lookup and a timestamp). Prints the median backward time of each, and the difference to "no hooks".
"""

from __future__ import annotations

import random
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from tabulate import tabulate

from collectives import cli
from collectives.cli import command
from ddp_from_scratch.workload.resnet import resnet50


def _hooked(kind: str):
    torch.manual_seed(0)
    model = resnet50(num_classes=10)
    params = list(model.parameters())
    buffer = torch.zeros(sum(p.numel() for p in params))
    slots, offset = {}, 0
    for p in params:
        slots[id(p)] = buffer[offset:offset + p.numel()].view_as(p)
        offset += p.numel()
    index = {id(p): i for i, p in enumerate(params)}
    events = []

    def noop(param):
        return None

    def scale(param):
        torch.mul(param.grad, 0.5, out=slots[id(param)])

    def scale_and_record(param):
        events.append((index[id(param)], time.perf_counter()))
        torch.mul(param.grad, 0.5, out=slots[id(param)])

    hook = {"no hooks": None, "161 no-op hooks": noop, "161 hooks scaling into a bucket": scale,
            "the same, with index lookup and timestamp": scale_and_record}[kind]
    if hook is not None:
        for p in params:
            p.register_post_accumulate_grad_hook(hook)
    return model, events


def build_parser():
    parser = cli.ArgumentParser(prog=cli.program_name(__name__), description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=15, help="backwards per variant (alternated)")
    parser.add_argument("--batch-size", type=int, default=32)
    return parser


@command
def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    kinds = ["no hooks", "161 no-op hooks", "161 hooks scaling into a bucket", "the same, with index lookup and timestamp"]
    models = {k: _hooked(k) for k in kinds}
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(args.batch_size, 3, 32, 32, generator=g), torch.randint(0, 10, (args.batch_size,), generator=g)
    times = {k: [] for k in kinds}
    order = random.Random(0)
    for i in range(args.rounds + 1):  # the first round warms up
        for k in order.sample(kinds, len(kinds)):
            model, events = models[k]
            model.zero_grad()
            events.clear()
            loss = F.cross_entropy(model(x), y)
            start = time.perf_counter()
            loss.backward()
            if i:
                times[k].append(time.perf_counter() - start)
    base = statistics.median(times["no hooks"])
    print(f"ResNet-50 backward, batch {args.batch_size}, one process, one thread; median of {args.rounds} alternated rounds")
    print(tabulate([[k, f"{statistics.median(t) * 1e3:.1f}", f"{(statistics.median(t) - base) * 1e3:+.1f}"]
                    for k, t in times.items()], headers=["variant", "backward ms", "vs no hooks, ms"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
