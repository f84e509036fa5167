"""What loading the shm backend's built C++ bridge costs a new process, two ways side by side.

The stamped file imported directly (collectives.shm.native.load(), what every rank of an shm group
does) against going through torch.utils.cpp_extension.load() (import it, write the ninja file, run
ninja to find nothing to do, import).

    python -m benchmarks.studies.bridge_load [--rounds 21]

Each round starts one fresh interpreter per way, in a random order, each importing torch first and
then timing only the load. Prints the median milliseconds of each way and the median of the
per-round ratios. The bridge must be built already (the first load() builds it).
"""

from __future__ import annotations

import random
import statistics
import subprocess
import sys

from collectives import cli

WAYS = {
    "stamped file": "native.load()",
    "cpp_extension.load": "native.load_through_torch()",
}
TEMPLATE = ("import time, torch; from collectives.shm import native; t = time.perf_counter(); {call}; "
            "print((time.perf_counter() - t) * 1e3)")


def _once(call: str) -> float:
    out = subprocess.run([sys.executable, "-c", TEMPLATE.format(call=call)], capture_output=True, text=True, check=True)
    return float(out.stdout.split()[-1])


def build_parser():
    parser = cli.ArgumentParser(prog="python -m benchmarks.studies.bridge_load", description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=21, help="fresh processes per way (default 21)")
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    cli.check_at_least(parser, args, {"--rounds": 2})
    from collectives.shm import native

    native.load()  # built and stamped before any round
    times = {way: [] for way in WAYS}
    order = list(WAYS)
    for k in range(args.rounds):
        random.Random(k).shuffle(order)
        for way in order:
            times[way].append(_once(WAYS[way]))
        print(f"round {k + 1}/{args.rounds}", file=sys.stderr, end="\r", flush=True)
    print(file=sys.stderr)
    for way, ms in times.items():
        q = statistics.quantiles(ms, n=4)
        print(f"{way:>20}: median {statistics.median(ms):8.2f} ms (quartiles {q[0]:.2f}-{q[2]:.2f})")
    ratios = [a / b for a, b in zip(times["cpp_extension.load"], times["stamped file"])]
    print(f"{'cpp_extension / stamped':>20}: {statistics.median(ratios):.1f}x (median of {args.rounds} rounds)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
