"""The training program's transformer run, how fast: tokens a second and achieved FLOP/s for each
layout, beside a bare matrix product's FLOP/s on the same cores (the limit) and the one-rank run,
in one run of the program; then where one rank's step spends its time.

    python -m benchmarks.transformer_speed                                   # the default model, up to 2 ranks
    python -m benchmarks.transformer_speed --hidden 256 --layers 4 --rounds 5 --json speed.json

Each layout runs the training program's own loop (ddp_from_scratch/train/transformer.py) on
synthetic tokens, --steps steps of one global batch of --batch-size sequences, one thread a rank.
The rounds alternate the layouts (one run of each a round, in the same order), and a layout's
step time is the median over rounds of the median step of a run (its first two steps left out:
they build the DDP's buckets and warm the allocator). A run's step is rank 0's time from the
batch to the optimizer's step, validation and checkpoint left out.

FLOPs a step (the model's, as PaLM counts them: a multiply-add is 2, the backward twice the
forward, causal attention counted whole): 3 x tokens x (L x (24 h^2 + 4 S h) + 2 h V), for L
blocks of hidden size h on sequences of S tokens and a vocabulary of V. Achieved FLOP/s is that
over the step time; the limit is the bare product's FLOP/s (a 512 x 512 by 512 x 512 float32
torch.mm on one thread, measured on every core at once) times the ranks. The bare product at the
model's own largest shape (the MLP's first layer) is printed beside it: the model cannot be
faster than its products at their size.

Where the time goes, on one rank in this process (one thread): the forward, the backward and the
optimizer's step timed apart, and the forward's products (every Linear at its shape) and its
attention timed alone, so the rest (elementwise work, the framework's per-call cost) is what the
step spends beyond them.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from tabulate import tabulate

import collectives
from collectives import cli, machine
from collectives.cli import command
from collectives.launcher.start_methods import TRAINING, preload
from ddp_from_scratch.train.args import TrainConfig, build_parser as train_parser
from ddp_from_scratch.train.cp import train_cp
from ddp_from_scratch.train.pp import train_pp
from ddp_from_scratch.train.tp import train_tp
from ddp_from_scratch.train.transformer_args import HEADS, HIDDEN, LAYERS, SEQ, VOCAB
from ddp_from_scratch.workload.transformer import TinyTransformer, token_batch


LAYOUTS = [  # (name, loop, ranks, the training program's flags)
    ("one rank", train_tp, 1, ("--tp", "1")),
    ("DP 2", train_tp, 2, ("--tp", "1")),
    ("TP 2", train_tp, 2, ("--tp", "2")),
    ("PP 2, 1F1B, 4 microbatches", train_pp, 2, ("--pp", "2", "--microbatches", "4")),
    ("CP 2", train_cp, 2, ("--cp", "2")),
    ("TP 2 x DP 2", train_tp, 4, ("--tp", "2")),
    ("PP 2 x TP 2 x DP 2", train_pp, 8, ("--pp", "2", "--tp", "2", "--microbatches", "2")),
]
LIMIT_SIZE = 512


def step_flops(vocab: int, hidden: int, layers: int, seq: int, tokens: int) -> int:
    """The model's FLOPs for one training step on `tokens` tokens (PaLM's count)."""
    return 3 * tokens * (layers * (24 * hidden ** 2 + 4 * seq * hidden) + 2 * hidden * vocab)


def _mm_flops(m: int, k: int, n: int, seconds: float = 0.3) -> float:
    """FLOP/s of an (m, k) @ (k, n) float32 torch.mm on this thread, over about `seconds`."""
    a, b = torch.randn(m, k), torch.randn(k, n)
    torch.mm(a, b)
    runs, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        torch.mm(a, b)
        runs += 1
    return 2 * m * k * n * runs / (time.perf_counter() - start)


def bare_product(env, shapes) -> list:
    """Every rank at once, one thread each: FLOP/s of each shape's product."""
    torch.set_num_threads(1)
    collectives.barrier()
    return [_mm_flops(*shape) for shape in shapes]


def _config(flags, args, replicas: int) -> TrainConfig:
    argv = [*flags, "--synthetic", "--batch-size", str(args.batch_size // replicas), "--train-size",
            str(args.batch_size * args.steps), "--hidden", str(args.hidden), "--heads", str(args.heads), "--layers",
            str(args.layers), "--seq", str(args.seq), "--lr", "0.01"]
    return TrainConfig.from_args(train_parser().parse_args(argv))


def _replicas(ranks: int, flags) -> int:
    for flag in ("--tp", "--pp", "--cp"):
        if flag in flags:
            ranks //= int(flags[flags.index(flag) + 1])
    return ranks


def where_the_time_goes(args, steps: int = 20) -> dict:
    """One rank in this process, one thread: median forward, backward, optimizer, and the
    forward's products and attention alone, in seconds."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = TinyTransformer(VOCAB, args.hidden, args.heads, args.layers, positions=args.seq)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    tokens, targets = token_batch(0, 0, args.batch_size, args.seq, VOCAB)
    parts = {"forward": [], "backward": [], "optimizer": []}
    for _ in range(steps + 2):
        t0 = time.perf_counter()
        loss = F.cross_entropy(model(tokens).reshape(-1, VOCAB), targets.reshape(-1))
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        opt.step()
        opt.zero_grad()
        t3 = time.perf_counter()
        for k, seconds in zip(parts, (t1 - t0, t2 - t1, t3 - t2)):
            parts[k].append(seconds)
    out = {k: statistics.median(v[2:]) for k, v in parts.items()}
    t, h = args.batch_size * args.seq, args.hidden
    linears = [(t, h, h)] * 4 * args.layers + [(t, h, 4 * h), (t, 4 * h, h)] * args.layers + [(t, h, VOCAB)]
    x = {shape: (torch.randn(shape[0], shape[1]), torch.randn(shape[2], shape[1])) for shape in set(linears)}

    def products():
        for shape in linears:
            F.linear(*x[shape])

    q = torch.randn(args.batch_size, args.heads, args.seq, h // args.heads)

    def attention():
        for _ in range(args.layers):
            F.scaled_dot_product_attention(q, q, q, is_causal=True)

    for name, fn in (("forward_products", products), ("forward_attention", attention)):
        times = []
        for _ in range(steps + 2):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        out[name] = statistics.median(times[2:])
    return out


def build_parser() -> argparse.ArgumentParser:
    p = cli.ArgumentParser(prog=cli.program_name(__name__), description=__doc__.split("\n\n")[0],
                           formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--hidden", type=int, default=HIDDEN, help="the transformer's hidden size")
    p.add_argument("--heads", type=int, default=HEADS, help="attention heads")
    p.add_argument("--layers", type=int, default=LAYERS, help="transformer blocks")
    p.add_argument("--seq", type=int, default=SEQ, help="tokens a sequence")
    p.add_argument("--batch-size", type=int, default=16, help="sequences a step, over every rank (the global batch)")
    p.add_argument("--steps", type=int, default=12, help="steps a run (the first two left out)")
    p.add_argument("--rounds", type=int, default=3, help="runs of every layout, alternated")
    p.add_argument("--max-ranks", type=int, default=None,
                   help="leave out the layouts of more ranks (default: the machine's cpus)")
    p.add_argument("--json", default=None, help="also write the results here")
    return p


@command
def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    cli.check_at_least(parser, args, {"--hidden": 1, "--heads": 1, "--layers": 1, "--seq": 2, "--batch-size": 1,
                                      "--steps": 3, "--rounds": 1, "--max-ranks": 1})
    if args.hidden % args.heads:
        parser.error(f"--heads {args.heads} does not divide --hidden {args.hidden}")
    cli.check_outputs(parser, {"--json": args.json})
    cores = machine.cpus()
    limit_ranks = args.max_ranks or cores
    layouts = [layout for layout in LAYOUTS if layout[2] <= limit_ranks]
    for name, _, ranks, flags in layouts:
        replicas = _replicas(ranks, flags)
        if args.batch_size % (replicas * (4 if "--pp" in flags else 1)) or args.seq % (4 if "--cp" in flags else 1) \
                or args.heads % (2 if "--tp" in flags and flags[flags.index("--tp") + 1] == "2" else 1):
            parser.error(f"--batch-size {args.batch_size}, --seq {args.seq} or --heads {args.heads} does not split "
                         f"over the layout {name} (the batch over its replicas and microbatches, the sequence into "
                         "2 pieces a CP rank, the heads over TP)")
    preload(*TRAINING)
    tokens = args.batch_size * args.seq
    flops = step_flops(VOCAB, args.hidden, args.layers, args.seq, tokens)
    shapes = [(LIMIT_SIZE, LIMIT_SIZE, LIMIT_SIZE), (tokens, args.hidden, 4 * args.hidden)]
    bare = collectives.run(bare_product, limit_ranks, args=(shapes,), timeout=600)
    per_core = statistics.median(r[0] for r in bare)
    model_shape = statistics.median(r[1] for r in bare)
    steps = {name: [] for name, *_ in layouts}
    for round_ in range(args.rounds):
        for name, loop, ranks, flags in layouts:
            print(f"[round {round_ + 1}/{args.rounds}] {name} on {ranks} rank(s) ...", file=sys.stderr, flush=True)
            summary = collectives.run(loop, ranks, args=(_config(flags, args, _replicas(ranks, flags)),),
                                      timeout=3600)[0]
            steps[name].append(statistics.median(summary["step_seconds"][2:]))
    rows, results = [], []
    one = statistics.median(steps["one rank"])
    for name, _, ranks, _ in layouts:
        step = statistics.median(steps[name])
        achieved = flops / step
        results.append({"layout": name, "ranks": ranks, "step_seconds": step, "tokens_per_second": tokens / step,
                        "flops_per_second": achieved, "of_bare_product": achieved / (per_core * ranks),
                        "against_one_rank": one / step, "rounds": steps[name]})
        rows.append([name, ranks, f"{tokens / step:,.0f}", f"{step * 1e3:.1f}", f"{achieved / 1e9:.2f}",
                     f"{achieved / (per_core * ranks):.0%}", f"{one / step:.2f}x"])
    parts = where_the_time_goes(args)
    step_one = parts["forward"] + parts["backward"] + parts["optimizer"]
    products = 3 * parts["forward_products"]  # the backward's products are twice the forward's
    attention = 3 * parts["forward_attention"]
    print(f"# {cli.command_line('benchmarks.transformer_speed', argv)}")
    print(f"# the small transformer: vocabulary {VOCAB}, hidden {args.hidden}, {args.heads} heads, {args.layers} "
          f"blocks, {args.seq} tokens a sequence; {args.batch_size} sequences ({tokens} tokens) a step, "
          f"{flops / 1e6:.1f} MFLOP a step; {cores} cpus, one thread a rank, Gloo; {args.rounds} rounds, medians")
    print(f"bare product, one thread: {LIMIT_SIZE}^3 {per_core / 1e9:.2f} GFLOP/s a core (the limit); the model's "
          f"largest product ({tokens} x {args.hidden} by {args.hidden} x {4 * args.hidden}) "
          f"{model_shape / 1e9:.2f} GFLOP/s")
    print(tabulate(rows, headers=["layout", "ranks", "tokens/s", "step ms", "GFLOP/s", "of the bare product",
                                  "speed against one rank"], disable_numparse=True))
    print(f"\none rank, where a step's {step_one * 1e3:.1f} ms go: forward {parts['forward'] * 1e3:.1f} ms, backward "
          f"{parts['backward'] * 1e3:.1f} ms, optimizer {parts['optimizer'] * 1e3:.1f} ms; of them the products "
          f"about {products * 1e3:.1f} ms ({products / step_one:.0%}, three times the forward's), attention about "
          f"{attention * 1e3:.1f} ms ({attention / step_one:.0%}), the rest (elementwise work, LayerNorms, the loss, "
          f"the optimizer, each call's framework cost) {max(step_one - products - attention, 0) * 1e3:.1f} ms")
    if args.json:
        cli.write_json(args.json, {"command": cli.command_line("benchmarks.transformer_speed", argv),
                                   "config": vars(args), "cpus": cores, "step_flops": flops,
                                   "bare_product_flops_per_core": per_core, "model_shape_flops": model_shape,
                                   "layouts": results, "one_rank_parts_seconds": parts})
    return 0


if __name__ == "__main__":
    sys.exit(main())
