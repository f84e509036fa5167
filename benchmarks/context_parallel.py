"""Context parallelism measured: the activations each rank holds against sequence length on 1, 2 and
4 ranks; each rank's share of the causal work with and without the head-tail balance; the time
each ring step waits for its message against computing, with and without sending the next block
under the current one; the ring's steps drawn on a time axis; and the cost model's time beside the
measured one.

    python -m benchmarks.context_parallel
    python -m benchmarks.context_parallel --ranks 1 2 4 --seq 512 1024 2048 4096 --json cp.json --plot cp.png

The layer is one attention block: q, k, v projections of this rank's tokens, ring attention
(ddp_from_scratch/context_parallel/ring.py), the output projection; batch 1, --heads heads of
--head-dim. For each rank count and sequence length, autograd's saved tensors during the forward
(pipeline_parallel/saved.py) are the activations a rank holds for backward. For the largest rank
count and sequence, each variant (balanced or contiguous, overlapped or not) runs --rounds
forward passes in turn after a barrier; a step's compute and wait times are the ring's own
timestamps, and a variant's time is the median over rounds of the slowest rank's forward. The
prediction: each step's compute as measured, a message as the alpha-beta cost model prices it
(collectives/algorithms/cost.py, fitted on the 2-core VM): sum of compute + message per step
without overlap, of max(compute, message) with it.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

import collectives
from collectives import cli, machine
from collectives.algorithms.cost import CostModel
from collectives.launcher.start_methods import TRAINING, preload
from ddp_from_scratch.context_parallel.layout import shard, work
from ddp_from_scratch.context_parallel.ring import ring_attention, ring_forward
from ddp_from_scratch.pipeline_parallel.saved import SavedBytes

VARIANTS = [("head-tail", True, True), ("head-tail", True, False), ("contiguous", False, True),
            ("contiguous", False, False)]  # (layout, balanced, overlap)


class _Attention(nn.Module):
    def __init__(self, heads: int, head_dim: int):
        super().__init__()
        torch.manual_seed(0)
        self.heads, self.head_dim = heads, head_dim
        width = heads * head_dim
        self.qkv, self.out = nn.Linear(width, 3 * width), nn.Linear(width, width)

    def forward(self, x, group, balanced, overlap=True):
        b, s, _ = x.shape
        q, k, v = (t.view(b, s, self.heads, self.head_dim).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        y = ring_attention(q, k, v, group, causal=True, balanced=balanced, overlap=overlap)
        return self.out(y.transpose(1, 2).reshape(b, s, -1))


def measure(env, config) -> dict:
    torch.set_num_threads(1)
    r, n = env.rank, env.world_size
    width = config["heads"] * config["head_dim"]
    layer = _Attention(config["heads"], config["head_dim"])
    memory = {}
    for seq in config["seq"]:
        x = shard(torch.randn(1, seq, width, generator=torch.Generator().manual_seed(seq)), r, n, True, dim=1)
        saved = SavedBytes(layer.parameters())
        with saved:
            y = layer(x.requires_grad_(True), None, True)
        y.sum().backward()
        memory[seq] = saved.peak
    seq = max(config["seq"])
    x = torch.randn(1, seq, width, generator=torch.Generator().manual_seed(1))
    qkv = {balanced: [t.view(1, -1, config["heads"], config["head_dim"]).transpose(1, 2).contiguous()
                      for t in layer.qkv(shard(x, r, n, balanced, dim=1)).detach().chunk(3, dim=-1)]
           for balanced in (True, False)}
    runs = {name: [] for name in VARIANTS}
    for round_ in range(config["rounds"] + 1):
        for variant in VARIANTS:
            _, balanced, overlap = variant
            steps = []
            dist.barrier()
            start = time.perf_counter()
            ring_forward(*qkv[balanced], None, True, balanced, overlap, steps)
            if round_:  # round 0 warms up
                runs[variant].append({"seconds": time.perf_counter() - start, "start": start, "steps": steps})
    return {"memory": memory, "runs": {f"{a}|{b}|{c}": v for (a, b, c), v in runs.items()}}


def summarise(per_rank: dict, config, model: CostModel) -> dict:
    """Per rank count: the memory; for the largest: per variant the time, the compute shares, waits and the prediction."""
    out = {"memory": {n: {seq: [r["memory"][seq] for r in ranks] for seq in config["seq"]}
                      for n, ranks in per_rank.items()}}
    n = max(per_rank)
    ranks = per_rank[n]
    seq = max(config["seq"])
    kv_bytes = 2 * seq // n * config["heads"] * config["head_dim"] * 4
    message = model.alpha + model.beta * kv_bytes if n > 1 else 0.0
    variants = []
    for key in ranks[0]["runs"]:
        layout, balanced, overlap = key.split("|")
        rounds = len(ranks[0]["runs"][key])
        slowest = [max(r["runs"][key][k]["seconds"] for r in ranks) for k in range(rounds)]
        compute = [[statistics.median(r["runs"][key][k]["steps"][i]["compute_s"] for k in range(rounds))
                    for i in range(n)] for r in ranks]  # [rank][step]
        wait = [[statistics.median(r["runs"][key][k]["steps"][i]["wait_s"] for k in range(rounds))
                 for i in range(n)] for r in ranks]
        totals = [sum(c) for c in compute]
        predicted = max(sum(c[i] + (message if i < n - 1 else 0.0) for i in range(n)) if overlap == "False" else
                        sum(max(c[i], message if i < n - 1 else 0.0) for i in range(n)) for c in compute)
        variants.append({"layout": layout, "overlap": overlap == "True", "seconds": statistics.median(slowest),
                         "predicted_seconds": predicted, "compute_share": [t / sum(totals) for t in totals],
                         "compute_s_by_rank": totals, "wait_s_by_rank": [sum(w) for w in wait],
                         "work_share_closed_form": [work(seq, r, n, balanced == "True") / (seq * (seq + 1) / 2)
                                                    for r in range(n)],
                         "timeline": [r["runs"][key][-1] for r in ranks]})
    out.update({"ranks": n, "seq": seq, "kv_bytes": kv_bytes, "message_s_model": message, "variants": variants})
    return out


def report(summary: dict, config) -> str:
    lines = ["activations a rank holds for backward (MiB), rank 0; the ratio to one rank:",
             "   seq | " + " | ".join(f"{n} rank{'s' * (n > 1)}" for n in summary["memory"])]
    one = summary["memory"].get(1)
    for seq in config["seq"]:
        cells = []
        for n, by_seq in summary["memory"].items():
            mib = by_seq[seq][0] / 2 ** 20
            cells.append(f"{mib:7.2f}" + (f" ({by_seq[seq][0] / one[seq][0]:.2f})" if one and n > 1 else ""))
        lines.append(f"{seq:6d} | " + " | ".join(cells))
    n = summary["ranks"]
    lines += ["", f"ring forward on {n} ranks, seq {summary['seq']} (a key-value block {summary['kv_bytes']:,} bytes, "
                  f"{1e3 * summary['message_s_model']:.3f} ms by the cost model):",
              "layout     | overlap | ms (median) | model ms | compute share by rank (closed form)      | wait ms by rank"]
    for v in summary["variants"]:
        shares = " ".join(f"{s:.2f}" for s in v["compute_share"])
        closed = " ".join(f"{s:.2f}" for s in v["work_share_closed_form"])
        waits = " ".join(f"{1e3 * w:.2f}" for w in v["wait_s_by_rank"])
        lines.append(f"{v['layout']:<10} | {'yes' if v['overlap'] else 'no':<7} | {1e3 * v['seconds']:11.2f} | "
                     f"{1e3 * v['predicted_seconds']:8.2f} | {shares} ({closed}) | {waits}")
    return "\n".join(lines)


def plot(summary: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    chosen = [v for v in summary["variants"] if v["overlap"]]
    fig, axes = plt.subplots(len(chosen), 1, figsize=(9, 1.2 + 0.5 * summary["ranks"] * len(chosen)), squeeze=False)
    for ax, v in zip(axes[:, 0], chosen):
        origin = min(run["start"] for run in v["timeline"])
        for rank, run in enumerate(v["timeline"]):
            for step in run["steps"]:
                w0, c0 = step["wait_start"] - origin, step["compute_start"] - origin
                if step["wait_s"] > 0:
                    ax.broken_barh([(1e3 * w0, 1e3 * step["wait_s"])], (rank - 0.4, 0.8), color="0.8")
                if step["computed"]:
                    ax.broken_barh([(1e3 * c0, 1e3 * step["compute_s"])], (rank - 0.4, 0.8), color=f"C{step['step']}")
                    ax.text(1e3 * (c0 + step["compute_s"] / 2), rank, str(step["step"]), ha="center", va="center",
                            fontsize=7)
        ax.set_yticks(range(summary["ranks"]), [f"rank {r}" for r in range(summary["ranks"])])
        ax.invert_yaxis()
        ax.set_title(f"{v['layout']} layout: each ring step's block (coloured, numbered) and waits (grey)", fontsize=9)
    axes[-1, 0].set_xlabel("ms from the first rank's start")
    fig.tight_layout()
    cli.save_figure(fig, path)
    plt.close(fig)


def build_parser():
    parser = cli.ArgumentParser(prog="python -m benchmarks.context_parallel",
                                description="Ring attention over 1, 2 and 4 ranks: memory per rank against sequence "
                                            "length, compute shares with and without balance, waits with and "
                                            "without overlap, the ring drawn, the cost model beside it.")
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4], help="rank counts (default 1 2 4)")
    parser.add_argument("--seq", type=int, nargs="+", default=[512, 1024, 2048, 4096],
                        help="sequence lengths, tokens (default 512 1024 2048 4096)")
    parser.add_argument("--heads", type=int, default=4, help="attention heads (default 4)")
    parser.add_argument("--head-dim", type=int, default=32, help="head size (default 32)")
    parser.add_argument("--rounds", type=int, default=7, help="timed rounds after a warm-up (default 7)")
    parser.add_argument("--backend", choices=["gloo", "shm"], default="shm", help="the ranks' backend (default shm)")
    parser.add_argument("--json", default=None, help="also write every figure here")
    parser.add_argument("--plot", default=None, help="draw the ring's steps here (PNG)")
    return parser


@cli.command
def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    cli.check_at_least(parser, args, {"--heads": 1, "--head-dim": 1, "--rounds": 1})
    if min(args.ranks) < 1:
        parser.error(f"--ranks must be 1 or more, got {args.ranks}")
    for seq in args.seq:
        for n in args.ranks:
            if seq < 1 or seq % (2 * n):
                parser.error(f"--seq {seq} must cut into 2 x {n} equal pieces (the head-tail layout on {n} ranks)")
    cli.check_outputs(parser, {"--json": args.json, "--plot": args.plot})
    config = {"ranks": sorted(set(args.ranks)), "seq": sorted(set(args.seq)), "heads": args.heads,
              "head_dim": args.head_dim, "rounds": args.rounds, "backend": args.backend}
    preload(*TRAINING)
    cores = machine.cpus()
    per_rank = {n: collectives.run(measure, n, backend=args.backend, args=(config,), timeout=3600)
                for n in config["ranks"]}
    model = CostModel.load()
    summary = summarise(per_rank, config, model)
    print(f"# {cli.command_line('benchmarks.context_parallel', argv)}")
    print(f"# one attention block, batch 1, {args.heads} heads of {args.head_dim}, causal, {args.backend}, {cores} cpus, "
          f"{args.rounds} rounds; cost model: {model.source or 'the package default'}")
    print(report(summary, config))
    if args.plot:
        plot(summary, args.plot)
    if args.json:
        cli.write_json(args.json, {"command": cli.command_line("benchmarks.context_parallel", argv), "config": config,
                                   "summary": summary})
    return 0


if __name__ == "__main__":
    sys.exit(main())
