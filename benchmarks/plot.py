"""Draw busbw against size, one panel per collective, one line per result file (log-2 x axis).

    python -m benchmarks.plot benchmarks/results/a.json benchmarks/results/b.json -o compare.png

Each line is labelled with its run's backend, world size, device and date; a dashed line marks
the run's point-to-point limit where it was measured (--limits). Needs matplotlib (the `plot`
extra).
"""

from __future__ import annotations

from typing import Dict

from collectives import cli

from .parts.busbw_plot import plot_results


ROW_KEYS = ("collective", "size")
ENVIRONMENT_KEYS = ("backend", "world_size", "device", "date")


def _load(parser, path: str) -> Dict:
    """One result file of benchmarks.bandwidth --json, or a usage error naming it and what is missing."""
    what = "benchmarks.bandwidth --json result"
    result = cli.load_json(parser, "file", path, keys=("rows", "environment"), what=what)
    rows, env = result["rows"], result["environment"]
    if not isinstance(rows, list) or not rows or not isinstance(env, dict):
        parser.error(f"file {path}: not a {what} ('rows' must be a non-empty list, 'environment' an object)")
    for key in ENVIRONMENT_KEYS:
        if key not in env:
            parser.error(f"file {path}: not a {what} (no {key!r} in 'environment')")
    for i, row in enumerate(rows):
        if not isinstance(row, dict) or any(k not in row for k in ROW_KEYS) or not (row.get("oop") or row.get("ip")):
            parser.error(f"file {path}: row {i} is not a measurement (needs {', '.join(ROW_KEYS)} and 'oop' or 'ip')")
    return result


def build_parser():
    parser = cli.ArgumentParser(prog=cli.program_name(__name__), description="Plot busbw against size from benchmark JSON files.")
    parser.add_argument("files", nargs="+", help="JSON files written by python -m benchmarks.bandwidth --json")
    parser.add_argument("-o", "--output", required=True, help="PNG file to write")
    return parser


@cli.command
def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    cli.check_outputs(parser, {"-o": args.output})
    results = [_load(parser, path) for path in args.files]
    plot_results(results, args.output, "-o")
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
