"""Fit the cost model's alpha, beta and gamma on this machine, and save them.

    python -m collectives.algorithms.fit                       # 2 ranks, writes the package's model.json
    python -m collectives.algorithms.fit --out my-machine.json --json raw.json
    python -m collectives.algorithms.fit --world-size 4 --out four.json     # 4 ranks sharing the cores

alpha and beta come from two ranks exchanging n bytes at once through comm.DistComm, the very
sends and receives the algorithms use (so alpha includes Python's cost per message), because
that is what every step of the algorithms does and what the model assumes costs alpha + n beta
(a full-duplex link). On this 2-core machine an exchange costs more than a one-way message
(a ping-pong gave beta 0.24 ns/B, 4.2 GB/s, where the exchange gives the figure below), since
both directions share the cores. t(n) = alpha + beta n is fitted by least squares on relative
error (each squared error divided by t^2), so that the small sizes pin alpha and the large ones
beta. gamma is the time of the local reduction the algorithms do (dst op= src on float32, in
place) per byte of dst, fitted the same on 1 to 64 MiB by plain least squares, so the largest
sizes decide it: the large reductions are the ones that cost, and they run from memory, not
cache (on the development machine 16 MiB reduced 2.5x faster per byte than 64 MiB). The table
printed compares each measured time with the fitted line.

With --world-size 4 (or more) the ranks exchange in pairs, every pair at once, and all reduce at
once, each time taken on the slowest rank: the model for that many ranks sharing this machine's
cores, which is what they do in the race on 4 ranks (on this 2-core machine a message then costs
far more than with 2).
"""

from __future__ import annotations

import datetime
import statistics
import sys
import time
from typing import List, Tuple

import torch

from .. import cli
from ..cli import command
from ..launcher.launch import run
from ..reduce_ops import local_reduce
from .comm import DistComm
from .cost import DEFAULT_PATH, CostModel

SIZES = [8 << k for k in range(0, 24, 2)]  # 8 B to 32 MiB
# gamma from buffers well past the caches: the algorithms' reductions that matter are large
REDUCE_SIZES = [1 << 20, 4 << 20, 16 << 20, 64 << 20]


def _slowest(times: List[float]) -> List[float]:
    """Each repetition's time on the slowest rank."""
    t = torch.tensor(times, dtype=torch.float64)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return t.tolist()


def _exchange(sizes: List[int], repeats: int) -> List[Tuple[int, float]]:
    """Ranks in pairs (0-1, 2-3, ...), every pair at once, both ranks of a pair sending n bytes
    to each other at once (as in every step of the algorithms): the median over repetitions of
    the slowest rank's time for one exchange."""
    comm = DistComm()
    peer = comm.rank ^ 1
    out = []
    for nbytes in sizes:
        mine = torch.zeros(max(1, nbytes // 4), dtype=torch.float32)
        theirs = torch.empty_like(mine)
        times = []
        for i in range(repeats + 2):  # two warm-up exchanges
            torch.distributed.barrier()
            start = time.perf_counter()
            sent, got = comm.send(mine, peer), comm.recv(theirs, peer)
            sent.wait()
            got.wait()
            if i >= 2:
                times.append(time.perf_counter() - start)
        out.append((mine.numel() * 4, statistics.median(_slowest(times))))
    return out


def _reduce_times(sizes: List[int], repeats: int) -> List[Tuple[int, float]]:
    """dst += src on every rank at once: the median of the slowest rank's time."""
    out = []
    for nbytes in sizes:
        dst, src = torch.ones(max(1, nbytes // 4)), torch.ones(max(1, nbytes // 4))
        times = []
        for _ in range(repeats + 2):
            torch.distributed.barrier()
            start = time.perf_counter()
            local_reduce(dst, src, "sum")
            times.append(time.perf_counter() - start)
        out.append((dst.numel() * 4, statistics.median(_slowest(times[2:]))))
    return out


def _measure(env, sizes, reduce_sizes, repeats):
    return _exchange(sizes, repeats), _reduce_times(reduce_sizes, repeats)


def fit_line(points: List[Tuple[int, float]], relative: bool = True) -> Tuple[float, float]:
    """(intercept, slope) minimising sum(((a + b n - t) / t)^2), or sum((a + b n - t)^2) with
    relative=False (then the largest sizes decide the slope)."""
    w = [1.0 / t ** 2 if relative else 1.0 for _, t in points]
    sw = sum(w)
    sx = sum(wi * n for wi, (n, _) in zip(w, points))
    sy = sum(wi * t for wi, (_, t) in zip(w, points))
    sxx = sum(wi * n * n for wi, (n, _) in zip(w, points))
    sxy = sum(wi * n * t for wi, (n, t) in zip(w, points))
    slope = (sw * sxy - sx * sy) / (sw * sxx - sx * sx)
    return (sy - slope * sx) / sw, slope


def build_parser():
    parser = cli.ArgumentParser(prog="python -m collectives.algorithms.fit", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=DEFAULT_PATH, help="where to save the model (default: the package's model.json)")
    parser.add_argument("--json", default=None, help="also write every measurement here")
    parser.add_argument("--repeats", type=int, default=30, help="timed repetitions per size (medians are kept)")
    parser.add_argument("--world-size", type=int, default=2,
                        help="ranks, in pairs exchanging at once (an even number): as many as the ranks that will "
                             "share this machine's cores when the model is used (the race's 4: --world-size 4)")
    return parser


@command
def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    cli.check_outputs(parser, {"--out": args.out, "--json": args.json})
    cli.check_at_least(parser, args, {"--repeats": 1})
    if args.world_size < 2 or args.world_size % 2:
        parser.error(f"--world-size must be an even number of ranks (they exchange in pairs), got {args.world_size}")
    print(f"exchanges in pairs of {args.world_size} ranks, then local reductions on all at once ...",
          file=sys.stderr, flush=True)
    pings, reduces = run(_measure, args.world_size, args=(SIZES, REDUCE_SIZES, args.repeats), timeout=3600)[0]
    alpha, beta = fit_line(pings)
    _, gamma = fit_line(reduces, relative=False)
    flag = "" if args.world_size == 2 else f" --world-size {args.world_size}"
    source = f"python -m collectives.algorithms.fit{flag}, {datetime.date.today().isoformat()}, torch {torch.__version__}"
    model = CostModel(max(alpha, 0.0), beta, gamma, source)
    print(f"{'bytes':>10} {'exchange us':>11} {'fit us':>9}")
    for n, t in pings:
        print(f"{n:10d} {t * 1e6:11.1f} {(alpha + beta * n) * 1e6:9.1f}")
    print(f"{'bytes':>10} {'reduce us':>11} {'fit us':>9}")
    for n, t in reduces:
        print(f"{n:10d} {t * 1e6:11.1f} {n * gamma * 1e6:9.1f}")
    print(f"alpha {model.alpha * 1e6:.2f} us, beta {model.beta * 1e9:.4f} ns/B ({1 / model.beta / 1e9:.2f} GB/s), "
          f"gamma {model.gamma * 1e9:.4f} ns/B ({1 / model.gamma / 1e9:.2f} GB/s)")
    model.save(args.out)
    if args.json:
        cli.write_json(args.json, {"model": {"alpha": model.alpha, "beta": model.beta, "gamma": model.gamma,
                                             "source": source}, "exchange": pings, "reduce": reduces})
    print(f"saved {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
