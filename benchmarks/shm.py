"""The shared-memory backend against Gloo, side by side in one run.

    python -m benchmarks.shm --world-size 2 --json shm-2.json --plot shm-2.png
    python -m benchmarks.shm --world-size 4 --skip-ddp
    python -m benchmarks.shm --world-size 2 --only-ddp --rounds 21
    python -m benchmarks.shm --world-size 2 --only-ddp --rounds 21 --setting COLLECTIVES_SHM_WORKER_NICE=0

In one world of spawned ranks the default group is Gloo and a second group over the same ranks
is "shm" (collectives.shm): every call alternates between the two, each timed as the slowest
rank's, medians over iterations. Four parts:

1. all_reduce busbw on each, 8 B to 256 MiB, the ratio, and the machine's memory limits measured
   in the same run: one rank's copy, and the roofline (all ranks copying at once: the bytes
   they move together per second); from the bytes shm's all_reduce reads and writes
   (collectives.shm.python_path.all_reduce_traffic) the memory GB/s it reached and the speed-up over Gloo
   it would have at the roofline, the most this machine allows;
2. 8-byte all_reduce latency (dist.all_reduce, as a user calls it);
3. the shm waiting strategies (wait.py): latency and CPU seconds per 8-byte all_reduce;
4. torch's DDP on ResNet-50 (batch 32 per rank) on Gloo and on shm, alternated step by step,
   with two floors: DDP on a group whose all_reduce moves nothing (what DDP and a Python
   ProcessGroup cost without communication) and torch's no_sync (not even DDP's bucket copies);
   each --setting VAR=VALUE adds DDP on a shm group made with that setting.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import time

import torch
import torch.distributed as dist
from tabulate import tabulate
from torch import nn

import collectives
from collectives import cli, machine
from collectives.launcher.start_methods import TRAINING, preload
from collectives.cli import command
from collectives.shm import backend_of, new_group_with
from collectives.shm.config import parse_settings
from collectives.shm.python_path import SMALL_BYTES, all_reduce_traffic
from ddp_from_scratch.workload.resnet import resnet50

from .parts.sweep import alternate_calls, alternate_steps, check_sweep, parse_size, shm_setting, size_list, summarise
from .parts.limits import aggregate_copy_gbps, memory_copy_gbps
from .parts.nccl_format import bandwidths


def _bandwidth(groups, sizes, n):
    rows = []
    for nbytes in sizes:
        iters = 30 if nbytes <= 1 << 20 else 10 if nbytes <= 32 << 20 else 4
        numel = max(1, nbytes // 4)
        buffers = {id(g): torch.ones(numel) for g in groups}

        def call(group):
            buf = buffers[id(group)]
            return lambda: dist.all_reduce(buf, group=group)

        seconds = alternate_calls([call(g) for g in groups], iters, groups=groups)
        # each buffer was all-reduced 1 + iters times from ones: every element is n ** (1 + iters)
        ok = all(bool((b == float(n) ** (iters + 1)).all()) for b in buffers.values())
        rows.append({"size": numel * 4, "gloo_s": seconds[0], "shm_s": seconds[1], "check": ok,
                     "shm_path": backend_of(groups[1]).state.collectives.all_reduce_path(numel * 4),
                     "roofline_gbps": aggregate_copy_gbps(trials=1)})  # between sizes: the machine's state drifts
        if dist.get_rank() == 0:
            print(f"[all_reduce] {numel * 4} B done", file=sys.stderr, flush=True)
    return rows


def _latency_and_cpu(group, iters=400):
    """Median seconds of an 8-byte dist.all_reduce, and CPU seconds per call (this rank)."""
    x = torch.ones(2)
    dist.barrier()
    cpu0, times = time.process_time(), []
    for _ in range(iters):
        start = time.perf_counter()
        dist.all_reduce(x, group=group)
        times.append(time.perf_counter() - start)
    cpu = (time.process_time() - cpu0) / iters
    t = torch.tensor([statistics.median(times), cpu], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


FREE = "torch DDP, all_reduce moving nothing"


def free_all_reduce_group():
    """A new shm group (every rank calls it) whose all_reduce returns a finished Future at once
    and moves nothing; its other collectives work. torch's DDP on it costs what DDP's own work
    (every gradient copied into its buckets and back), torch's dispatch and the backend's Work
    cost without the communication: the floor for any backend under torch's DDP (no_sync skips
    DDP's copies too). On the native path (the default) the engine does it; on the Python path
    its all_reduce is replaced."""
    group = dist.new_group(backend="shm")
    impl = backend_of(group)
    if impl.state.engine is not None:
        impl.state.engine.moves_nothing = True
    else:
        impl.state.collectives.all_reduce = lambda flat, op: None
    return group


def _ddp(env, shm_group, rounds, batch, settings=()):
    free = free_all_reduce_group()
    others = {s: new_group_with(parse_settings(s)) for s in settings}  # a shm group each, made with it
    torch.manual_seed(0)
    models = {"torch DDP on gloo": nn.parallel.DistributedDataParallel(resnet50(num_classes=10)),
              "torch DDP on shm": nn.parallel.DistributedDataParallel(resnet50(num_classes=10), process_group=shm_group),
              **{f"torch DDP on shm, {s}": nn.parallel.DistributedDataParallel(resnet50(num_classes=10), process_group=g)
                 for s, g in others.items()},
              FREE: nn.parallel.DistributedDataParallel(resnet50(num_classes=10), process_group=free),
              "torch DDP, no_sync": nn.parallel.DistributedDataParallel(resnet50(num_classes=10))}
    return alternate_steps(env, models, rounds, batch)


def run_all(env, config):
    shm_group = dist.new_group(backend="shm")
    out = {"world_size": env.world_size}
    if not config["only_ddp"]:
        sizes = size_list(config["minbytes"], config["maxbytes"], config["stepfactor"])
        out["bandwidth"] = _bandwidth([None, shm_group], sizes, env.world_size)
        copy = torch.tensor([memory_copy_gbps(torch.device("cpu"))])
        dist.all_reduce(copy, op=dist.ReduceOp.MIN)
        out["copy_gbps"] = copy.item()
        out["roofline_gbps"] = max(row["roofline_gbps"] for row in out["bandwidth"])
        out["latency"] = {"gloo": _latency_and_cpu(None), "shm": _latency_and_cpu(shm_group)}
        strategies = {}
        for strategy in ("futex", "spin", "yield", "sleep"):  # a group each: the setting is read as it is made
            strategies[strategy] = _latency_and_cpu(new_group_with({"COLLECTIVES_SHM_WAIT": strategy}))
        out["strategies"] = strategies
    if not config["skip_ddp"]:
        if env.rank == 0:
            print("DDP step time ...", file=sys.stderr, flush=True)
        out["ddp"] = _ddp(env, shm_group, config["rounds"], config["batch_size"], config["settings"])
    return out


def report(result) -> str:
    n, lines = result["world_size"], []
    if "bandwidth" in result:
        table, roof = [], result.get("roofline_gbps")
        trials = [row.get("roofline_gbps", roof) for row in result["bandwidth"]]
        for row in result["bandwidth"]:
            _, bus_gloo = bandwidths(row["size"], row["gloo_s"] * 1e6, "all_reduce", n)
            _, bus_shm = bandwidths(row["size"], row["shm_s"] * 1e6, "all_reduce", n)
            table.append([row["size"], f"{row['gloo_s'] * 1e6:.1f}", f"{bus_gloo:.2f}", f"{row['shm_s'] * 1e6:.1f}",
                          f"{bus_shm:.2f}", f"{row['gloo_s'] / row['shm_s']:.2f}x"]
                         + (_roofline_cells(row, n, roof) if roof else []) + ["ok" if row["check"] else "WRONG"])
        lines.append(f"all_reduce on {n} ranks (float32), gloo and shm alternated; memory copy on this machine: "
                     f"{result['copy_gbps']:.2f} GB/s (read + write, one rank)"
                     + (f"; roofline: {roof:.1f} GB/s (read + write, all {n} ranks copying at once; the best of "
                        f"{len(trials)} trials, one after each size, which ranged {min(trials):.1f}-{max(trials):.1f})"
                        if roof else ""))
        lines.append(tabulate(table, headers=["bytes", "gloo us", "gloo busbw GB/s", "shm us", "shm busbw GB/s",
                                              "shm speed-up"] + (["shm memory GB/s", "at the roofline", "shm path"] if roof else [])
                              + ["result"], disable_numparse=True))
        if roof:
            lines.append("shm memory GB/s: the bytes all ranks read and write in one shm all_reduce (the model in "
                         "collectives.shm.python_path.all_reduce_traffic, by the path it took: copies through the segment in pieces, "
                         "or cma, cross-memory attach) over its time. At the roofline: Gloo's time over the least time those "
                         "bytes take at the roofline, the most shm could be faster here")
        lat = result["latency"]
        lines.append(f"\n8-byte dist.all_reduce, median of 400: gloo {lat['gloo'][0] * 1e6:.1f} us, "
                     f"shm {lat['shm'][0] * 1e6:.1f} us")
        lines.append("\nshm waiting strategies, 8-byte all_reduce: latency, and CPU seconds used per call by the "
                     "slowest rank (more than the latency: the rank burnt a core while waiting)")
        lines.append(tabulate([[k, f"{v[0] * 1e6:.1f}", f"{v[1] * 1e6:.1f}"] for k, v in result["strategies"].items()],
                              headers=["strategy", "latency us", "CPU us per call"], disable_numparse=True))
    if "ddp" in result:
        stats = summarise(result["ddp"], "torch DDP on gloo")
        above = _above_the_floor(result["ddp"]) if FREE in result["ddp"] else {}
        lines.append(f"\ntorch's DDP, ResNet-50, {n} ranks: seconds per step (median), and the median of the "
                     "per-round ratios to DDP on gloo with quartiles; above the floor: the median, with quartiles, "
                     "of each round's (step - the floor's step) / DDP on gloo's step")
        lines.append(tabulate([[k, f"{v['median_s']:.3f}", f"{v['ratio']:.3f} ({v['ratio_q1']:.3f}-{v['ratio_q3']:.3f})"]
                               + ([_cell(above[k])] if above else [])
                               for k, v in stats.items()],
                              headers=["variant", "s / step", "/ DDP on gloo"] + (["above the floor"] if above else []),
                              disable_numparse=True))
    return "\n".join(lines)


def _above_the_floor(times) -> dict:
    """Per variant: the median and quartiles of (its step - the floor's step) / Gloo's step, round
    by round (the three stepped back to back), so a slow spell moves all three together."""
    out = {}
    for label, ts in times.items():
        gaps = [(t - f) / g for t, f, g in zip(ts, times[FREE], times["torch DDP on gloo"])]
        q1, _, q3 = statistics.quantiles(gaps, n=4) if len(gaps) > 1 else (gaps[0],) * 3
        out[label] = (statistics.median(gaps), q1, q3)
    return out


def _cell(gap) -> str:
    return f"{gap[0]:.3f} ({gap[1]:.3f}-{gap[2]:.3f})"


def _path(row) -> str:
    """The path shm's all_reduce took for this row (results written before paths were recorded: pieces)."""
    return row.get("shm_path") or ("small" if row["size"] <= SMALL_BYTES else "pieces")


def _roofline_cells(row, n: int, roof: float) -> list:
    path = _path(row)
    if path == "small":  # every rank adds every slot: another model
        return ["", "", path]
    moved = n * all_reduce_traffic(row["size"], n, path)
    return [f"{moved / row['shm_s'] / 1e9:.1f}", f"{row['gloo_s'] / (moved / (roof * 1e9)):.2f}x", path]


def plot(result, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, n = result["bandwidth"], result["world_size"]
    sizes = [r["size"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4))
    for key, label in (("gloo_s", "gloo"), ("shm_s", "shm")):
        ax.plot(sizes, [bandwidths(r["size"], r[key] * 1e6, "all_reduce", n)[1] for r in rows], "-o", ms=3, label=label)
    ax.plot(sizes, [3 * bandwidths(r["size"], r["gloo_s"] * 1e6, "all_reduce", n)[1] for r in rows], "-", color="C0",
            alpha=0.3, lw=1, label="3 x gloo")
    ax.axhline(result["copy_gbps"] / 2, color="gray", linestyle="--", lw=1,
               label=f"one rank's memory copy / 2 ({result['copy_gbps'] / 2:.1f} GB/s)")
    if result.get("roofline_gbps"):  # shm's busbw if it moved its bytes at the roofline
        big = [r for r in rows if _path(r) != "small"]
        best = [n * all_reduce_traffic(r["size"], n, _path(r)) / (result["roofline_gbps"] * 1e9) for r in big]
        ax.plot([r["size"] for r in big], [bandwidths(r["size"], t * 1e6, "all_reduce", n)[1] for r, t in zip(big, best)],
                ":", color="black", lw=1, label="shm at the roofline (its bytes at all ranks' memory bandwidth)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("bytes")
    ax.set_ylabel("all_reduce busbw (GB/s)")
    ax.set_title(f"all_reduce, {n} ranks on one machine: shm against gloo")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    cli.save_figure(fig, path, dpi=110)
    plt.close(fig)


def build_parser() -> argparse.ArgumentParser:
    parser = cli.ArgumentParser(prog="python -m benchmarks.shm", description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, default=2, help="ranks to spawn")
    parser.add_argument("-b", "--minbytes", type=parse_size, default=parse_size("8"), help="smallest size, bytes")
    parser.add_argument("-e", "--maxbytes", type=parse_size, default=parse_size("256M"), help="largest size, bytes")
    parser.add_argument("-f", "--stepfactor", type=int, default=4, help="multiply the size by this each step")
    parser.add_argument("--rounds", type=int, default=11, help="DDP: timed steps per variant")
    parser.add_argument("--batch-size", type=int, default=32, help="DDP: images per rank")
    parser.add_argument("--skip-ddp", action="store_true", help="only the collectives")
    parser.add_argument("--only-ddp", action="store_true", help="only the DDP step time")
    parser.add_argument("--setting", action="append", default=[], metavar="VAR=VALUE", type=shm_setting,
                        help="DDP: also time torch's DDP on a shm group made with this COLLECTIVES_SHM_* setting "
                             "(repeatable; A=1,B=2 for one group with both)")
    parser.add_argument("--json", metavar="FILE", help="write every measurement as JSON")
    parser.add_argument("--plot", metavar="FILE.png", help="busbw against size, gloo and shm")
    return parser


@command
def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    cli.check_outputs(parser, {"--json": args.json, "--plot": args.plot})
    if args.world_size < 2 or args.rounds < 1 or args.batch_size < 2:
        parser.error("need --world-size >= 2, --rounds >= 1 and --batch-size >= 2")
    if args.skip_ddp and args.only_ddp:
        parser.error("--skip-ddp and --only-ddp leave nothing to do")
    check_sweep(args, parser)
    config = {k: getattr(args, k) for k in ("minbytes", "maxbytes", "stepfactor", "rounds", "batch_size", "skip_ddp",
                                            "only_ddp")}
    config["settings"] = list(dict.fromkeys(args.setting))
    if not args.skip_ddp:
        preload(*TRAINING)  # the DDP ranks build optimizers: the fork server imports what that needs, once
    result = collectives.run(run_all, args.world_size, args=(config,), timeout=6 * 3600)[0]
    print(f"# python -m benchmarks.shm {' '.join(argv)}")
    print(f"# {datetime.date.today().isoformat()}, torch {torch.__version__}, {machine.cpus()} cpus, one thread per rank")
    print(report(result))
    if args.json:
        cli.write_json(args.json, {**result, "command": cli.command_line("benchmarks.shm", argv)})
    if args.plot and "bandwidth" in result:
        plot(result, args.plot)
    bad = [r["size"] for r in result.get("bandwidth", []) if not r["check"]]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
