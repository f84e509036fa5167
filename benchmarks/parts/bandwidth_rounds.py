"""The bandwidth sweep as the ranks run it: in rounds, the cells of each round in a shuffled order,
the backends alternated within every cell, and a point-to-point reference at every size.

    result = run_rounds(env, config)          # on every rank; rank 0's result is the run's

A cell is (collective, size); within a cell each backend in turn (first one way, next round the
other) times each side (out-of-place, in-place): a warm-up call, then up to -n timed calls, fewer
where they would take longer than the cell's budget, each after a barrier on that backend's group,
each the slowest rank's time; the cell's time in that round is their median. The reference is a
cell of its own: rank 0 sends the size's bytes to rank 1, or (shm, whose collectives move data
through memory, or one rank) copies them.
Every rank draws the same shuffles (one seed), so the ranks call the same collectives in the same
order. #wrong is counted once per backend, collective, side and size, after the first round.
"""

from __future__ import annotations

import random
import statistics
import sys
import time
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from collectives.cli import format_seconds
from collectives.names import REDUCING, ROOTED

from .cases import buffer_count, count_wrong, make_algorithm_case, make_case, sync_device
from .nccl_format import SIDES, TYPE_NAMES, bandwidths
from .sweep import DTYPES, size_list

REFERENCE = "reference"  # the cell that times the reference


def _slowest(seconds: torch.Tensor, reduce_device) -> torch.Tensor:
    seconds = seconds.to(reduce_device)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    return seconds.cpu()


def time_cell(run, group, device, reduce_device, warmup: int, iters: int, budget_s: float) -> List[float]:
    """The slowest rank's seconds for each timed call of `run`: `warmup` calls, then as many of
    `iters` as fit in budget_s at the slowest rank's warm-up pace (at least one; the same count
    on every rank, so that they make the same calls)."""
    start = time.perf_counter()
    for _ in range(max(1, warmup)):
        run()
    sync_device(device)
    pace = _slowest(torch.tensor([(time.perf_counter() - start) / max(1, warmup)], dtype=torch.float64),
                    reduce_device).item()
    count = max(1, min(iters, int(budget_s / pace) if pace > 0 else iters))
    times = torch.zeros(count, dtype=torch.float64)
    for i in range(count):
        dist.barrier(group=group)
        sync_device(device)
        start = time.perf_counter()
        run()
        sync_device(device)
        times[i] = time.perf_counter() - start
    return _slowest(times, reduce_device).tolist()


def reference_kind(backend: str, world_size: int) -> str:
    """What bounds a backend's busbw: a point-to-point message between two ranks, or where the
    data moves through memory (shm, or one rank) one memory copy of the same size."""
    return "copy" if backend == "shm" or world_size == 1 else "point-to-point"


def _reference_run(backend: str, nbytes: int, rank: int, world_size: int, group, device):
    """One reference transfer of nbytes: rank 0 -> rank 1 over the group, or rank 0's copy."""
    buf = torch.ones(nbytes, dtype=torch.uint8, device=device)
    if reference_kind(backend, world_size) == "copy":
        out = torch.empty_like(buf)
        return (lambda: out.copy_(buf)) if rank == 0 else (lambda: None)
    if rank == 0:
        return lambda: dist.send(buf, dst=1, group=group)
    if rank == 1:
        return lambda: dist.recv(buf, src=0, group=group)
    return lambda: None


def _groups(env, backends: List[str]) -> Dict[str, Optional[dist.ProcessGroup]]:
    """Each backend's group over every rank: the world's for its own backend, a new one for the rest."""
    groups = {}
    for backend in backends:
        if backend == "shm":
            import collectives.shm  # noqa: F401 - registers the backend with torch.distributed
        groups[backend] = None if backend == env.backend else dist.new_group(backend=backend)
    return groups


def run_rounds(env, config: dict) -> dict:
    """On every rank: every round of the sweep; the rows (one per backend, collective and size,
    each side with every round's time) and the reference per backend and size."""
    device = torch.device(config["device"], env.local_rank % max(1, torch.cuda.device_count())) \
        if config["device"] == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    reduce_device = device if env.backend == "nccl" else torch.device("cpu")
    dtype, n, r = DTYPES[config["datatype"]], env.world_size, env.rank
    backends = config["backends"]
    groups = _groups(env, backends)
    sizes = size_list(config["minbytes"], config["maxbytes"], config["stepfactor"])
    cells = [(c, s) for c in config["collective"] for s in sizes]
    if config["limits"]:
        cells += [(REFERENCE, s) for s in sizes]
    rows = {}
    for backend in backends:
        for collective in config["collective"]:
            for nbytes in sizes:
                count = buffer_count(collective, nbytes, n, dtype.itemsize)
                rows[backend, collective, nbytes] = {
                    "backend": backend, "collective": collective, "requested": nbytes, "size": count * dtype.itemsize,
                    "count": count,
                    "type": TYPE_NAMES[config["datatype"]], "redop": config["op"] if collective in REDUCING else "none",
                    "root": 0 if collective in ROOTED else -1, "oop": None, "ip": None}
    reference = {(b, s): [] for b in backends for s in sizes} if config["limits"] else {}
    shuffle = random.Random(config.get("seed", 0))  # the same on every rank
    started, total = time.perf_counter(), config["rounds"] * len(cells)
    for k in range(config["rounds"]):
        order = shuffle.sample(cells, len(cells))
        for i, (collective, nbytes) in enumerate(order):
            for backend in (backends if k % 2 == 0 else backends[::-1]):
                _time_one(config, backend, groups[backend], collective, nbytes, rows, reference, device,
                          reduce_device, dtype, n, r, check=k == 0)
            done = k * len(cells) + i + 1
            if r == 0 and (i + 1 == len(order) or done % max(1, len(cells) // 4) == 0):
                elapsed = time.perf_counter() - started
                left = elapsed / done * (total - done)
                print(f"[round {k + 1}/{config['rounds']}] {i + 1}/{len(order)} cells, "
                      f"~{format_seconds(left)} left" if done < total else
                      f"[round {k + 1}/{config['rounds']}] done", file=sys.stderr, flush=True)
    return {"rows": [_summarised(row, n) for row in rows.values()],
            "reference": [{"backend": b, "kind": reference_kind(b, n), "size": s, "rounds_us": [t * 1e6 for t in ts],
                           "time_us": statistics.median(ts) * 1e6, "gbps": s / statistics.median(ts) / 1e9}
                          for (b, s), ts in reference.items()],
            "backends": backends, "world_size": n, "device": str(device)}


def _time_one(config, backend, group, collective, nbytes, rows, reference, device, reduce_device, dtype, n, r,
              check: bool) -> None:
    """One backend's turn at one cell: each side of the collective, or the reference."""
    budget = config["budget_ms"] / 1e3
    if collective == REFERENCE:
        run = _reference_run(backend, nbytes, r, n, group, device)
        times = time_cell(run, group, device, reduce_device, config["warmup_iters"], config["iters"], budget)
        reference[backend, nbytes].append(statistics.median(times))
        return
    row = rows[backend, collective, nbytes]
    algorithm_case = None
    if config.get("algorithm"):
        algorithm_case = make_algorithm_case(collective, config["algorithm"], row["count"], n, r, config["op"], dtype,
                                             device)
    for side in SIDES:
        if config.get("algorithm"):
            case = algorithm_case[1:] if algorithm_case and algorithm_case[0] == side else None
        else:
            case = make_case(collective, side, row["count"], n, r, config["op"], dtype, device, group=group)
        if case is None:
            continue
        times = time_cell(case[0], group, device, reduce_device, config["warmup_iters"], config["iters"], budget)
        cell = row[side] or {"rounds_us": [], "iters": [], "wrong": None}
        cell["rounds_us"].append(statistics.median(times) * 1e6)
        cell["iters"].append(len(times))
        if check and config["check"]:
            cell["wrong"] = count_wrong(case, reduce_device)
        row[side] = cell
        del case


def _summarised(row: dict, n: int) -> dict:
    """A row with each side's median over rounds, its bandwidths and its spread (min, max)."""
    for side in SIDES:
        cell = row[side]
        if cell is None:
            continue
        t = statistics.median(cell["rounds_us"])
        algbw, busbw = bandwidths(row["size"], t, row["collective"], n)
        cell.update(time_us=t, algbw=algbw, busbw=busbw, time_us_min=min(cell["rounds_us"]),
                    time_us_max=max(cell["rounds_us"]))
    return row
