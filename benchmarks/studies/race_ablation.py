"""What each part of the two-level model buys: a race across hosts re-predicted with and without
the link's token bucket and with and without the shared cores, against the same measurements.

    python -m benchmarks.studies.race_ablation benchmarks/results/algorithms-race_gloo-cpu-2core_2hosts-x2ranks-link-*_2026-11-24.json

For each saved run of `python -m benchmarks.algorithms --link RATE` across hosts (its JSON), the
simulator predicts every algorithm at every size four ways: the link's rate alone, or through the
bucket the run used (its "burst"); every rank with a core of its own, or the run's ranks per core
(its "cpu_share", CostModel.sharing). It prints how many predictions from 1 MiB fall within 20% of
the measured time, and the worst miss, for each. The last column is the model the race itself
used: its predictions are checked to be the ones the run saved.
"""

from __future__ import annotations

import sys

from collectives import cli
from collectives.algorithms.cost import CostModel

from ..parts.prediction import predict, topology_of
from ..parts.sweep import DTYPES
from ..parts.cases import buffer_count

VARIANTS = [("rate alone", False, False), ("bucket", True, False), ("shared cores", False, True),
            ("bucket + shared cores", True, True)]


def score(run: dict, bucket: bool, shared: bool, tolerance: float = 0.2):
    """(predictions within tolerance, of how many, the worst measured/predicted - 1) from 1 MiB."""
    model = CostModel(**{k: run["model"][k] for k in ("alpha", "beta", "gamma")})
    topology = topology_of(run["hosts"], model, run["link"], run["burst"] if bucket else 0.0,
                           run.get("cpu_share", 1.0) if shared else 1.0)
    dtype, within, worst = DTYPES["float32"], 0, 0.0  # the race's dtype
    cases = [(row, a, m) for row in run["rows"] if row["size"] >= 1 << 20 for a, m in row["algorithms"].items()]
    for row, algorithm, measured in cases:
        count = buffer_count(row["collective"], row["size"], run["world_size"], dtype.itemsize)
        predicted = predict(row["collective"], algorithm, count, run["world_size"], dtype, model, topology)
        if bucket and shared and abs(predicted - measured["predicted_s"]) > 1e-9 * predicted:
            raise ValueError(f"{algorithm} at {row['size']} B: the run saved the prediction {measured['predicted_s']} s, "
                             f"its model now gives {predicted} s (another cost model or simulator)")
        error = measured["s"] / predicted - 1
        within += abs(error) <= tolerance
        worst = max(worst, error, key=abs)
    return within, len(cases), worst


def build_parser():
    parser = cli.ArgumentParser(prog="python -m benchmarks.studies.race_ablation", description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", metavar="RUN.json", help="races across hosts (benchmarks.algorithms --json)")
    return parser


@cli.command
def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    runs = []
    what = "race across hosts (benchmarks.algorithms --link ... --json)"
    for path in args.runs:
        run = cli.load_json(parser, "RUN.json", path, keys=("rows", "world_size", "hosts", "model", "link"), what=what)
        if not run["link"] or "burst" not in run:
            parser.error(f"RUN.json {path}: not a race across hosts with the link's bucket recorded (benchmarks.algorithms "
                         "--link; runs before 2026-11-24's bucket model did not record it)")
        if not isinstance(run["rows"], list) or not all(isinstance(row, dict) for row in run["rows"]):
            parser.error(f"RUN.json {path}: not a {what} ('rows' is not a list of measurements)")
        runs.append((path, run))
    print("predictions from 1 MiB within 20% of the measured time (worst measured/predicted - 1)")
    print(f"{'link':>8}  " + "  ".join(f"{name:>22}" for name, _, _ in VARIANTS))
    for path, run in runs:
        cells = []
        for _, bucket, shared in VARIANTS:
            try:
                within, total, worst = score(run, bucket, shared)
            except ValueError as exc:
                parser.error(f"RUN.json {path}: {exc}")
            except (KeyError, TypeError, AttributeError) as exc:  # a measurement without what a race records
                parser.error(f"RUN.json {path}: not a {what} ({type(exc).__name__}: {exc})")
            cells.append(f"{within:>3} of {total} ({worst * 100:+.0f}%)")
        print(f"{run['link']:>8}  " + "  ".join(f"{c:>22}" for c in cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
