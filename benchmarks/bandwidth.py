"""Collective bandwidth in nccl-tests' format, on Gloo or NCCL, with a correctness count.

    python -m benchmarks.bandwidth --world-size 2 -b 8 -e 64M -f 2 --limits --plot busbw.png
    python -m benchmarks.bandwidth --world-size 4 -c all -b 1K -e 256M --json run.json
    torchrun --nproc_per_node=8 -m benchmarks.bandwidth -c all_reduce -b 8 -e 8G --device cuda
    srun -N2 --ntasks-per-node=8 python -m benchmarks.bandwidth -c all -b 8 -e 1G --device cuda

Started plainly it spawns --world-size ranks; under torchrun or srun it uses theirs. The table
(stdout) has nccl-tests' columns for out-of-place and in-place; torch.distributed has no
out-of-place all_reduce, broadcast or reduce and no in-place all_to_all, so those columns read
N/A. Timing: warm-up, then per iteration a barrier (and a device sync), the call, and the
slowest rank's time; the median over iterations. #wrong is a separate run on data whose result
is exact in any order, counted over all ranks; any wrong element makes the exit code 1.
The timed calls are raw torch.distributed (the backend's own speed); benchmarks/wrapper_overhead.py
measures what the checked wrappers add.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import os
import platform
import statistics
import sys
import time

import torch
import torch.distributed as dist

import collectives
from collectives import cli
from collectives.cli import command, eta_by_size
from collectives.names import REDUCING, ROOTED

from . import limits as machine_limits
from .cases import OPS, buffer_count, count_wrong, make_algorithm_case, make_case, sync_device
from .nccl_format import TYPE_NAMES, bandwidths, footer, format_row, header
from .sweep import DTYPES, check_sweep, parse_size, size_list

COLLECTIVES = ["all_reduce", "broadcast", "reduce", "all_gather", "reduce_scatter", "all_to_all"]


def build_parser() -> argparse.ArgumentParser:
    p = cli.ArgumentParser(prog="python -m benchmarks.bandwidth", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("-c", "--collective", nargs="+", default=["all_reduce"], choices=COLLECTIVES + ["all"],
                   help="collectives to run ('all' runs each)")
    p.add_argument("-b", "--minbytes", type=parse_size, default=parse_size("8"), help="smallest size, bytes (K/M/G)")
    p.add_argument("-e", "--maxbytes", type=parse_size, default=parse_size("64M"), help="largest size, bytes (K/M/G)")
    p.add_argument("-f", "--stepfactor", type=int, default=2, help="multiply the size by this each step")
    p.add_argument("-n", "--iters", type=int, default=20, help="timed iterations per size")
    p.add_argument("-w", "--warmup_iters", type=int, default=5, help="warm-up iterations per size")
    p.add_argument("-o", "--op", default="sum", choices=list(OPS), help="reduction op")
    p.add_argument("-d", "--datatype", default="float32", choices=list(DTYPES), help="element type")
    p.add_argument("--backend", choices=["gloo", "nccl"], help="default: nccl with one GPU per rank on cuda, else gloo")
    p.add_argument("--device", choices=["cpu", "cuda"], help="where the buffers live (default: cuda with nccl, else cpu)")
    p.add_argument("--check", type=int, default=1, choices=[0, 1], help="count wrong elements (#wrong)")
    p.add_argument("--world-size", type=int, default=2, help="ranks to spawn when not under torchrun/srun")
    p.add_argument("--limits", action="store_true", help="also measure memory copy and point-to-point bandwidth")
    p.add_argument("--json", metavar="FILE", help="write every row and the environment as JSON")
    p.add_argument("--csv", metavar="FILE", help="write every row as CSV")
    p.add_argument("--plot", metavar="FILE.png", help="draw busbw against size per collective")
    p.add_argument("--timeout", type=float, default=3600, help="seconds before a hung run is stopped (spawn mode)")
    p.add_argument("--algorithm", default=None,
                   help="time a from-scratch algorithm (collectives.algorithms: ring, recursive_doubling, bruck, ...) "
                        "instead of the backend's own; collectives without it are skipped")
    return p


def validate(args, parser) -> None:
    """Refuse nonsense with a message naming the flag, before any rank starts."""
    check_sweep(args, parser)
    if args.iters < 1 or args.warmup_iters < 0:
        parser.error("-n must be at least 1 and -w at least 0")
    if args.world_size < 1:
        parser.error("--world-size must be at least 1")
    dtype = DTYPES[args.datatype]
    if args.op == "avg" and not dtype.is_floating_point:
        parser.error(f"-o avg needs a floating -d, not {args.datatype} (the average of integers would round)")
    if args.device == "cuda" or args.backend == "nccl":
        if not torch.cuda.is_available():
            parser.error("--device cuda / --backend nccl need a CUDA device, and none is available here")
    if args.backend == "nccl" and args.device == "cpu":
        parser.error("--backend nccl moves CUDA tensors only; use --device cuda or --backend gloo")
    if "all" in args.collective:
        args.collective = list(COLLECTIVES)
    if args.algorithm:
        import collectives.algorithms as A

        having = [c for c in args.collective if args.algorithm in A.ALGORITHMS.get(c, {})]
        if not having:
            known = sorted({a for algos in A.ALGORITHMS.values() for a in algos})
            parser.error(f"--algorithm {args.algorithm}: none of {', '.join(args.collective)} has it "
                         f"(algorithms: {', '.join(known)})")
        args.collective = having
    cli.check_outputs(parser, {"--json": args.json, "--csv": args.csv, "--plot": args.plot})


# -- one collective, one side (out-of-place or in-place) --------------------------------------------



def time_us(run, warmup: int, iters: int, device, reduce_device) -> float:
    """Median over iterations of the slowest rank's time for one call, in microseconds."""
    for _ in range(warmup):
        run()
    times = torch.zeros(iters, dtype=torch.float64)
    for i in range(iters):
        dist.barrier()
        sync_device(device)
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run()
            end.record()
            end.synchronize()
            times[i] = start.elapsed_time(end) / 1e3
        else:
            start_s = time.perf_counter()
            run()
            times[i] = time.perf_counter() - start_s
    times = times.to(reduce_device)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    return statistics.median(times.cpu().tolist()) * 1e6




def run_benchmark(env, config: dict) -> dict:
    """On every rank: measure every (collective, size); return the rows and the limits."""
    device = torch.device(config["device"], env.local_rank % max(1, torch.cuda.device_count())) \
        if config["device"] == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    reduce_device = device if env.backend == "nccl" else torch.device("cpu")
    dtype, n, r = DTYPES[config["datatype"]], env.world_size, env.rank
    found = machine_limits.measure(device, n) if config["limits"] else None
    limit = found and (found["p2p_gbps"] or found["copy_gbps"])
    sizes = size_list(config["minbytes"], config["maxbytes"], config["stepfactor"])
    rows = []
    timed = []  # (bytes, seconds) per size done, for the time left (latency + bytes / bandwidth)
    for c_index, collective in enumerate(config["collective"]):
        for k, nbytes in enumerate(sizes):
            started = time.perf_counter()
            count = buffer_count(collective, nbytes, n, dtype.itemsize)
            row = {"collective": collective, "size": count * dtype.itemsize, "count": count,
                   "type": TYPE_NAMES[config["datatype"]], "redop": config["op"] if collective in REDUCING else "none",
                   "root": 0 if collective in ROOTED else -1}
            algorithm_case = None
            if config.get("algorithm"):
                algorithm_case = make_algorithm_case(collective, config["algorithm"], count, n, r, config["op"], dtype,
                                                     device)
            for side in ("oop", "ip"):
                if config.get("algorithm"):
                    case = algorithm_case[1:] if algorithm_case and algorithm_case[0] == side else None
                else:
                    case = make_case(collective, side, count, n, r, config["op"], dtype, device)
                if case is None:
                    row[side] = None
                    continue
                t = time_us(case[0], config["warmup_iters"], config["iters"], device, reduce_device)
                algbw, busbw = bandwidths(row["size"], t, collective, n)
                row[side] = {"time_us": t, "algbw": algbw, "busbw": busbw,
                             "limit_pct": 100 * busbw / limit if limit else None,
                             "wrong": count_wrong(case, reduce_device) if config["check"] else None}
                del case
            rows.append(row)
            timed.append((nbytes, time.perf_counter() - started))
            if r == 0:
                left = eta_by_size(timed, sizes[k + 1:] + sizes * (len(config["collective"]) - c_index - 1))
                print(f"[{collective}] {row['size']} B done ({k + 1}/{len(sizes)}) {left}".rstrip(), file=sys.stderr,
                      flush=True)
    return {"rows": rows, "limits": found, "backend": env.backend, "world_size": n, "device": str(device),
            "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"}


def report(result: dict, args, argv) -> int:
    """Print the table(s) and footer on stdout, write the requested files; return the exit code."""
    rows, found, with_limit = result["rows"], result["limits"], result["limits"] is not None
    print(f"# collectives-playground benchmark: backend {result['backend']}, world size {result['world_size']}, "
          f"device {result['device']} ({result['device_name']}), torch {torch.__version__}")
    print(f"# -b {args.minbytes} -e {args.maxbytes} -f {args.stepfactor} -n {args.iters} -w {args.warmup_iters} "
          f"-o {args.op} -d {args.datatype} --check {args.check}")
    if args.algorithm:
        print(f"# algorithm {args.algorithm}: collectives.algorithms over point-to-point messages, not the backend's own")
    if with_limit:
        p2p = f"{found['p2p_gbps']:.2f} GB/s" if found["p2p_gbps"] else "N/A (one rank)"
        print(f"# limits: memory copy {found['copy_gbps']:.2f} GB/s (read+write, one rank); point-to-point {p2p} "
              f"(rank 0 -> 1, {found['nbytes'] >> 20} MiB); %limit = busbw / "
              f"{'point-to-point' if found['p2p_gbps'] else 'memory copy'}")
    for collective in dict.fromkeys(r["collective"] for r in rows):
        print(f"#\n# {collective}")
        print(header(with_limit))
        for row in rows:
            if row["collective"] == collective:
                print(format_row(row, with_limit))
    print(footer(rows))
    environment = {
        "date": datetime.date.today().isoformat(), "torch": torch.__version__, "backend": result["backend"],
        "world_size": result["world_size"], "device": result["device"], "device_name": result["device_name"],
        "cpus": os.cpu_count(), "command": "python -m benchmarks.bandwidth " + " ".join(argv),
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"environment": environment, "limits": found, "rows": rows}, f, indent=1)
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["collective", "size", "count", "type", "redop", "root"]
                            + [f"{s}_{k}" for s in ("oop", "ip") for k in ("time_us", "algbw", "busbw", "limit_pct", "wrong")])
            for row in rows:
                cells = [row[k] for k in ("collective", "size", "count", "type", "redop", "root")]
                for s in ("oop", "ip"):
                    side = row[s] or {}
                    cells += [side.get(k) for k in ("time_us", "algbw", "busbw", "limit_pct", "wrong")]
                writer.writerow(cells)
    if args.plot:
        from .busbw_plot import plot_results

        plot_results([{"environment": environment, "limits": found, "rows": rows}], args.plot)
    wrong = sum((row[s] or {}).get("wrong") or 0 for row in rows for s in ("oop", "ip"))
    return 1 if wrong else 0


@command
def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    validate(args, parser)
    args.device = args.device or ("cuda" if args.backend == "nccl" else "cpu")
    config = {k: getattr(args, k) for k in ("collective", "minbytes", "maxbytes", "stepfactor", "iters",
                                            "warmup_iters", "op", "datatype", "check", "limits", "device", "algorithm")}
    backend = args.backend or ("gloo" if args.device == "cpu" else None)
    result = collectives.run_or_join(run_benchmark, args.world_size, backend=backend, args=(config,),
                                     timeout=args.timeout)
    if result is None:  # a torchrun/srun rank other than 0: rank 0 reports
        return 0
    return report(result, args, argv)


if __name__ == "__main__":
    sys.exit(main())
