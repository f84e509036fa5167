"""What the benchmark programs share: the size sweep's flags (-b, -e, -f, -d), timing calls or
training steps alternated in one run, and the medians and ratios of what was timed.

    sizes = size_list(args.minbytes, args.maxbytes, args.stepfactor)   # after check_sweep(args, parser)
    seconds = alternate_calls([run_a, run_b], iters=20)               # medians of the slowest rank
    times = alternate_steps(env, {"torch": ddp, "ours": mine}, rounds=21, batch=32)

A program imports these, never another program.
"""

from __future__ import annotations

import argparse
import contextlib
import random
import re
import statistics
import time
from typing import Callable, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from collectives import cli
from collectives.shm.config import parse_settings

from .nccl_format import TYPE_NAMES

DTYPES = {name: getattr(torch, name) for name in TYPE_NAMES}


def parse_size(text: str) -> int:
    """'8', '64K', '16M', '1G' -> bytes (binary multiples, as nccl-tests)."""
    match = re.fullmatch(r"\s*(\d+)\s*([KMG]?)B?\s*", text.upper())
    if not match:
        raise argparse.ArgumentTypeError(f"size {text!r} is not a number with an optional K, M or G suffix")
    return int(match.group(1)) << {"": 0, "K": 10, "M": 20, "G": 30}[match.group(2)]


def shm_setting(text: str) -> str:
    """argparse type of --setting: 'COLLECTIVES_SHM_<NAME>=<value>' (several for one group: comma
    between them), checked as the shm backend reads it."""
    try:
        parse_settings(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def size_list(begin: int, end: int, factor: int, with_end: bool = False) -> list:
    """begin, begin x factor, ... up to end; with_end: end too, where the steps pass it by."""
    if begin < 1 or factor < 2:  # check_sweep refuses these first; a sweep that never ends must not start
        raise ValueError(f"a size sweep needs begin >= 1 and factor >= 2, got begin {begin}, factor {factor}")
    sizes, size = [], begin
    while size <= end:
        sizes.append(size)
        size *= factor
    if with_end and (not sizes or sizes[-1] != end):
        sizes.append(end)
    return sizes


SWEEP_BUFFERS = 4  # tensors of -e bytes a rank may hold at the largest size


def check_sweep(args, parser) -> None:
    """-b, -e and -f as every benchmark's size sweep takes them: 1 <= -b <= -e, -f >= 2 (a step
    factor of 1 never reaches -e), and -e small enough for every rank's buffers to fit in memory."""
    if args.minbytes < 1 or args.maxbytes < args.minbytes:
        parser.error(f"-b {args.minbytes} must be at least 1 and at most -e {args.maxbytes}")
    if args.stepfactor < 2:
        parser.error(f"-f {args.stepfactor}: the step factor must be at least 2")
    ranks = getattr(args, "world_size", 1)
    on_gpu = getattr(args, "device", None) == "cuda" or getattr(args, "backend", None) == "nccl"
    if not on_gpu and isinstance(ranks, int) and ranks >= 1:
        # Input, output, the expected result and the backend's scratch: all ranks' in this machine's
        # memory. (GPU memory is per device, and torch's out-of-memory error there names it.)
        cli.check_memory(parser, "-e", ranks * SWEEP_BUFFERS * args.maxbytes,
                         f"{ranks} rank(s) x {SWEEP_BUFFERS} buffers of {cli.format_bytes(args.maxbytes)}")


def alternate_calls(runs: Sequence[Callable[[], None]], iters: int, groups: Optional[Sequence] = None,
                    idle: float = 0.0) -> List[float]:
    """Median of the slowest rank's seconds per call, for each run, the runs alternated call by
    call after one warm-up call each. Each call starts after a barrier (on groups[k] when given:
    each backend's own way to line its ranks up; else the world's) and `idle` seconds more (for a
    shaped link's token bucket to refill)."""
    for run in runs:  # warm-up
        run()
    times = torch.zeros(len(runs), iters, dtype=torch.float64)
    for i in range(iters):
        for k, run in enumerate(runs):
            dist.barrier(group=groups[k] if groups is not None else None)
            if idle:
                time.sleep(idle)
            start = time.perf_counter()
            run()
            times[k, i] = time.perf_counter() - start
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    return [statistics.median(row.tolist()) for row in times]


def alternate_steps(env, models: Dict[str, nn.Module], rounds: int, batch: int, amp: bool = False,
                    opts: Optional[Dict] = None):
    """Train each model one step per round, in a random order the same on every rank; a label
    ending in "no_sync" trains under model.no_sync(). Returns {label: [slowest rank's seconds
    per step]}. The first round only warms up (and lets DDP rebuild its buckets). `opts`: an
    optimizer per label where it is not SGD over model.parameters() (the sharded steps' own)."""
    opts = {label: (opts or {}).get(label) or torch.optim.SGD(m.parameters(), lr=0.001, momentum=0.9)
            for label, m in models.items()}
    g = torch.Generator().manual_seed(env.rank)
    x, y = torch.randn(batch, 3, 32, 32, generator=g), torch.randint(0, 10, (batch,), generator=g)
    labels = list(models)
    times = {label: [] for label in labels}
    order = random.Random(0)  # the same order on every rank
    for i in range(rounds + 1):
        for label in order.sample(labels, len(labels)):
            model, opt = models[label], opts[label]
            no_sync = model.no_sync() if label.endswith("no_sync") else contextlib.nullcontext()
            dist.barrier()
            start = time.perf_counter()
            with no_sync:
                opt.zero_grad()
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
                    loss = F.cross_entropy(model(x), y)
                loss.backward()
            opt.step()
            elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            if i:
                times[label].append(elapsed.item())
    return times


def summarise(times: Dict[str, List[float]], reference: str) -> Dict[str, Dict[str, float]]:
    """Per variant: median seconds, and the median and quartiles of its per-round ratio to `reference`.

    Ratios are taken within a round (the two steps ran back to back), so a slow spell of the
    machine moves both sides of a ratio together.
    """
    out = {}
    for label, ts in times.items():
        ratios = [t / r for t, r in zip(ts, times[reference])]
        q1, _, q3 = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else (ratios[0],) * 3
        out[label] = {"median_s": statistics.median(ts), "ratio": statistics.median(ratios), "ratio_q1": q1,
                      "ratio_q3": q3, "steps": ts}
    return out
