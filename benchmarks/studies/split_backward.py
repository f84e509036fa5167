"""Where a split backward's time goes: zero bubble's I and W against one whole backward, on the
last stage of benchmarks.pipeline_parallel's 2-stage model, in one process.

    python -m benchmarks.studies.split_backward                     # 400 rounds, the benchmark's stage
    python -m benchmarks.studies.split_backward --rounds 100 --width 1024 --json split.json
    MALLOC_MMAP_THRESHOLD_=268435456 MALLOC_TRIM_THRESHOLD_=1073741824 python -m benchmarks.studies.split_backward

The stage is the second half of the benchmark's MLP (--depth Linear+Tanh layers of --width, and a
Linear to 10 classes, cut by parameters), with the loss, on microbatches of --microbatch-size rows,
one thread. Each round runs a forward and then, in a random order, each of:

- B: a whole backward (`torch.autograd.backward(loss)`), the input's gradient and the weights';
- I and W: `SplitBackward.input_gradient`, then the W part it returns (two_part_backward.py);
- I and W with the W later: the I, then the next microbatch's forward and I (not timed), then the
  W, as zero bubble's last rank runs them (F0 I0 F1 I1 W0 ...): what a W costs once other work
  has run between it and its I;
- the input's gradient alone, `torch.autograd.grad(loss, x)`: autograd's own cost of the I's
  arithmetic, so I minus it is what finding the weight groups costs (the walk of the graph, the
  accumulators);
- the weights' gradients alone, `torch.autograd.grad(loss, weights)`;
- and without autograd, the stage's matrix products alone, with the shapes and layouts autograd
  uses: each layer's two (the input's gradient, grad @ weight, and the weight's, grad.T @ input)
  one after the other, layer by layer, as a whole backward runs them, against every layer's
  input product first and then every layer's weight product, as I then W run them.

Each figure is the median over rounds, and so is each page-fault count (B, W and the W later:
the pages the kernel handed the process while that part ran, from getrusage); (I + W) / B is the
median of each round's own ratio. The split's gradients are checked against B's bit for bit first
(with the W later, the two microbatches are the same one, so each weight's gradient must be
exactly twice B's). What it decides: how far
zero bubble's I + W is from one backward's cost (the pipeline benchmark prints the same ratio from
the schedule's own timeline), and which part of the difference is Python, which autograd's calls,
and which the memory a W gets back from the allocator: glibc's malloc gives large freed blocks
back to the kernel (a block it served by mmap, or the heap's free top past its trim threshold), and
a W that runs after other work may fault its weights' gradients in again, page by page, where the
W straight after its I reuses what B or the I just freed. With
`MALLOC_MMAP_THRESHOLD_=268435456 MALLOC_TRIM_THRESHOLD_=1073741824` in the environment (glibc's
own settings: serve blocks under 256 MiB from the heap, and keep up to 1 GiB of its free top) the
process keeps its pages, and the fault counts say whether that is the difference.
"""

from __future__ import annotations

import random
import resource
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from tabulate import tabulate

from collectives import cli
from collectives.cli import command
from ddp_from_scratch.pipeline_parallel.split import split
from ddp_from_scratch.pipeline_parallel.two_part_backward import SplitBackward

VARIANTS = ("B", "I + W", "I + W, W later", "input's gradient alone", "weights' gradients alone", "products")
LATER = "I + W, W later"


def last_stage(width: int, depth: int) -> torch.nn.Module:
    """The pipeline benchmark's model, cut in 2 by parameters: the second stage."""
    from benchmarks.pipeline_parallel import model

    return split(model({"width": width, "depth": depth}), 2)[1]


def _faults() -> int:
    """This process's minor page faults so far: pages the kernel had to hand it (again)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _gradients(stage, x0, target, variant, splitter, params):
    """One forward and the variant's backward: (seconds by part, page faults by part for B, W and
    the W later, the input's and weights' gradients)."""
    x = x0.clone().requires_grad_()
    loss = F.cross_entropy(stage(x), target)
    for p in params:
        p.grad = None
    start, faults = time.perf_counter(), _faults()
    if variant == "B":
        torch.autograd.backward(loss)
        return {"B": time.perf_counter() - start}, {"B": _faults() - faults}, x.grad, [p.grad for p in params]
    if variant == "I + W":
        dx, weights = splitter.input_gradient(loss, None, x, params)
        middle, faults = time.perf_counter(), _faults()
        weights()
        end = time.perf_counter()
        return ({"I": middle - start, "W": end - middle, "I + W": end - start}, {"W": _faults() - faults}, dx,
                [p.grad for p in params])
    if variant == LATER:
        dx, weights = splitter.input_gradient(loss, None, x, params)
        middle = time.perf_counter()
        x_next = x0.clone().requires_grad_()  # the next microbatch's forward and I, between this I and its W
        _, weights_next = splitter.input_gradient(F.cross_entropy(stage(x_next), target), None, x_next, params)
        resumed, faults = time.perf_counter(), _faults()
        weights()
        end, faulted = time.perf_counter(), _faults() - faults
        weights_next()  # the same microbatch again: each weight's gradient is now twice B's, exactly
        return ({"W later": end - resumed, LATER: (middle - start) + (end - resumed)}, {"W later": faulted}, dx,
                [p.grad for p in params])
    inputs = (x,) if variant == "input's gradient alone" else tuple(params)
    torch.autograd.grad(loss, inputs)
    return {variant: time.perf_counter() - start}, {}, None, None


def square_layers(stage, x0) -> list:
    """(input, weight, a gradient the shape of its output) of each square Linear of the stage, in
    the order a backward meets them."""
    with torch.no_grad():
        layers, h = [], x0
        for m in stage:
            if isinstance(m, torch.nn.Linear) and m.in_features == m.out_features:
                layers.append((h, m.weight, torch.randn_like(h)))
            h = m(h)
    return layers[::-1]


def _products(layers) -> dict:
    """The layers' two backward products, timed paired layer by layer and then split into all the
    input products and all the weight products."""
    with torch.no_grad():
        start = time.perf_counter()
        for x, w, g in layers:
            torch.mm(g, w)
            torch.mm(g.t(), x)
        paired = time.perf_counter()
        for x, w, g in layers:
            torch.mm(g, w)
        for x, w, g in layers:
            torch.mm(g.t(), x)
        end = time.perf_counter()
    return {"products, layer by layer (as B)": paired - start, "products, inputs' then weights' (as I, W)": end - paired}


def measure(rounds: int, width: int, depth: int, rows: int) -> dict:
    torch.set_num_threads(1)
    stage = last_stage(width, depth)
    params = [p for p in stage.parameters() if p.requires_grad]
    g = torch.Generator().manual_seed(0)
    x0, target = torch.randn(rows, width, generator=g), torch.randint(0, 10, (rows,), generator=g)
    splitter, layers = SplitBackward(), square_layers(stage, x0)
    _, _, dx_b, grads_b = _gradients(stage, x0, target, "B", splitter, params)
    _, _, dx_s, grads_s = _gradients(stage, x0, target, "I + W", splitter, params)
    _, _, dx_l, grads_l = _gradients(stage, x0, target, LATER, splitter, params)
    same = (torch.equal(dx_b, dx_s) and all(torch.equal(a, b) for a, b in zip(grads_b, grads_s))
            and torch.equal(dx_b, dx_l) and all(torch.equal(2 * a, b) for a, b in zip(grads_b, grads_l)))
    times: dict = {}
    faults: dict = {}
    ratios, later = [], []
    order = random.Random(0)
    for k in range(rounds + 1):  # the first round warms up
        this_round, faulted = {}, {}
        for variant in order.sample(VARIANTS, len(VARIANTS)):
            if variant == "products":
                this_round.update(_products(layers))
            else:
                seconds, counts, _, _ = _gradients(stage, x0, target, variant, splitter, params)
                this_round.update(seconds)
                faulted.update(counts)
        if k:
            for part, s in this_round.items():
                times.setdefault(part, []).append(s)
            for part, n in faulted.items():
                faults.setdefault(part, []).append(n)
            ratios.append(this_round["I + W"] / this_round["B"])
            later.append(this_round[LATER] / this_round["B"])
    ms = {part: statistics.median(s) * 1e3 for part, s in times.items()}
    return {"config": {"rounds": rounds, "width": width, "depth": depth, "microbatch_size": rows},
            "same_bits": same, "ms": ms, "i_plus_w_over_b": statistics.median(ratios),
            "i_plus_w_later_over_b": statistics.median(later),
            "page_faults": {part: statistics.median(n) for part, n in faults.items()},
            "finding_groups_ms": ms["I"] - ms["input's gradient alone"]}


def report(result: dict) -> str:
    ms, c, faults = result["ms"], result["config"], result["page_faults"]
    rows = [[part, f"{ms[part]:.3f}", f"{ms[part] / ms['B']:.3f}", f"{faults[part]:g}" if part in faults else ""]
            for part in ("B", "I", "W", "I + W", "W later", LATER, "input's gradient alone", "weights' gradients alone",
                         "products, layer by layer (as B)", "products, inputs' then weights' (as I, W)")]
    return "\n".join([
        f"the last of 2 stages of an MLP of {c['depth']} x {c['width']}, {c['microbatch_size']} rows, one thread: "
        f"median ms over {c['rounds']} rounds",
        tabulate(rows, headers=["backward", "ms", "/ B", "page faults"]),
        f"(I + W) / B: {result['i_plus_w_over_b']:.3f}, with the W later: {result['i_plus_w_later_over_b']:.3f} "
        "(median of each round's ratio)",
        f"I minus the input's gradient alone: {result['finding_groups_ms']:.3f} ms (finding the weight groups: the "
        "walk of the graph, the accumulators)",
        f"the split's gradients are B's bit for bit: {'yes' if result['same_bits'] else 'NO'}"])


def build_parser():
    parser = cli.ArgumentParser(prog=cli.program_name(__name__), description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=400, help="rounds after the warm-up one (default 400)")
    parser.add_argument("--width", type=int, default=512, help="layer width (default 512, the benchmark's)")
    parser.add_argument("--depth", type=int, default=8, help="Linear+Tanh layers of the whole model (default 8)")
    parser.add_argument("--microbatch-size", type=int, default=32, help="rows (default 32)")
    parser.add_argument("--json", default=None, help="also write the figures here")
    return parser


@command
def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    cli.check_at_least(parser, args, {"--rounds": 1, "--width": 1, "--depth": 1, "--microbatch-size": 1})
    cli.check_outputs(parser, {"--json": args.json})
    result = measure(args.rounds, args.width, args.depth, args.microbatch_size)
    print(f"# {cli.command_line('benchmarks.studies.split_backward', argv)}")
    print(report(result))
    if args.json:
        cli.write_json(args.json, {"command": cli.command_line("benchmarks.studies.split_backward", argv), **result})
    return 0 if result["same_bits"] else 1


if __name__ == "__main__":
    sys.exit(main())
