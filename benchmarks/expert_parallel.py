"""Expert parallelism measured: each expert's load and each rank's, the all_to_all bytes a step and
the tokens dropped, for a balanced and a skewed router, with the balance loss on and off; and the
step's time beside a dense MLP of the same active parameters, on the same tokens.

    python -m benchmarks.expert_parallel --nproc 4 --experts 8 --top-k 2
    python -m benchmarks.expert_parallel --nproc 4 --experts 8 --top-k 2 --json ep.json --plot ep.png

The layer is ddp_from_scratch/expert_parallel/layer.py, its experts over --nproc ranks, trained
by SGD for --steps steps to follow a fixed random teacher MLP (mean squared error, plus --aux
times the balance loss when it is on). Each rank draws --tokens fresh tokens a step, in
sequences of --seq (each sequence routes as its own group). The tokens share a common direction,
as a model's hidden states do; the skewed router starts with its expert 0 aligned with it
(--skew), so most tokens pick expert 0 first. Four runs, from the same weights: balanced and
skewed, the balance loss on and off.

Each step, every rank's experts' load (the token slots they took, after the capacity), the slots
dropped, and the bytes the all_to_alls moved (the rows that left their rank, dispatch and
combine, forward and backward; float32). In each step's round, after a barrier, the dense MLP
(hidden -> k x ffn -> hidden: the parameters one token meets in the MoE's k experts) runs a step
on the same tokens, so the two times come from the same seconds of the machine; the ratio is the
median of the steps' ratios. The picture: tokens per expert per step, one panel a run.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import collectives
from collectives import cli, machine
from collectives.launcher.start_methods import TRAINING, preload
from ddp_from_scratch.expert_parallel.layer import ExpertParallelMoE
from ddp_from_scratch.expert_parallel.moe import MoE, expert_mlp

RUNS = [("balanced", False), ("balanced", True), ("skewed", False), ("skewed", True)]  # (router, balance loss on)


def _tokens(step: int, rank: int, config, direction: torch.Tensor) -> torch.Tensor:
    g = torch.Generator().manual_seed(step * 1000 + rank)
    x = torch.randn(config["tokens"], config["hidden"], generator=g)
    return (x + 2.0 * direction).view(-1, config["seq"], config["hidden"])


def _run(env, config, router: str, aux_on: bool) -> dict:
    h, e = config["hidden"], config["experts"]
    torch.manual_seed(0)
    direction = F.normalize(torch.randn(h), dim=0)
    teacher = expert_mlp(h, 4 * h).requires_grad_(False)
    moe = MoE(h, e, config["top_k"], capacity_factor=config["capacity_factor"] or None)
    if router == "skewed":
        with torch.no_grad():
            moe.router.weight[0] += config["skew"] * direction
    layer = ExpertParallelMoE(moe, None)
    dense = nn.Sequential(nn.Linear(h, config["top_k"] * 4 * h), nn.GELU(), nn.Linear(config["top_k"] * 4 * h, h))
    opt = torch.optim.SGD(layer.parameters(), lr=config["lr"])
    dense_opt = torch.optim.SGD(dense.parameters(), lr=config["lr"])
    per_rank = e // env.world_size
    steps = []
    for step in range(config["steps"] + 1):  # step 0: a warm-up, not kept
        x = _tokens(step, env.rank, config, direction)
        target = teacher(x)
        dist.barrier()
        start = time.perf_counter()
        y, aux = layer(x)
        loss = F.mse_loss(y, target) + (config["aux"] * aux.mean() if aux_on else 0.0)
        loss.backward()
        layer.sync_router_grad()  # the router is replicated: its gradient over every rank's tokens
        layer.router.weight.grad /= env.world_size
        for p in layer.experts.parameters():  # each expert's rows came from every rank's mean loss
            p.grad /= env.world_size
        opt.step()
        opt.zero_grad()
        moe_s = time.perf_counter() - start
        dist.barrier()
        start = time.perf_counter()
        F.mse_loss(dense(x), target).backward()
        dense_opt.step()
        dense_opt.zero_grad()
        dense_s = time.perf_counter() - start
        routed = layer.last.routed.clone()
        kept = routed - layer.last.dropped
        dist.all_reduce(routed)
        dist.all_reduce(kept)
        sent = torch.tensor([layer.last.sent_rows], dtype=torch.int64)
        dist.all_reduce(sent)
        aux_value = layer.last.aux.mean().clone()
        dist.all_reduce(aux_value)
        if step:
            steps.append({"routed": routed.tolist(), "kept": kept.tolist(),
                          "rank_load": kept.view(env.world_size, per_rank).sum(1).tolist(),
                          "dropped": int((routed - kept).sum()), "bytes": int(sent) * h * 4 * 2 * 2,
                          "aux": aux_value.item() / env.world_size, "moe_s": moe_s, "dense_s": dense_s})
    return {"router": router, "aux_on": aux_on, "steps": steps}


def measure(env, config) -> list:
    torch.set_num_threads(1)
    return [_run(env, config, router, aux_on) for router, aux_on in RUNS]


def summarise(per_rank: list, config) -> list:
    """One row per run: rank 0's load figures (the same on every rank), every rank's slowest times."""
    rows = []
    for i, run in enumerate(per_rank[0]):
        steps = run["steps"]
        slots = config["tokens"] * config["top_k"] * len(per_rank)
        moe_s = [max(r[i]["steps"][k]["moe_s"] for r in per_rank) for k in range(len(steps))]
        dense_s = [max(r[i]["steps"][k]["dense_s"] for r in per_rank) for k in range(len(steps))]
        tail = steps[-max(1, len(steps) // 5):]  # the last fifth of the run
        head = steps[:max(1, len(steps) // 5)]

        def imbalance(part):  # the busiest rank's slots over the mean rank's
            return statistics.median(max(s["rank_load"]) / (sum(s["rank_load"]) / len(s["rank_load"])) for s in part)

        rows.append({"router": run["router"], "aux_on": run["aux_on"],
                     "rank_imbalance_first": imbalance(head), "rank_imbalance_last": imbalance(tail),
                     "expert0_share_first": statistics.median(s["routed"][0] / slots for s in head),
                     "expert0_share_last": statistics.median(s["routed"][0] / slots for s in tail),
                     "dropped_share": sum(s["dropped"] for s in steps) / (slots * len(steps)),
                     "aux_last": statistics.median(s["aux"] for s in tail),
                     "bytes_per_step": statistics.median(s["bytes"] for s in steps),
                     "moe_ms": 1e3 * statistics.median(moe_s), "dense_ms": 1e3 * statistics.median(dense_s),
                     "moe_over_dense": statistics.median(m / d for m, d in zip(moe_s, dense_s)),
                     "tokens_per_expert": [s["routed"] for s in steps]})
    return rows


def report(rows: list) -> str:
    head = ("router   | balance loss | expert 0's share, first -> last | busiest rank / mean, first -> last | "
            "dropped | all_to_all bytes / step | MoE ms | dense ms | MoE / dense")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['router']:<8} | {'on' if r['aux_on'] else 'off':<12} | "
                     f"{r['expert0_share_first']:.2f} -> {r['expert0_share_last']:.2f}{'':<18} | "
                     f"{r['rank_imbalance_first']:.2f} -> {r['rank_imbalance_last']:.2f}{'':<22} | "
                     f"{100 * r['dropped_share']:5.1f}% | {r['bytes_per_step']:>23,.0f} | {r['moe_ms']:6.2f} | "
                     f"{r['dense_ms']:8.2f} | {r['moe_over_dense']:.2f}")
    return "\n".join(lines)


def plot(rows: list, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    grids = [torch.tensor(r["tokens_per_expert"], dtype=torch.float32).t() for r in rows]  # (experts, steps) each
    top = max(float(g.max()) for g in grids)
    fig, axes = plt.subplots(1, len(rows), figsize=(3.6 * len(rows) + 1, 3.4), sharey=True)
    for ax, r, grid in zip(axes, rows, grids):
        image = ax.imshow(grid.numpy(), aspect="auto", origin="lower", cmap="viridis", interpolation="nearest", vmin=0, vmax=top)
        ax.set_title(f"{r['router']} router, balance loss {'on' if r['aux_on'] else 'off'}", fontsize=9)
        ax.set_xlabel("step")
    axes[0].set_ylabel("expert")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0, 0.93, 1))
    fig.colorbar(image, ax=list(axes), fraction=0.02, pad=0.01, label="token slots")
    cli.save_figure(fig, path)
    plt.close(fig)


def build_parser():
    parser = cli.ArgumentParser(prog="python -m benchmarks.expert_parallel",
                                description="A mixture-of-experts layer over N ranks: load, bytes and drops, balanced "
                                            "and skewed, with the balance loss on and off; beside a dense MLP.")
    parser.add_argument("--nproc", type=int, default=2, help="ranks, the experts spread over them (default 2)")
    parser.add_argument("--backend", choices=["gloo", "shm"], default="shm", help="the ranks' backend (default shm)")
    parser.add_argument("--experts", type=int, default=None, help="experts, a multiple of --nproc (default 2 a rank)")
    parser.add_argument("--top-k", type=int, default=2, help="experts a token goes to (default 2)")
    parser.add_argument("--hidden", type=int, default=64, help="hidden size; each expert is hidden -> 4 hidden -> "
                                                               "hidden (default 64)")
    parser.add_argument("--tokens", type=int, default=512, help="tokens a rank a step (default 512)")
    parser.add_argument("--seq", type=int, default=32, help="tokens a sequence, each a routing group (default 32)")
    parser.add_argument("--capacity-factor", type=float, default=1.25,
                        help="an expert takes ceil(F x seq x k / E) slots of a sequence; 0: no capacity (default 1.25)")
    parser.add_argument("--aux", type=float, default=1.0,
                        help="the balance loss's weight when on (default 1: large, so that 40 steps show its effect; "
                             "Switch trains with 0.01 over many more)")
    parser.add_argument("--skew", type=float, default=3.0,
                        help="the skewed router's expert-0 weight along the tokens' common direction (default 3)")
    parser.add_argument("--lr", type=float, default=0.5, help="SGD learning rate (default 0.5)")
    parser.add_argument("--steps", type=int, default=40, help="steps a run, after a warm-up one (default 40)")
    parser.add_argument("--json", default=None, help="also write every row here")
    parser.add_argument("--plot", default=None, help="draw tokens per expert per step here (PNG)")
    return parser


@cli.command
def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    cli.check_at_least(parser, args, {"--nproc": 1, "--top-k": 1, "--hidden": 1, "--tokens": 1, "--seq": 1,
                                      "--steps": 1})
    experts = args.experts if args.experts is not None else 2 * args.nproc
    if experts < 1 or experts % args.nproc:
        parser.error(f"--experts {experts} must be a positive multiple of --nproc {args.nproc}")
    if args.top_k > experts:
        parser.error(f"--top-k {args.top_k} must be at most the {experts} experts")
    if args.tokens % args.seq:
        parser.error(f"--tokens {args.tokens} must be whole sequences of --seq {args.seq}")
    if args.capacity_factor < 0 or args.aux < 0:
        parser.error("--capacity-factor and --aux must be 0 or more")
    cli.check_positive(parser, args, "--lr")
    cli.check_outputs(parser, {"--json": args.json, "--plot": args.plot})
    config = {"nproc": args.nproc, "backend": args.backend, "experts": experts, "top_k": args.top_k,
              "hidden": args.hidden, "tokens": args.tokens, "seq": args.seq, "capacity_factor": args.capacity_factor,
              "aux": args.aux, "skew": args.skew, "lr": args.lr, "steps": args.steps}
    preload(*TRAINING)
    cores = machine.cpus()
    per_rank = collectives.run(measure, args.nproc, backend=args.backend, args=(config,), timeout=3600)
    rows = summarise(per_rank, config)
    print(f"# {cli.command_line('benchmarks.expert_parallel', argv)}")
    print(f"# {experts} experts over {args.nproc} ranks ({args.backend}), top-{args.top_k}, hidden {args.hidden}, "
          f"{args.tokens} tokens a rank a step, capacity factor {args.capacity_factor or 'none'}, {cores} cpus; "
          f"first/last: medians of the first and last fifth of {args.steps} steps; times: medians of the slowest rank")
    print(report(rows))
    if args.plot:
        plot(rows, args.plot, f"tokens per expert per step: {experts} experts over {args.nproc} ranks, top-{args.top_k}")
    if args.json:
        cli.write_json(args.json, {"command": cli.command_line("benchmarks.expert_parallel", argv), "config": config,
                                   "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
