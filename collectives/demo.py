"""See the data move: each collective's input and output on every rank, side by side.

    python -m collectives.demo                      # 4 ranks, every collective
    python -m collectives.demo --world-size 3 -c all_gather reduce_scatter
    python -m collectives.demo --checked            # and a mismatch caught by checked mode

Rank r starts from values built from r (so you can tell whose data ended where); every output
is checked against its closed form, and the exit code is 1 if any is wrong.
"""

from __future__ import annotations

import sys

import torch

import collectives as C
from collectives import cli
from collectives.cli import command
from collectives.names import COLLECTIVES as NAMES

COLLECTIVES = [c for c in NAMES if c != "barrier"]  # each moves data to show


def _show(t):
    return "None" if t is None else "[" + " ".join(f"{int(v)}" for v in t.flatten().tolist()) + "]"


def _step(env, name):
    """(input shown, output shown, expected output) on this rank."""
    n, r = env.world_size, env.rank
    row = torch.arange(n) + 10 * r  # rank r holds 10r, 10r+1, ...: the tens digit says whose it was
    if name == "broadcast":
        t = row.clone()
        return _show(row), C.broadcast(t, src=0), torch.arange(n)
    if name == "all_reduce":
        t = row.clone()
        return _show(row), C.all_reduce(t), sum(torch.arange(n) + 10 * i for i in range(n))
    if name == "reduce":
        t = row.clone()
        C.reduce(t, dst=0)
        return _show(row), (t if r == 0 else None), (sum(torch.arange(n) + 10 * i for i in range(n)) if r == 0 else None)
    if name == "all_gather":
        mine = torch.full((r + 1,), 10 * r)  # uneven on purpose
        return _show(mine), C.all_gather(mine), torch.cat([torch.full((i + 1,), 10 * i) for i in range(n)])
    if name == "gather":
        mine = torch.full((r + 1,), 10 * r)
        want = torch.cat([torch.full((i + 1,), 10 * i) for i in range(n)]) if r == 0 else None
        return _show(mine), C.gather(mine, dst=0), want
    if name == "reduce_scatter":
        return _show(row), C.reduce_scatter(row.clone()), sum(torch.arange(n) + 10 * i for i in range(n))[r : r + 1]
    if name == "scatter":
        t = torch.arange(n) if r == 0 else torch.zeros(n, dtype=torch.long)
        return _show(t), C.scatter(t, src=0), torch.tensor([r])
    if name == "all_to_all":
        return _show(row), C.all_to_all(row.clone()), torch.arange(n) * 10 + r
    raise ValueError(name)


def _body(env, names, checked):
    lines, wrong = [], 0
    for name in names:
        shown_in, out, want = _step(env, name)
        ok = (out is None and want is None) or (out is not None and want is not None and torch.equal(out, want))
        wrong += not ok
        lines.append((name, shown_in, _show(out), ok))
    if checked:
        try:
            with C.checked():
                C.all_reduce(torch.ones(2), op="max" if env.rank == env.world_size - 1 else "sum")
        except C.CollectiveMismatchError as exc:
            lines.append(("checked", "", str(exc), True))
    return lines, wrong


def build_parser():
    parser = cli.ArgumentParser(prog=cli.program_name(__name__), description="Show each collective's input and output on every rank.")
    parser.add_argument("--world-size", "-n", type=int, default=4, help="ranks to spawn (default 4)")
    parser.add_argument("-c", "--collectives", nargs="+", choices=COLLECTIVES, default=COLLECTIVES,
                        help="which collectives to show (default: all)")
    parser.add_argument("--checked", action="store_true", help="also show checked mode catching a SUM/MAX mix")
    return parser


@command
def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    cli.check_at_least(parser, args, {"--world-size": 1})

    results = C.run(_body, world_size=args.world_size, args=(args.collectives, args.checked))
    total_wrong = sum(w for _, w in results)
    for i, name in enumerate(args.collectives):
        print(f"\n{name}  (world_size={args.world_size}; src/dst = rank 0)")
        for rank, (lines, _) in enumerate(results):
            _, shown_in, shown_out, ok = lines[i]
            print(f"  rank {rank}: in {shown_in:<24} -> out {shown_out:<28} {'ok' if ok else 'WRONG'}")
    if args.checked:
        print("\nchecked mode, the last rank passing op=max while the others pass op=sum:")
        print("  " + results[0][0][-1][2].replace("\n", "\n  "))
    print(f"\n{len(args.collectives) * args.world_size - total_wrong} outputs right, {total_wrong} wrong")
    return 1 if total_wrong else 0


if __name__ == "__main__":
    sys.exit(main())
