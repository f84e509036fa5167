"""Is one fp32 ResNet-50 SGD step on CUDA the same each time? The same weights and batch, stepped
`--repeats` times in one process, with cuDNN's default kernels and with its deterministic mode.

    python -m benchmarks.cuda_determinism            # on a machine with a GPU (gpu_checks.sh train runs it)

Prints, per mode, the loss of the step, the loss on a second batch after the step, and the
largest relative parameter difference of each repeat against the first (per tensor, max |a - b| /
max |a|). Why it matters here: the bitwise proofs (tests/ddp/test_gpu_ddp.py) compare ours and
torch's DDP in one process, where both run the same kernels; two training runs of one command can
still differ on a GPU (ddp_from_scratch.train --deterministic makes them match).
"""

from __future__ import annotations

import copy
import sys

import torch
import torch.nn.functional as F

from collectives import cli
from ddp_from_scratch.workload.resnet import resnet50


def _step(model, x, y):
    opt = torch.optim.SGD(model.parameters(), lr=0.001, momentum=0.9)
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}, loss.item()


def measure(deterministic: bool, repeats: int, batch_size: int) -> dict:
    torch.backends.cudnn.deterministic = deterministic
    torch.manual_seed(0)
    base = resnet50(num_classes=10).cuda()
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(batch_size, 3, 32, 32, generator=g), torch.randint(0, 10, (batch_size,), generator=g)
    x2 = torch.randn(batch_size, 3, 32, 32, generator=g)
    x, y, x2 = x.cuda(), y.cuda(), x2.cuda()
    runs = []
    for _ in range(repeats):
        model = copy.deepcopy(base)
        params, loss = _step(model, x, y)
        runs.append((params, loss, F.cross_entropy(model(x2), y).item()))
    first = runs[0][0]
    diffs = [max(((first[k] - p[k]).abs().max() / first[k].abs().max().clamp_min(1e-30)).item() for k in first)
             for p, _, _ in runs[1:]]
    return {"losses": [r[1] for r in runs], "next_losses": [r[2] for r in runs], "param_diffs": diffs}


def build_parser():
    p = cli.ArgumentParser(prog="python -m benchmarks.cuda_determinism", description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=3, help="steps from the same weights and batch")
    p.add_argument("--batch-size", type=int, default=64)
    return p


def main(argv=None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("python -m benchmarks.cuda_determinism: needs a CUDA GPU, and torch.cuda.is_available() is False",
              file=sys.stderr)
        return 2
    for deterministic in (False, True):
        r = measure(deterministic, args.repeats, args.batch_size)
        print(f"cudnn.deterministic={deterministic}: step loss {r['losses']}, loss on a second batch after it "
              f"{[round(v, 6) for v in r['next_losses']]}, largest relative parameter difference against the "
              f"first repeat {r['param_diffs']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
