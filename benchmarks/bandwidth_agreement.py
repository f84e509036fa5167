"""Do two bandwidth runs agree within their printed spread? For every cell (backend, collective,
size, side) of two `python -m benchmarks.bandwidth --json` results: is one run's median inside
the other's range over rounds (the spread column is half that range)? Both ways, with the cells
that fall furthest outside.

    python -m benchmarks.bandwidth_agreement a.json b.json
"""

from __future__ import annotations

from typing import Dict, List, Tuple

from collectives import cli

from .parts.nccl_format import SIDES, size_label

Cell = Tuple[str, str, int, str]


def cells(result: Dict) -> Dict[Cell, Dict]:
    env = result["environment"]
    return {(r.get("backend", env["backend"]), r["collective"], r["size"], side): r[side]
            for r in result["rows"] for side in SIDES if r.get(side) and "time_us_min" in r[side]}


def inside(a: Dict[Cell, Dict], b: Dict[Cell, Dict]) -> Tuple[int, int, List[Tuple[float, Cell]]]:
    """(how many of b's medians lie in a's range, cells both have, [(distance outside in % of a's
    median, cell)] for the rest, furthest first)."""
    common = [k for k in a if k in b]
    outside = []
    for k in common:
        low, high, median = a[k]["time_us_min"], a[k]["time_us_max"], b[k]["time_us"]
        if not low <= median <= high:
            outside.append((100 * (low - median if median < low else median - high) / a[k]["time_us"], k))
    return len(common) - len(outside), len(common), sorted(outside, reverse=True)


def _extent(run: Dict[Cell, Dict]) -> str:
    """"gloo all_reduce 8 B to 64 B" for each backend and collective of a run."""
    sizes: Dict[Tuple[str, str], List[int]] = {}
    for backend, collective, size, _ in run:
        sizes.setdefault((backend, collective), []).append(size)
    return "; ".join(f"{b} {c} {size_label(min(s))} to {size_label(max(s))}" for (b, c), s in sorted(sizes.items()))


def build_parser():
    parser = cli.ArgumentParser(prog="python -m benchmarks.bandwidth_agreement",
                                description="Do two bandwidth runs agree within their spread?")
    parser.add_argument("files", nargs=2, help="two JSON files written by python -m benchmarks.bandwidth --json "
                                                "with --rounds 2 or more")
    parser.add_argument("--show", type=int, default=5, help="cells furthest outside to list")
    return parser


@cli.command
def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    loaded = [cli.load_json(parser, "file", path, keys=("rows", "environment")) for path in args.files]
    for path, result in zip(args.files, loaded):
        rounds = result["environment"].get("rounds") if isinstance(result["environment"], dict) else None
        if isinstance(rounds, int) and rounds < 2:
            parser.error(f"file {path}: its run had --rounds {rounds}, and one round has no range to hold the other "
                         "run's medians against: rerun it with --rounds 2 or more")
    runs = [cells(result) for result in loaded]
    for path, run in zip(args.files, runs):
        if not run:
            parser.error(f"file {path}: no cell has its rounds' range (its run predates them): nothing to compare")
    if not set(runs[0]) & set(runs[1]):
        parser.error(f"the two runs share no cell (backend, collective, size, side): {args.files[0]} has "
                     f"{_extent(runs[0])}, {args.files[1]} has {_extent(runs[1])}")
    for (i, a), (j, b) in (((0, runs[0]), (1, runs[1])), ((1, runs[1]), (0, runs[0]))):
        n_in, n, outside = inside(a, b)
        print(f"{args.files[j]}'s medians inside {args.files[i]}'s range: {n_in}/{n} ({100 * n_in / n:.0f}%)")
        for distance, (backend, collective, size, side) in outside[:args.show]:
            print(f"  {backend} {collective} {size_label(size)} {side}: {distance:.1f}% of the median outside")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
