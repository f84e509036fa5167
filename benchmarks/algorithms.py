"""The race: every from-scratch algorithm against the backend's own collective, with the cost
model's prediction beside each measured time, and how well "auto" chose.

    python -m benchmarks.algorithms --world-size 2 -b 8 -e 256M -f 4 --json race.json --plot race.png
    python -m benchmarks.algorithms --world-size 4 -c all_reduce reduce_scatter all_gather

For each collective and size: the backend's time (raw torch.distributed, as in
benchmarks.bandwidth), each algorithm's (collectives.algorithms on point-to-point messages,
through its public call), both the median over iterations of the slowest rank's time, alternated
call by call, every output checked once on exact data (#wrong); then each algorithm's time as a
ratio to the backend's (below 1: faster) and the closed-form prediction from the fitted model
(cost.py). "auto" is scored against the measurements: how often its predicted-cheapest choice
was the measured-fastest algorithm, and its regret, t(auto's choice) / t(fastest) - 1.

Across hosts (torchrun or srun on several machines; the ranks' hostnames tell), give the rate of
the link between them with --link: the predictions are then the simulator's on a two-level
topology (algorithms/topology.py: the fitted model within a host, the link's rate between
hosts, through the token bucket that shapes it: --burst, by default the cluster's), and the
report says how far each measured time is from its prediction from 1 MiB. Each timed call then
starts after the bucket has had time to fill (the simulator starts with it full):

    python -m collectives.cluster up --nodes 2 --link 1gbit
    python -m collectives.cluster run node0 -- torchrun --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d \
        --rdzv-endpoint node0:29500 -m benchmarks.algorithms -c all_reduce -b 1M -e 64M --link 1gbit   # and node1
"""

from __future__ import annotations

import datetime
import os
import statistics
import sys
import time

import torch
from tabulate import tabulate

import collectives
import collectives.algorithms as A
from collectives.algorithms.cost import CostModel, choose
from collectives.algorithms.topology import PAYLOAD_PER_FRAME, link_beta
from collectives import cli, machine
from collectives.launcher.env import read_env
from collectives.cli import command, eta_by_size

from .parts.sweep import DTYPES, alternate_calls, check_sweep, parse_size, size_list
from .parts.cases import buffer_count, count_wrong, make_algorithm_case, make_case
from .parts.prediction import cpu_share, predict, refill_seconds, topology_of

COLLECTIVES = list(A.ALGORITHMS)
BACKEND_SIDE = {"all_reduce": "ip", "broadcast": "ip", "reduce": "ip", "all_gather": "oop", "reduce_scatter": "oop",
                "all_to_all": "oop"}


def _iterations(nbytes: int) -> int:
    """Fewer timed iterations as a call gets slower (the whole race must fit in minutes)."""
    return 25 if nbytes <= 1 << 20 else 9 if nbytes <= 16 << 20 else 5 if nbytes <= 64 << 20 else 3


def race(env, config: dict) -> dict:
    dtype, n, r = DTYPES["float32"], env.world_size, env.rank
    sizes = size_list(config["minbytes"], config["maxbytes"], config["stepfactor"], with_end=True)
    model = CostModel.load()
    hosts = A.DistComm().hosts()
    share = cpu_share() if len(set(hosts)) > 1 else 1.0
    topology = topology_of(hosts, model, config.get("link"), config.get("burst"), share)
    rows, timed = [], []  # timed: (bytes, seconds) per size done, for the time left
    for c_index, collective in enumerate(config["collective"]):
        names = list(A.ALGORITHMS[collective])
        for k, nbytes in enumerate(sizes):
            started = time.perf_counter()
            count = buffer_count(collective, nbytes, n, dtype.itemsize)
            backend = make_case(collective, BACKEND_SIDE[collective], count, n, r, "sum", dtype, torch.device("cpu"))
            ours = {a: make_algorithm_case(collective, a, count, n, r, "sum", dtype, torch.device("cpu"))[1:] for a in names}
            seconds = alternate_calls([backend[0]] + [case[0] for case in ours.values()],
                                      _iterations(count * dtype.itemsize), idle=refill_seconds(topology))
            wrong = [count_wrong(backend, "cpu")] + [count_wrong(case, "cpu") for case in ours.values()]
            size = count * dtype.itemsize
            # only rank 0 reports (simulating the others' too would only delay the next size)
            predicted = {a: predict(collective, a, count, n, dtype, model, topology) if r == 0 else None for a in names}
            rows.append({
                "collective": collective, "size": size, "backend_s": seconds[0], "backend_wrong": wrong[0],
                "algorithms": {a: {"s": t, "wrong": w, "predicted_s": predicted[a]}
                               for a, t, w in zip(names, seconds[1:], wrong[1:])},
                # across hosts, the algorithm the simulator predicts fastest
                "auto": choose(collective, size, n, model) if topology is None or r else min(names, key=predicted.get),
            })
            del backend, ours
            timed.append((nbytes, time.perf_counter() - started))
            if r == 0:
                left = eta_by_size(timed, sizes[k + 1:] + sizes * (len(config["collective"]) - c_index - 1))
                print(f"[{collective}] {size} B done ({k + 1}/{len(sizes)}) {left}", file=sys.stderr, flush=True)
    return {"rows": rows, "world_size": n, "backend": env.backend, "model": model.__dict__, "hosts": hosts,
            "link": config.get("link") if topology is not None else None,
            "burst": topology.burst if topology is not None else None, "cpu_share": share}


def _link_details(result: dict) -> str:
    """How the prediction modelled the link's bucket and the shared cores (where the run recorded them)."""
    parts = []
    if result.get("burst") is not None:
        parts.append(f"through a {result['burst'] / 1e3:.0f} KB bucket, full at each call's start" if result["burst"]
                     else "without a bucket")
    if result.get("cpu_share", 1) > 1:
        parts.append(f"{result['cpu_share']:g} ranks per core: alpha, beta, gamma x{result['cpu_share']:g}")
    return "".join(f"; {p}" for p in parts)


def _us(seconds: float) -> str:
    return f"{seconds * 1e6:.0f}" if seconds * 1e6 >= 100 else f"{seconds * 1e6:.1f}"


def report(result: dict) -> str:
    lines = []
    n = result["world_size"]
    for collective in dict.fromkeys(row["collective"] for row in result["rows"]):
        rows = [row for row in result["rows"] if row["collective"] == collective]
        names = list(rows[0]["algorithms"])
        table = []
        for row in rows:
            cells = [row["size"], _us(row["backend_s"])]
            for a in names:
                m = row["algorithms"][a]
                cells.append(f"{_us(m['s'])} ({m['s'] / row['backend_s']:.2f}x) ~{_us(m['predicted_s'])}")
            fastest = min(names, key=lambda a: row["algorithms"][a]["s"])
            cells += [fastest, row["auto"]]
            table.append(cells)
        where = (f"the simulator's prediction ({len(set(result['hosts']))} hosts linked at {result['link']}"
                 f"{_link_details(result)})" if result.get("link") else "the cost model's prediction")
        lines.append(f"\n{collective}, {n} ranks: microseconds per call, (ratio to {result['backend']}'s own; below 1 "
                     f"is faster), ~ {where}")
        lines.append(tabulate(table, headers=["bytes", result["backend"]] + names + ["fastest", "auto chose"],
                              disable_numparse=True))
    return "\n".join(lines)


def auto_score(result: dict) -> dict:
    """How often auto's choice was the measured-fastest, and its regret t(choice)/t(fastest) - 1."""
    hits, regrets = 0, []
    for row in result["rows"]:
        times = {a: m["s"] for a, m in row["algorithms"].items()}
        best = min(times.values())
        hits += times[row["auto"]] == best
        regrets.append(times[row["auto"]] / best - 1)
    return {"cases": len(regrets), "fastest_chosen": hits, "median_regret": statistics.median(regrets),
            "worst_regret": max(regrets)}


def prediction_errors(result: dict, from_bytes: int = 1 << 20, within: float = 0.2) -> str:
    """Each algorithm's measured time against its prediction, from `from_bytes`: measured /
    predicted - 1 at every size, and how many are within `within`."""
    lines, hits, total = [], 0, 0
    for collective in dict.fromkeys(row["collective"] for row in result["rows"]):
        rows = [row for row in result["rows"] if row["collective"] == collective and row["size"] >= from_bytes]
        for a in (rows[0]["algorithms"] if rows else ()):
            errors = [row["algorithms"][a]["s"] / row["algorithms"][a]["predicted_s"] - 1 for row in rows]
            hits += sum(abs(e) <= within for e in errors)
            total += len(errors)
            lines.append(f"  {collective} {a}: " + ", ".join(f"{e:+.0%}" for e in errors))
    head = (f"measured / predicted - 1 from {from_bytes >> 20} MiB, size by size: {hits} of {total} within "
            f"{within:.0%}")
    return "\n".join([head] + lines)


def busbw(result: dict) -> str:
    """all_reduce's bus bandwidth (nccl-tests: 2(p-1)/p n / t) of the backend and the fastest
    algorithm at each size, against the link's rate when there is one."""
    n = result["world_size"]
    rows = [row for row in result["rows"] if row["collective"] == "all_reduce"]
    if not rows:
        return ""
    factor = 2 * (n - 1) / n
    out = ["all_reduce busbw, GB/s (2(p-1)/p n / t)" + (f"; the link: {result['link']}" if result.get("link") else "")]
    for row in rows:
        best = min(row["algorithms"], key=lambda a: row["algorithms"][a]["s"])
        out.append(f"  {row['size']:>10} B  {result['backend']} {factor * row['size'] / row['backend_s'] / 1e9:.3f}"
                   f"  {best} {factor * row['size'] / row['algorithms'][best]['s'] / 1e9:.3f}")
    return "\n".join(out)


def large_sizes(result: dict) -> str:
    """From 16 MiB: the ring all_reduce's time against the backend's, and how much faster the best
    reduce_scatter and all_gather algorithm is than the backend's."""
    out = []
    big = [row for row in result["rows"] if row["size"] >= 16 << 20]
    for row in big:
        if row["collective"] == "all_reduce":
            ratio = row["algorithms"]["ring"]["s"] / row["backend_s"]
            out.append(f"all_reduce ring at {row['size'] >> 20} MiB: {ratio:.2f}x the backend's time")
        if row["collective"] in ("reduce_scatter", "all_gather"):
            best = min(row["algorithms"], key=lambda a: row["algorithms"][a]["s"])
            speedup = row["backend_s"] / row["algorithms"][best]["s"]
            out.append(f"{row['collective']} {best} at {row['size'] >> 20} MiB: {speedup:.2f}x faster than the backend")
    return "\n".join(out)


def plot(results, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    collectives_ = list(dict.fromkeys(row["collective"] for res in results for row in res["rows"]))
    cols = min(3, len(collectives_))
    per_result = -(-len(collectives_) // cols)  # rows of panels for one run
    fig, axes = plt.subplots(per_result * len(results), cols, figsize=(5.2 * cols, 3.8 * per_result * len(results)),
                             squeeze=False)
    for ax in axes.flat:
        ax.axis("off")
    for i, res in enumerate(results):
        for j, collective in enumerate(collectives_):
            ax = axes[i * per_result + j // cols][j % cols]
            ax.axis("on")
            rows = [row for row in res["rows"] if row["collective"] == collective]
            if not rows:
                ax.axis("off")
                continue
            sizes = [row["size"] for row in rows]
            ax.plot(sizes, [row["backend_s"] * 1e6 for row in rows], "k-o", ms=3, label=f"{res['backend']} (measured)")
            for k, a in enumerate(rows[0]["algorithms"]):
                color = plt.get_cmap("tab10")(k)
                ax.plot(sizes, [row["algorithms"][a]["s"] * 1e6 for row in rows], "-o", ms=3, color=color, label=a)
                ax.plot(sizes, [row["algorithms"][a]["predicted_s"] * 1e6 for row in rows], "--", color=color, lw=1)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            where = (f", {len(set(res['hosts']))} hosts linked at {res['link']}" if res.get("link") else "")
            ax.set_title(f"{collective}, {res['world_size']} ranks{where}", fontsize=10)
            ax.set_xlabel("bytes")
            ax.set_ylabel("us per call (dashed: predicted)")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
    fig.tight_layout()
    cli.save_figure(fig, path, dpi=100)
    plt.close(fig)


def _load(parser, path: str) -> dict:
    """A run written by --json, or a usage error naming the file and what is missing."""
    what = "benchmarks.algorithms --json run"
    run = cli.load_json(parser, "--replot", path, keys=("rows", "world_size", "backend"), what=what)
    for i, row in enumerate(run["rows"] if isinstance(run["rows"], list) else [None]):
        if not isinstance(row, dict) or any(k not in row for k in ("collective", "size", "backend_s", "algorithms")):
            parser.error(f"--replot {path}: row {i} is not a measurement of a {what}")
    return run


def build_parser():
    parser = cli.ArgumentParser(prog="python -m benchmarks.algorithms", description=__doc__.split("\n\n")[0])
    parser.add_argument("-c", "--collective", nargs="+", default=["all_reduce", "reduce_scatter", "all_gather",
                                                                  "broadcast", "reduce", "all_to_all"],
                        choices=[c for c in COLLECTIVES if c not in ("gather", "scatter")], help="collectives to race")
    parser.add_argument("-b", "--minbytes", type=parse_size, default=parse_size("8"), help="smallest size, bytes (K/M/G)")
    parser.add_argument("-e", "--maxbytes", type=parse_size, default=parse_size("64M"), help="largest size, bytes")
    parser.add_argument("-f", "--stepfactor", type=int, default=4, help="multiply the size by this each step")
    parser.add_argument("--world-size", type=int, default=2, help="ranks to spawn (ignored under torchrun/srun)")
    parser.add_argument("--link", metavar="RATE", default=None,
                        help="across hosts: the rate of the link between them in tc's units (1gbit, 100mbit), for "
                             "the two-level predictions")
    parser.add_argument("--burst", type=parse_size, default=None, metavar="BYTES",
                        help="with --link: the bytes the link's token bucket lets through at once (tc tbf's burst; "
                             "default: the cluster's bucket at that rate, 4 ms of it); 0 for a link without one")
    parser.add_argument("--json", metavar="FILE", help="write every measurement as JSON")
    parser.add_argument("--plot", metavar="FILE.png", help="time against size, measured and predicted")
    parser.add_argument("--replot", metavar="RUN.json", nargs="+",
                        help="only draw --plot from saved --json runs (no measuring)")
    return parser


@command
def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    check_sweep(args, parser)
    cli.check_at_least(parser, args, {"--world-size": 1})
    if args.replot:
        if not args.plot:
            parser.error("--replot needs --plot FILE.png")
        cli.check_outputs(parser, {"--plot": args.plot})
        runs = [_load(parser, path) for path in args.replot]
        plot(runs, args.plot)
        return 0
    cli.check_outputs(parser, {"--json": args.json, "--plot": args.plot})
    if args.link is not None:
        try:
            link_beta(args.link)
        except ValueError as exc:
            parser.error(f"--link: {exc}")
        if read_env(os.environ)["master_addr"] is None:
            parser.error(f"--link {args.link} is the rate between hosts, but the ranks this spawns are all on this "
                         "host: leave --link out, or start the ranks on several hosts with torchrun or srun")
    elif args.burst is not None:
        parser.error("--burst is the bucket of the link that --link names; give --link too")
    config = {k: getattr(args, k) for k in ("collective", "minbytes", "maxbytes", "stepfactor", "link")}
    config["burst"] = None if args.burst is None else args.burst * PAYLOAD_PER_FRAME  # tc counts frames' bytes
    result = collectives.run_or_join(race, args.world_size, args=(config,), timeout=6 * 3600)
    if result is None:  # a torchrun/srun rank other than 0: rank 0 reports
        return 0
    score = auto_score(result)
    print(f"# python -m benchmarks.algorithms {' '.join(argv)}")
    print(f"# {datetime.date.today().isoformat()}, torch {torch.__version__}, {machine.cpus()} cpus; cost model: "
          f"alpha {result['model']['alpha'] * 1e6:.1f} us, beta {result['model']['beta'] * 1e9:.3f} ns/B, "
          f"gamma {result['model']['gamma'] * 1e9:.3f} ns/B ({result['model']['source']})")
    print(report(result))
    print(f"\nauto chose the measured-fastest algorithm in {score['fastest_chosen']} of {score['cases']} cases; regret "
          f"(its time over the fastest's, minus 1): median {score['median_regret']:.2f}, worst {score['worst_regret']:.2f}")
    print(prediction_errors(result))
    print(busbw(result))
    if not result.get("link"):
        print(large_sizes(result))
    wrong = sum(row["backend_wrong"] + sum(m["wrong"] for m in row["algorithms"].values()) for row in result["rows"])
    print(f"# wrong elements in all checks: {wrong}")
    if args.json:
        cli.write_json(args.json, {**result, "auto": score, "command": cli.command_line("benchmarks.algorithms", argv)})
    if args.plot:
        plot([result], args.plot)
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
