"""What the shm backend's flight record costs: recording on against off, side by side in one run.

    python -m benchmarks.studies.recorder_cost --world-size 2 [--rounds 41 --iters 300 --model small] [--json out.json]
    python -m benchmarks.studies.recorder_cost --backend gloo     # torch's own recorder on Gloo

Each rank holds two shm groups, one created with TORCH_FR_BUFFER_SIZE set (recording, as
collectives/shm/recorder.py does it) and one without; everything else is the same. Rounds
alternate between them in a random order the same on every rank, and each figure is the median
over rounds of the slowest rank:

- an 8-byte all_reduce (float64, one element), `--iters` calls per round: microseconds per call;
- a step of torch's DDP on the same model (`--model`, batch `--batch`), one per round per group.

On Gloo (--backend gloo) the recorder is torch's, one per process, sized once from
TORCH_FR_BUFFER_SIZE: two pools of ranks, one started with 2000 and one with 0, take turns in
the same random order, each turn `--iters` 8-byte all_reduces on its world (no DDP step).

What it decides: whether recording could be on by default, which would need at most 2% on the
8-byte all_reduce and nothing measurable on the DDP step (the spread of the off side's own rounds
says what is measurable).
"""

from __future__ import annotations

import os
import random
import statistics
import time

import torch
import torch.distributed as dist

import collectives
from collectives import cli
from collectives.shm import backend_of, new_group_with
from ddp_from_scratch.workload.models import MODELS

from ..parts.sweep import alternate_steps


def _group(recording: bool):
    """An shm group whose backend records (or not): the recorder is chosen when the group is made."""
    group = new_group_with({"TORCH_FR_BUFFER_SIZE": "2000" if recording else "0"})  # shm records unless told 0
    assert (backend_of(group).recorder is not None) == recording
    return group


def _slowest(seconds: float) -> float:
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)  # on the Gloo world, outside what is timed
    return t.item()


def measure(env, rounds: int, iters: int, model: str, batch: int) -> dict:
    groups = {"recording": _group(True), "off": _group(False)}
    order = random.Random(0)
    calls = {label: [] for label in groups}
    x = torch.ones(1, dtype=torch.float64)
    for i in range(rounds + 1):
        for label in order.sample(list(groups), 2):
            group = groups[label]
            dist.barrier(group=group)
            start = time.perf_counter()
            for _ in range(iters):
                dist.all_reduce(x, group=group)
            took = _slowest(time.perf_counter() - start)
            if i:  # the first round warms up
                calls[label].append(took / iters * 1e6)
    torch.manual_seed(0)
    net = MODELS[model]()
    models = {label: torch.nn.parallel.DistributedDataParallel(
        __import__("copy").deepcopy(net), process_group=g) for label, g in groups.items()}
    steps = alternate_steps(env, models, rounds=max(5, rounds // 4), batch=batch)
    return {"all_reduce_8B_us": calls, "ddp_step_s": steps}


def _gloo_turn(env, iters: int) -> float:
    x = torch.ones(1, dtype=torch.float64)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(x)
    return _slowest(time.perf_counter() - start) / iters * 1e6


def measure_gloo(world_size: int, rounds: int, iters: int) -> dict:
    """torch's recorder on Gloo against off: a pool of ranks each, alternated turn by turn."""
    from collectives.launcher.pool import RankPool

    pools = {}
    saved = os.environ.get("TORCH_FR_BUFFER_SIZE")
    try:
        for label, size in (("recording", "2000"), ("off", "0")):
            os.environ["TORCH_FR_BUFFER_SIZE"] = size  # the ranks read it as they start
            pools[label] = RankPool(world_size, backend="gloo").start()
    finally:
        os.environ.pop("TORCH_FR_BUFFER_SIZE") if saved is None else os.environ.update(TORCH_FR_BUFFER_SIZE=saved)
    order, calls = random.Random(0), {label: [] for label in pools}
    try:
        for i in range(rounds + 1):
            for label in order.sample(list(pools), 2):
                took = pools[label].submit(_gloo_turn, args=(iters,), timeout=600)[0]
                if i:
                    calls[label].append(took)
    finally:
        for pool in pools.values():
            pool.close()
    return {"all_reduce_8B_us": calls}


def summarise(raw: dict) -> dict:
    out = {}
    for key, per in raw.items():
        on, off = statistics.median(per["recording"]), statistics.median(per["off"])
        q = statistics.quantiles(per["off"], n=4)
        out[key] = {"recording": on, "off": off, "ratio": on / off, "off_iqr_fraction": (q[2] - q[0]) / off,
                    "rounds": len(per["off"])}
    return out


def report(summary: dict, world_size: int, backend: str = "shm") -> str:
    lines = [f"flight record on {backend}, {world_size} ranks, medians over rounds (slowest rank), recording against off:"]
    for key, unit in (("all_reduce_8B_us", "us per 8-byte all_reduce"), ("ddp_step_s", "s per DDP step")):
        if key not in summary:
            continue
        s = summary[key]
        lines.append(f"  {unit}: recording {s['recording']:.4g}, off {s['off']:.4g}, ratio {s['ratio']:.3f} "
                     f"(off's own interquartile spread: {s['off_iqr_fraction'] * 100:.1f}% of its median; "
                     f"{s['rounds']} rounds)")
    a = summary["all_reduce_8B_us"]["ratio"]
    lines.append(f"  recording adds {(a - 1) * 100:+.1f}% to an 8-byte all_reduce")
    return "\n".join(lines)


def build_parser():
    parser = cli.ArgumentParser(prog="python -m benchmarks.studies.recorder_cost", description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--backend", default="shm", choices=["shm", "gloo"],
                        help="whose recorder: the shm backend's (default) or torch's on Gloo")
    parser.add_argument("--rounds", type=int, default=41, help="rounds of alternation (default 41)")
    parser.add_argument("--iters", type=int, default=300, help="8-byte all_reduces per round and group (default 300)")
    parser.add_argument("--model", default="small", choices=sorted(MODELS), help="the DDP step's model (default small)")
    parser.add_argument("--batch", type=int, default=16, help="the DDP step's batch per rank (default 16)")
    parser.add_argument("--json", default=None, help="also write the raw rounds and the summary here")
    return parser


@cli.command
def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    cli.check_at_least(parser, args, {"--world-size": 2, "--rounds": 2, "--iters": 1, "--batch": 1})
    cli.check_outputs(parser, {"--json": args.json})
    if args.backend == "gloo":
        raw = measure_gloo(args.world_size, args.rounds, args.iters)
    else:
        raw = collectives.run(measure, args.world_size, backend="gloo",
                              args=(args.rounds, args.iters, args.model, args.batch), timeout=3600)[0]
    summary = summarise(raw)
    text = report(summary, args.world_size, args.backend)
    print(text)
    if args.json:
        cli.write_json(args.json, {"command": cli.command_line("benchmarks.studies.recorder_cost", argv),
                                   "summary": summary, "raw": raw})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
