"""Watch one algorithm: its picture, the step table, the simulated time against the closed form,
and a Chrome trace and a space-time PNG of every message.

    python -m collectives.algorithms.show all_reduce --algorithm ring --world-size 4
    python -m collectives.algorithms.show all_gather --algorithm bruck --world-size 5 --out bruck
    python -m collectives.algorithms.show broadcast --algorithm chain --world-size 6 --bytes 64M
    python -m collectives.algorithms.show all_reduce --algorithm rabenseifner --world-size 1024 --no-table

The run is simulated (sim.py) with the fitted cost model (cost.py; --model FILE for another):
rank r starts with 2**r in every element, so the table can say which ranks' contributions
each chunk holds after each step. Writes OUT.json (open it in ui.perfetto.dev) and OUT.png.
"""

from __future__ import annotations

import argparse
import importlib
import sys

import torch

from .. import cli
from ..cli import command
from . import ALGORITHMS, simulate
from .cost import CostModel
from .draw import chunk_sets, message_summary, origin_inputs, plot_spacetime, step_table, write_chrome_trace


def _parse_bytes(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper().rstrip("B")
    try:
        return int(text[:-1]) * units[text[-1]] if text and text[-1] in units else int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size like 4096, 64K or 16M") from None


def build_parser():
    parser = cli.ArgumentParser(prog="python -m collectives.algorithms.show", description=__doc__.split("\n\n")[0])
    parser.add_argument("collective", choices=list(ALGORITHMS), help="which collective")
    parser.add_argument("--algorithm", "-a", default="auto", help="the algorithm (default: auto, the cheapest predicted)")
    parser.add_argument("--world-size", "-n", type=int, default=4, help="simulated ranks (1 to 4096; the table: up to 62)")
    parser.add_argument("--bytes", type=_parse_bytes, default=1 << 20,
                        help="bytes of the buffer per rank, K/M/G (all_gather/gather: the gathered output)")
    parser.add_argument("--root", type=int, default=0, help="src/dst of the rooted collectives")
    parser.add_argument("--model", default=None, help="cost model JSON (default: the fitted one)")
    parser.add_argument("--out", default=None, help="write OUT.json (Chrome trace) and OUT.png (default: no files)")
    parser.add_argument("--no-table", action="store_true", help="skip the step table (needed above 62 ranks)")
    return parser


@command
def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.out:
        cli.check_outputs(parser, [("--out", args.out + ".json"), ("--out", args.out + ".png")])
    if not 1 <= args.world_size <= 4096:
        parser.error(f"--world-size must be 1 to 4096, got {args.world_size}")
    cli.check_at_least(parser, args, {"--bytes": 1})
    if args.world_size > 62 and not args.no_table:
        parser.error("the step table names ranks by the bits of an int64: use --no-table above 62 ranks")
    if not 0 <= args.root < args.world_size:
        parser.error(f"--root {args.root} is not a rank of a world of {args.world_size}")
    if args.algorithm != "auto" and args.algorithm not in ALGORITHMS[args.collective]:
        parser.error(f"{args.collective} has no algorithm {args.algorithm!r}: one of {', '.join(ALGORITHMS[args.collective])}")
    try:
        model = CostModel.load(args.model)
    except ValueError as exc:
        parser.error(f"--model: {exc}")
    p = args.world_size
    per_rank = args.bytes // 8 // (p if args.collective in ("all_gather", "gather") else 1)
    if args.collective == "all_to_all":
        per_rank = max(p, per_rank - per_rank % p)
    if args.no_table:  # any data will do; origin_inputs' 2**r names at most 62 ranks
        inputs = [torch.full((max(per_rank, 1),), r + 1, dtype=torch.int64) for r in range(p)]
    else:
        inputs = origin_inputs(args.collective, p, max(per_rank, 1), args.root)
    watch = None if args.no_table else chunk_sets(p)
    outs, result = simulate(args.collective, args.algorithm, inputs, op="sum", root=args.root, model=model, watch=watch)
    nbytes = inputs[0].numel() * 8 * (p if args.collective in ("all_gather", "gather") else 1)
    name = args.algorithm
    if name == "auto":
        from .cost import choose
        name = choose(args.collective, nbytes, p, model)
    module = importlib.import_module(ALGORITHMS[args.collective][name].__module__)
    print(module.__doc__.strip() + "\n")
    print(f"{args.collective}, algorithm {name}, {p} simulated ranks, {nbytes} bytes per rank (int64)")
    if watch is not None:
        print("\nwhich ranks' data each chunk holds (c0..c{}: the buffer's chunks; 0+1: ranks 0 and 1 summed):"
              .format(p - 1))
        print(step_table(result.snapshots, p))
    predicted = model.predict(args.collective, name, nbytes, p)
    print(f"\n{message_summary(result.messages)}")
    print(f"simulated time {result.time * 1e6:.1f} us; closed form {predicted * 1e6:.1f} us "
          f"(alpha {model.alpha * 1e6:.2f} us, beta {model.beta * 1e9:.3f} ns/B, gamma {model.gamma * 1e9:.3f} ns/B: "
          f"{model.source})")
    if args.out:
        write_chrome_trace(result.messages, result.computes, args.out + ".json")
        plot_spacetime(result.messages, result.computes, p, args.out + ".png",
                       title=f"{args.collective} {name}, {p} ranks, {nbytes} B", predicted=predicted)
        print(f"wrote {args.out}.json (open in ui.perfetto.dev) and {args.out}.png", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
