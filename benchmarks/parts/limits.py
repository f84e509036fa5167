"""The machine's own limits, measured in the same run as the collectives (`--limits`).

- memory copy: one rank copies a large buffer; bandwidth counts bytes read plus bytes written.
- memory, all ranks at once (CPU): every rank copies at the same time; the bytes all of them read
  and write per second are the most this machine's memory moves for them together (the roofline
  benchmarks/studies/shm_paths.py holds shm's all_reduce against).
- point-to-point: rank 0 sends a large buffer to rank 1 over the same backend (send/recv); with
  Gloo on one machine this is TCP over loopback, the path every Gloo collective takes.

A collective's busbw divided by the point-to-point figure (or the copy figure on one rank) says
how far it is from what the machine can move. Called on every rank; rank 0's figures count.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def memory_copy_gbps(device: torch.device, nbytes: int = 64 << 20, iters: int = 10) -> float:
    """(read + write) bytes per second / 1e9 of one tensor copy on this rank's device."""
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(iters):
        _sync(device)
        start = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        times.append(time.perf_counter() - start)
    return 2 * nbytes / statistics.median(times) / 1e9


def aggregate_copy_gbps(nbytes: int = 64 << 20, reps: int = 4, trials: int = 5) -> float:
    """Bytes read plus written per second / 1e9 by all ranks copying CPU buffers at once, from the
    first rank's start to the last rank's end; the best of `trials` (a peak, as STREAM reports
    one: a slow trial was disturbed, a fast one was not). Every rank calls it; all get the same."""
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = 0.0
    for _ in range(trials):
        dist.barrier()
        start = time.perf_counter()  # CLOCK_MONOTONIC: one clock for every process of the machine
        for _ in range(reps):
            dst.copy_(src)
        span = torch.tensor([-start, time.perf_counter()], dtype=torch.float64)
        dist.all_reduce(span, op=dist.ReduceOp.MAX)  # minus the first start, and the last end
        best = max(best, dist.get_world_size() * reps * 2 * nbytes / span.sum().item() / 1e9)
    return best


def point_to_point_gbps(device: torch.device, nbytes: int = 64 << 20, iters: int = 5) -> float:
    """Bytes per second / 1e9 from rank 0 to rank 1 (send/recv); other ranks only wait.

    Gloo sends CPU tensors only: with a CUDA device on Gloo, the time includes the copies to and
    from host memory, as Gloo's collectives on CUDA tensors make them."""
    buf = torch.ones(nbytes, dtype=torch.uint8, device=device)
    staged = device.type == "cuda" and dist.get_backend() != "nccl"
    host = torch.empty(nbytes, dtype=torch.uint8) if staged else buf
    rank = dist.get_rank()
    times = []
    for i in range(iters + 1):  # the first is a warm-up
        dist.barrier()
        _sync(device)
        start = time.perf_counter()
        if rank == 0:
            if staged:
                host.copy_(buf)
            dist.send(host, dst=1)
        elif rank == 1:
            dist.recv(host, src=0)
            if staged:
                buf.copy_(host)
        _sync(device)
        elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
        if rank not in (0, 1):
            elapsed.zero_()
        if device.type == "cuda" and dist.get_backend() == "nccl":
            elapsed = elapsed.to(device)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the receiver's end is the transfer's end
        if i:
            times.append(elapsed.item())
    return nbytes / statistics.median(times) / 1e9


def measure(device: torch.device, world_size: int, nbytes: int = 64 << 20) -> dict:
    """{"copy_gbps", "p2p_gbps" (None on one rank), "nbytes"}, the same on every rank."""
    copy = memory_copy_gbps(device, nbytes)
    p2p = point_to_point_gbps(device, nbytes) if world_size >= 2 else None
    figures = torch.tensor([copy, p2p or 0.0], dtype=torch.float64)
    if device.type == "cuda" and dist.get_backend() == "nccl":
        figures = figures.to(device)
    dist.broadcast(figures, src=0)  # rank 0's copy figure, so every rank prints the same
    return {"copy_gbps": figures[0].item(), "p2p_gbps": p2p and figures[1].item(), "nbytes": nbytes}
