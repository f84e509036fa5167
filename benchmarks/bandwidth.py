"""Collective bandwidth in nccl-tests' format, on Gloo, shm or NCCL, backends side by side, with a
correctness count.

    python -m benchmarks.bandwidth --world-size 2 -c all -b 8 -e 64M --backend gloo shm --limits --plot busbw.png
    python -m benchmarks.bandwidth --world-size 4 -c all -b 1K -e 256M --json run.json
    torchrun --nproc_per_node=8 -m benchmarks.bandwidth -c all_reduce -b 8 -e 8G --device cuda
    srun -N2 --ntasks-per-node=8 python -m benchmarks.bandwidth -c all -b 8 -e 1G --device cuda

Started plainly it spawns --world-size ranks; under torchrun or srun it uses theirs. The sweep
runs in --rounds rounds, the sizes in a shuffled order each round, and the backends alternated
within each size, on groups over the same ranks (benchmarks/parts/bandwidth_rounds.py). Each cell is
the median over rounds, and its spread (half the range of the rounds, in %) is printed beside it;
the JSON keeps every round. Per backend, the table (stdout) has nccl-tests' columns for
out-of-place and in-place; torch.distributed has no out-of-place all_reduce, broadcast or reduce
and no in-place all_to_all, so those columns read N/A. A call's time is the slowest rank's;
#wrong is a separate run on data whose result is exact in any order, counted over all ranks; any
wrong element makes the exit code 1. With --limits, a point-to-point message of every size is
timed in the same rounds, and %limit holds each busbw against it at its size
(benchmarks/parts/bandwidth_report.py says why that bounds every collective, and names any that passes
it). The timed calls are raw torch.distributed (the backend's own speed);
benchmarks/wrapper_overhead.py measures what the checked wrappers add.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import io
import os
import platform
import sys

import torch

import collectives
from collectives import cli
from collectives.cli import command

from collectives.launcher.env import pick_backend, read_env

from .parts import limits as machine_limits
from .parts.bandwidth_report import add_limits, faster_by_size, limit_line, over_limit
from .parts.bandwidth_rounds import reference_kind, run_rounds
from .parts.cases import OPS
from .parts.nccl_format import footer, format_row, header
from .parts.sweep import DTYPES, check_sweep, parse_size

# and nccl-tests' sendrecv: every rank sends its buffer to the next and receives the one before's
# (point-to-point messages, batch_isend_irecv), busbw = algbw
COLLECTIVES = ["all_reduce", "broadcast", "reduce", "all_gather", "reduce_scatter", "all_to_all", "sendrecv"]
BACKENDS = ["gloo", "shm", "nccl"]


def build_parser() -> argparse.ArgumentParser:
    p = cli.ArgumentParser(prog="python -m benchmarks.bandwidth", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("-c", "--collective", nargs="+", default=["all_reduce"], choices=COLLECTIVES + ["all"],
                   help="collectives to run ('all' runs each)")
    p.add_argument("-b", "--minbytes", type=parse_size, default=parse_size("8"), help="smallest size, bytes (K/M/G)")
    p.add_argument("-e", "--maxbytes", type=parse_size, default=parse_size("64M"), help="largest size, bytes (K/M/G)")
    p.add_argument("-f", "--stepfactor", type=int, default=2, help="multiply the size by this each step")
    p.add_argument("-n", "--iters", type=int, default=20,
                   help="timed calls per cell and round, at most (fewer where they pass --budget-ms)")
    p.add_argument("-w", "--warmup_iters", type=int, default=1, help="warm-up calls per cell and round")
    p.add_argument("-o", "--op", default="sum", choices=list(OPS), help="reduction op")
    p.add_argument("-d", "--datatype", default="float32", choices=list(DTYPES), help="element type")
    p.add_argument("--backend", nargs="+", choices=BACKENDS, metavar="BACKEND",
                   help="one or more of gloo, shm, nccl, timed side by side on groups over the same ranks "
                        "(default: nccl with one GPU per rank on cuda, else gloo)")
    p.add_argument("--device", choices=["cpu", "cuda"], help="where the buffers live (default: cuda with nccl, else cpu)")
    p.add_argument("--rounds", type=int, default=7,
                   help="rounds of the whole sweep, sizes shuffled each round; a cell is the median over rounds")
    p.add_argument("--budget-ms", type=float, default=10.0,
                   help="time a cell's timed calls may take per round and backend (at least one call)")
    p.add_argument("--check", type=int, default=1, choices=[0, 1], help="count wrong elements (#wrong)")
    p.add_argument("--world-size", type=int, default=2, help="ranks to spawn when not under torchrun/srun")
    p.add_argument("--limits", action="store_true",
                   help="also time a point-to-point message of every size in the same rounds (%%limit: busbw against "
                        "it) and measure memory copy bandwidth")
    p.add_argument("--json", metavar="FILE", help="write every row and the environment as JSON")
    p.add_argument("--csv", metavar="FILE", help="write every row as CSV")
    p.add_argument("--plot", metavar="FILE.png",
                   help="per collective, time (us) and busbw against size, every backend, with the rounds' spread")
    p.add_argument("--timeout", type=float, default=3600, help="seconds before a hung run is stopped (spawn mode)")
    p.add_argument("--algorithm", default=None,
                   help="time a from-scratch algorithm (collectives.algorithms: ring, recursive_doubling, bruck, ...) "
                        "instead of the backend's own; collectives without it are skipped")
    return p


def validate(args, parser) -> None:
    """Refuse nonsense with a message naming the flag, before any rank starts."""
    check_sweep(args, parser)
    cli.check_at_least(parser, args, {"-n": 1, "-w": 0, "--world-size": 1, "--rounds": 1})
    cli.check_positive(parser, args, "--budget-ms", "milliseconds")
    cli.check_positive(parser, args, "--timeout", "seconds")
    args.backend = args.backend or []
    if len(set(args.backend)) != len(args.backend):
        parser.error(f"--backend names a backend twice: {' '.join(args.backend)}")
    if "shm" in args.backend and args.device == "cuda":
        parser.error("--backend shm moves CPU tensors only; use --device cpu")
    if "nccl" in args.backend and len(args.backend) > 1 and args.device != "cuda":
        parser.error("--backend nccl with others needs --device cuda (NCCL moves CUDA tensors only)")
    if args.algorithm and len(args.backend) > 1:
        parser.error("--algorithm times one backend's point-to-point messages: give one --backend")
    dtype = DTYPES[args.datatype]
    if args.op == "avg" and not dtype.is_floating_point:
        parser.error(f"-o avg needs a floating -d, not {args.datatype} (the average of integers would round)")
    if args.device == "cuda" or "nccl" in args.backend:
        if not torch.cuda.is_available():
            parser.error("--device cuda / --backend nccl need a CUDA device, and none is available here")
    if "nccl" in args.backend and args.device == "cpu":
        parser.error("--backend nccl moves CUDA tensors only; use --device cuda or --backend gloo")
    args.notes = []
    launched = read_env(os.environ)
    world_size = launched["world_size"] if launched["master_addr"] is not None else args.world_size
    if world_size == 1 and "sendrecv" in args.collective:  # each rank sends to the next: there is no next
        parser.error("-c sendrecv needs 2 ranks or more (each rank sends to the next and receives from the one "
                     "before): give --world-size 2 or more")
    if "all" in args.collective:
        args.collective = list(COLLECTIVES)
        if world_size == 1:
            args.collective.remove("sendrecv")
            args.notes.append("# sendrecv left out: it needs 2 ranks or more (each rank sends to the next)")
    if args.algorithm:
        import collectives.algorithms as A

        having = [c for c in args.collective if args.algorithm in A.ALGORITHMS.get(c, {})]
        if not having:
            known = sorted({a for algos in A.ALGORITHMS.values() for a in algos})
            parser.error(f"--algorithm {args.algorithm}: none of {', '.join(args.collective)} has it "
                         f"(algorithms: {', '.join(known)})")
        args.collective = having
    cli.check_outputs(parser, {"--json": args.json, "--csv": args.csv, "--plot": args.plot})


def _env_line(result: dict) -> str:
    return (f"# collectives-playground benchmark: backend {' and '.join(result['backends'])}, world size "
            f"{result['world_size']}, device {result['device']} ({result['device_name']}), torch {torch.__version__}")


def run_benchmark(env, config: dict) -> dict:
    """On every rank: the rounds (bandwidth_rounds.py), then the memory limits if asked."""
    result = run_rounds(env, config)
    device = torch.device(result["device"])
    result["limits"] = machine_limits.measure(device, env.world_size) if config["limits"] else None
    result["device_name"] = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    return result


def report(result: dict, args, argv) -> int:
    """Print the tables, the summary and the limits' notes on stdout, write the requested files;
    return the exit code."""
    rows, found, reference = result["rows"], result["limits"], result["reference"]
    with_limit, with_spread = found is not None, args.rounds > 1
    add_limits(rows, reference)
    print(_env_line(result))
    print(f"# -b {args.minbytes} -e {args.maxbytes} -f {args.stepfactor} -n {args.iters} -w {args.warmup_iters} "
          f"-o {args.op} -d {args.datatype} --check {args.check} --rounds {args.rounds} --budget-ms {args.budget_ms:g}")
    print(f"# each cell: the median over {args.rounds} round(s) of the median of up to -n calls (the slowest rank's)"
          + ("; spread: half the range of the rounds, % of the median" if with_spread else ""))
    for note in getattr(args, "notes", []):
        print(note)
    if args.algorithm:
        print(f"# algorithm {args.algorithm}: collectives.algorithms over point-to-point messages, not the backend's own")
    if with_limit:
        print(f"# limits: memory copy {found['copy_gbps']:.2f} GB/s (read+write, one rank, 64 MiB); %limit = busbw / "
              "the reference's bandwidth at the same size (each table's header names it)")
    for backend in result["backends"]:
        for collective in dict.fromkeys(r["collective"] for r in rows):
            print(f"#\n# {collective}" + (f" on {backend}" if len(result["backends"]) > 1 else ""))
            if with_limit:
                print(limit_line(collective, reference_kind(backend, result["world_size"])))
            print(header(with_limit, with_spread))
            for row in rows:
                if row["collective"] == collective and row["backend"] == backend:
                    print(format_row(row, with_limit, with_spread))
    print(footer(rows))
    for line in faster_by_size(rows, result["backends"]) + (over_limit(rows, reference) if with_limit else []):
        print(line)
    environment = {
        "date": datetime.date.today().isoformat(), "torch": torch.__version__, "backend": " ".join(result["backends"]),
        "backends": result["backends"], "world_size": result["world_size"], "device": result["device"],
        "device_name": result["device_name"], "cpus": os.cpu_count(), "rounds": args.rounds,
        "command": cli.command_line("benchmarks.bandwidth", argv),
    }
    saved = {"environment": environment, "limits": found, "reference": reference, "rows": rows}
    if args.json:
        cli.write_json(args.json, saved)
    if args.csv:
        _write_csv(args.csv, rows)
    if args.plot:
        from .parts.busbw_plot import plot_results

        plot_results([saved], args.plot)
    wrong = sum((row[s] or {}).get("wrong") or 0 for row in rows for s in ("oop", "ip"))
    return 1 if wrong else 0


def _write_csv(path: str, rows) -> None:
    text = io.StringIO(newline="")
    writer = csv.writer(text)
    keys = ("time_us", "time_us_min", "time_us_max", "algbw", "busbw", "limit_pct", "wrong")
    writer.writerow(["backend", "collective", "size", "count", "type", "redop", "root"]
                    + [f"{s}_{k}" for s in ("oop", "ip") for k in keys])
    for row in rows:
        cells = [row[k] for k in ("backend", "collective", "size", "count", "type", "redop", "root")]
        for s in ("oop", "ip"):
            side = row[s] or {}
            cells += [side.get(k) for k in keys]
        writer.writerow(cells)
    cli.write_output(path, text.getvalue(), "--csv")


@command
def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    validate(args, parser)
    args.device = args.device or ("cuda" if "nccl" in args.backend else "cpu")
    if not args.backend:
        args.backend = ["gloo"] if args.device == "cpu" else [pick_backend(args.world_size)]
    config = {k: getattr(args, k) for k in ("collective", "minbytes", "maxbytes", "stepfactor", "iters",
                                            "warmup_iters", "op", "datatype", "check", "limits", "device", "algorithm",
                                            "rounds", "budget_ms")}
    config["backends"] = args.backend
    result = collectives.run_or_join(run_benchmark, args.world_size, backend=args.backend[0], args=(config,),
                                     timeout=args.timeout)
    if result is None:  # a torchrun/srun rank other than 0: rank 0 reports
        return 0
    return report(result, args, argv)


if __name__ == "__main__":
    sys.exit(main())
