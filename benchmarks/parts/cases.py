"""The benchmarks' test cases: each rank's input, the exact expected result, and the count of
wrong elements, per collective (nccl-tests' data check). benchmarks/bandwidth.py times them,
benchmarks/algorithms.py races the from-scratch algorithms on them.

    run, refill, expected = make_case("all_reduce", "ip", count, world_size, rank, "sum", torch.float32, device)

Inputs are small integers chosen so that any order of reduction gives the same, exactly
representable result; count_wrong compares with that result after a run.
"""

from __future__ import annotations

from typing import List

import torch
import torch.distributed as dist

from collectives import compat
from collectives.names import IN_PLACE, PER_RANK_CHUNKS

OPS = {"sum": dist.ReduceOp.SUM, "prod": dist.ReduceOp.PRODUCT, "max": dist.ReduceOp.MAX,
       "min": dist.ReduceOp.MIN, "avg": dist.ReduceOp.AVG}


def sync_device(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def buffer_count(collective: str, nbytes: int, n: int, itemsize: int) -> int:
    """Elements of nccl-tests' buffer for a requested size: the full buffer per rank (all_gather:
    the gathered output; reduce_scatter: the input; all_to_all: the send buffer), rounded down
    to one equal chunk per rank where the collective splits it. The size column is this times
    the element size: the bytes the collective actually moved through that buffer."""
    count = max(1, nbytes // itemsize)
    if collective in PER_RANK_CHUNKS:
        count = max(n, count - count % n)  # one equal chunk per rank
    return count


def _modulus(op: str) -> int:
    return 2 if op == "prod" else 3  # values 1..m: products of up to ~20 ranks stay exact


def _periodic(period: List[float], count: int, dtype, device) -> torch.Tensor:
    """`period` repeated to `count` elements: one pass over the buffer (an index tensor and its
    arithmetic took 0.35 s per 64 MiB buffer, most of a large cell's time)."""
    tile = torch.tensor(period, dtype=torch.float64).to(dtype=dtype, device=device)
    return tile.repeat(-(-count // len(period)))[:count]


def pattern(rank: int, count: int, offset: int, op: str, dtype, device) -> torch.Tensor:
    """Rank r's element i (global index offset + i): ((offset + i + r) mod m) + 1."""
    m = _modulus(op)
    return _periodic([(offset + j + rank) % m + 1 for j in range(m)], count, dtype, device)


def reduced(world: int, count: int, offset: int, op: str, dtype, device) -> torch.Tensor:
    """The op over ranks 0..world-1 of `pattern`: depends only on (offset + i) mod m."""
    m = _modulus(op)
    table = []
    for residue in range(m):
        values = [((residue + r) % m) + 1 for r in range(world)]
        combined = {"sum": sum(values), "prod": float(torch.tensor(values, dtype=torch.float64).prod()),
                    "max": max(values), "min": min(values), "avg": sum(values) / world}[op]
        table.append(combined)
    return _periodic([table[(offset + j) % m] for j in range(m)], count, dtype, device)


def make_case(collective: str, side: str, count: int, n: int, r: int, op: str, dtype, device, group=None):
    """(run, refill, expected) for this rank, or None where torch.distributed has no such variant.

    run() is what gets timed (on `group`, default the world's); refill() puts the check data
    back; expected() is the closed form of what the output should then hold (None on ranks whose
    output is undefined).
    """
    torch_op, c, root = OPS[op], count // n, 0
    fill = lambda k, off=0, rank=r: pattern(rank, k, off, op, dtype, device)  # noqa: E731
    if collective in IN_PLACE:
        if side == "oop":
            return None
        buf = fill(count)
        run = {"all_reduce": lambda: dist.all_reduce(buf, op=torch_op, group=group),
               "broadcast": lambda: dist.broadcast(buf, src=root, group=group),
               "reduce": lambda: dist.reduce(buf, dst=root, op=torch_op, group=group)}[collective]
        if collective == "broadcast":
            want = lambda: fill(count, rank=root)  # noqa: E731
        else:
            want = lambda: reduced(n, count, 0, op, dtype, device) if collective == "all_reduce" or r == root else None  # noqa: E731
        return run, lambda: buf.copy_(fill(count)), lambda: (buf, want())
    if collective == "all_gather":
        out = torch.empty(count, dtype=dtype, device=device)
        inp = fill(c) if side == "oop" else out[r * c:(r + 1) * c]  # in place: my chunk of the output
        run = lambda: compat.all_gather_single(out, inp, group=group)  # noqa: E731
        want = lambda: torch.cat([fill(c, rank=j) for j in range(n)])  # noqa: E731
        return run, lambda: inp.copy_(fill(c)), lambda: (out, want())
    if collective == "reduce_scatter":
        inp = fill(count)
        out = torch.empty(c, dtype=dtype, device=device) if side == "oop" else inp[r * c:(r + 1) * c]
        run = lambda: compat.reduce_scatter_single(out, inp, op=torch_op, group=group)  # noqa: E731
        return run, lambda: inp.copy_(fill(count)), lambda: (out, reduced(n, c, r * c, op, dtype, device))
    if collective == "sendrecv":  # nccl-tests' sendrecv: each rank sends to the next, receives from the one before
        if side == "ip" or n < 2:
            return None
        inp, out = fill(count), torch.empty(count, dtype=dtype, device=device)
        to, frm = (r + 1) % n, (r - 1) % n
        peer = (lambda q: dist.get_global_rank(group, q)) if group is not None else (lambda q: q)  # noqa: E731
        ops = [dist.P2POp(dist.isend, inp, peer(to), group=group), dist.P2POp(dist.irecv, out, peer(frm), group=group)]

        def run():
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        return run, lambda: inp.copy_(fill(count)), lambda: (out, fill(count, rank=frm))
    if collective == "all_to_all":
        if side == "ip":
            return None
        inp, out = fill(count), torch.empty(count, dtype=dtype, device=device)
        run = lambda: dist.all_to_all_single(out, inp, group=group)  # noqa: E731
        want = lambda: torch.cat([fill(c, r * c, rank=j) for j in range(n)])  # noqa: E731
        return run, lambda: inp.copy_(fill(count)), lambda: (out, want())
    raise ValueError(collective)


def make_algorithm_case(collective: str, algorithm: str, count: int, n: int, r: int, op: str, dtype, device):
    """(run, refill, expected) for a from-scratch algorithm (collectives.algorithms) doing
    `collective`: in place for all_reduce, broadcast and reduce, out of place for the rest (the
    side it returns first). None where the collective has no such algorithm."""
    import collectives.algorithms as A

    if algorithm not in A.ALGORITHMS.get(collective, {}):
        return None
    c, root = count // n, 0
    fill = lambda k, off=0, rank=r: pattern(rank, k, off, op, dtype, device)  # noqa: E731
    if collective in IN_PLACE:
        buf = fill(count)
        run = {"all_reduce": lambda: A.all_reduce(buf, op=op, algorithm=algorithm),
               "broadcast": lambda: A.broadcast(buf, src=root, algorithm=algorithm),
               "reduce": lambda: A.reduce(buf, dst=root, op=op, algorithm=algorithm)}[collective]
        if collective == "broadcast":
            want = lambda: fill(count, rank=root)  # noqa: E731
        else:
            want = lambda: reduced(n, count, 0, op, dtype, device) if collective == "all_reduce" or r == root else None  # noqa: E731
        return ("ip", run, lambda: buf.copy_(fill(count)), lambda: (buf, want()))
    # the output is allocated once, as for the backend's own calls above
    if collective == "all_gather":
        inp, out = fill(c), torch.empty(count, dtype=dtype, device=device)
        run = lambda: A.all_gather(inp, algorithm=algorithm, out=out)  # noqa: E731
        want = lambda: torch.cat([fill(c, rank=j) for j in range(n)])  # noqa: E731
    elif collective == "reduce_scatter":
        inp, out = fill(count), torch.empty(c, dtype=dtype, device=device)
        run = lambda: A.reduce_scatter(inp, op=op, algorithm=algorithm, out=out)  # noqa: E731
        want = lambda: reduced(n, c, r * c, op, dtype, device)  # noqa: E731
    else:  # all_to_all
        inp, out = fill(count), torch.empty(count, dtype=dtype, device=device)
        run = lambda: A.all_to_all(inp, algorithm=algorithm, out=out)  # noqa: E731
        want = lambda: torch.cat([fill(c, r * c, rank=j) for j in range(n)])  # noqa: E731
    return ("oop", run, lambda: inp.copy_(fill(inp.numel()) if collective != "all_gather" else fill(c)),
            lambda: (out, want()))


def count_wrong(case, reduce_device) -> int:
    run, refill, expected = case
    refill()
    run()
    sync_device(torch.device(reduce_device))
    got, want = expected()
    wrong = torch.zeros(1, dtype=torch.int64, device=reduce_device)
    if want is not None:
        wrong += (got != want).sum().to(reduce_device)
    dist.all_reduce(wrong)  # over every rank
    return int(wrong.item())
