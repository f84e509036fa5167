"""See the overlap: the last backward's bucket timeline as a Chrome trace and as a PNG.

    model = DistributedDataParallel(net)
    loss.backward()
    write_chrome_trace(model.timeline, "ddp_trace.json", rank=env.rank)   # open in ui.perfetto.dev
    plot_timeline(model.timeline, "ddp_timeline.png")

    python -m ddp_from_scratch.trace --world-size 2 --batch-size 8 --out ddp-timeline   # ResNet-50
        -> ddp-timeline.json (every rank, one process row each), ddp-timeline.png (rank 0), and the
           bucket layout before and after the rebuild printed

Per bucket: when each of its gradients became ready (instants), and its all_reduce from launch
to completion (a span); plus the end of backward, when every averaged gradient is in place.
Times are microseconds from the forward's start.
"""

from __future__ import annotations

import sys
from typing import Dict

from collectives import cli
from collectives.cli import command
from collectives.launcher.start_methods import TRAINING, preload

from .workload.models import check_batch_fits, check_batchnorm_fits



def _us(timeline: Dict, t: float) -> float:
    return (t - timeline["start"]) * 1e6


def chrome_trace_events(timeline: Dict, rank: int = 0) -> list:
    events = []
    for name, bucket, t in timeline["ready"]:
        events.append({"name": f"grad ready: {name}", "ph": "i", "s": "t", "ts": _us(timeline, t),
                       "pid": rank, "tid": f"bucket {bucket} gradients"})
    for bucket, launched in sorted(timeline["launch"].items()):
        done = timeline["done"].get(bucket, timeline["end"])
        events.append({"name": f"all_reduce bucket {bucket} ({timeline['bytes'][bucket] / 2**20:.3f} MiB)", "ph": "X",
                       "ts": _us(timeline, launched), "dur": max(0.0, _us(timeline, done) - _us(timeline, launched)),
                       "pid": rank, "tid": f"bucket {bucket} all_reduce",
                       "args": {"params": timeline["buckets"][bucket]}})
    for name, lane, start, end in timeline.get("spans", []):
        events.append({"name": name, "ph": "X", "ts": _us(timeline, start), "dur": max(0.0, (end - start) * 1e6),
                       "pid": rank, "tid": lane})
    if timeline["end"] is not None:
        events.append({"name": "end of backward", "ph": "i", "s": "p", "ts": _us(timeline, timeline["end"]), "pid": rank,
                       "tid": "backward"})
    return events


def write_chrome_trace(timeline: Dict, path: str, rank: int = 0) -> None:
    cli.write_json(path, {"traceEvents": chrome_trace_events(timeline, rank), "displayTimeUnit": "ms"}, None, None)


SPAN_COLORS = {"all_gather": "tab:green", "all_gather, backward": "tab:purple", "reduce_scatter": "tab:orange"}


def _size(nbytes: float) -> str:
    return f"{nbytes / 2**20:.2f} MiB" if nbytes >= 2**20 else f"{nbytes / 2**10:.1f} KiB"


def _lane_row(lane: str, n: int) -> int:
    """The row of a span's lane: "unit 3" -> 3; anything else (ZeRO-1's "parameters") below them."""
    return int(lane.split()[-1]) if lane.startswith("unit ") else n


def plot_timeline(timeline: Dict, path: str) -> None:
    """Draw a timeline: DDP's buckets (| gradient ready, bar: all_reduce in flight), or the
    sharded steps' units (| gradient ready, green: all_gather for forward, purple: for backward,
    orange: reduce_scatter until it was waited for)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(timeline["buckets"])
    spans = timeline.get("spans", [])
    rows = n + (1 if any(not lane.startswith("unit ") for _, lane, _, _ in spans) else 0)
    fig, ax = plt.subplots(figsize=(9, 1.0 + 0.5 * rows))
    for _, bucket, t in timeline["ready"]:
        ax.plot(_us(timeline, t) / 1e3, bucket, "|", color="tab:blue", markersize=12)
    for bucket, launched in timeline["launch"].items():
        done = timeline["done"].get(bucket, timeline["end"])
        ax.broken_barh([(_us(timeline, launched) / 1e3, (done - launched) * 1e3)], (bucket - 0.3, 0.6), color="tab:orange")
    for name, lane, start, end in spans:
        kind = name.split()[0] + (", backward" if "(backward)" in name else "")
        ax.broken_barh([(_us(timeline, start) / 1e3, max(end - start, 1e-5) * 1e3)], (_lane_row(lane, n) - 0.3, 0.6),
                       color=SPAN_COLORS.get(kind, "tab:gray"))
    if timeline["end"] is not None:
        ax.axvline(_us(timeline, timeline["end"]) / 1e3, color="black", linestyle="--", label="end of backward")
    sharded = bool(spans)
    labels = [f"{'unit' if sharded else 'bucket'} {i} ({_size(b)})" for i, b in enumerate(timeline["bytes"])]
    ax.set_yticks(range(rows), labels + (["parameters"] if rows > n else []))
    ax.set_xlabel("ms since the forward started   (| gradient ready, " + (
        "all_gather: green for forward,\npurple for backward; orange: reduce_scatter until waited for)" if sharded
        else "bar: all_reduce in flight)"))
    if timeline["end"] is not None:
        ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    cli.save_figure(fig, path, None, dpi=110)
    plt.close(fig)


def _traced_steps(env, model_name: str, batch_size: int, steps: int, impl: str = "bucketed", options=None):
    """Train `steps` steps of our DDP (default settings) or a sharded step (with `options`, e.g.
    ZeRO-2's bucket_cap_mb); the last step's timeline and the layouts (buckets, or the shard layout)."""
    import torch
    import torch.nn.functional as F

    from .steps.ddp import DistributedDataParallel
    from .workload.models import MODELS, batch
    from .wrap import wrap

    torch.manual_seed(0)
    if impl == "bucketed":
        model = DistributedDataParallel(MODELS[model_name]())
        opt = torch.optim.SGD(model.parameters(), lr=0.001, momentum=0.9)
    else:
        model = wrap(MODELS[model_name](), impl, **(options or {}))
        opt = model.optimizer(torch.optim.SGD, lr=0.001, momentum=0.9)
    image = 32 if model_name == "resnet50" else 12
    for step in range(steps):
        x, y = batch(step, env.rank, batch_size, image)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    if impl == "bucketed":
        return model.timeline, model.layouts
    return model.timeline, {f"shards, rank {env.rank}": model.shard_layout_text(env.rank)}


def build_parser():
    from .workload.models import MODELS
    from .wrap import SHARDED, STAGES

    parser = cli.ArgumentParser(prog=cli.program_name(__name__), description="Record our DDP's bucket timeline (or a sharded step's all-gathers "
                                                 "and reduce-scatters): Chrome trace, PNG, layouts.")
    parser.add_argument("--impl", choices=["bucketed"] + SHARDED, default="bucketed",
                        help="our DDP, or a sharded step (" + "; ".join(f"{n}: {STAGES[n].summary}" for n in SHARDED) + ")")
    parser.add_argument("--model", choices=list(MODELS), default="resnet50")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=8, help="images per rank")
    parser.add_argument("--steps", type=int, default=3, help="steps trained; the last one is traced (the buckets "
                        "are rebuilt at step 1)")
    parser.add_argument("--bucket-cap-mb", type=float, default=None,
                        help="--impl zero2 or zero2-bucketed: reduce-scatter in buckets of this many MiB during backward")
    parser.add_argument("--out", default="ddp-timeline", help="writes OUT.json (Chrome trace) and OUT.png")
    return parser


@command
def main(argv=None) -> int:
    import collectives

    parser = build_parser()
    args = parser.parse_args(argv)
    cli.check_outputs(parser, [("--out", args.out + ".json"), ("--out", args.out + ".png")])
    cli.check_at_least(parser, args, {"--world-size": 1, "--batch-size": 1, "--steps": 1})
    check_batch_fits(parser, args.model, args.batch_size, args.world_size)
    check_batchnorm_fits(parser, args.model, args.batch_size)
    if args.bucket_cap_mb is not None and args.impl not in ("zero2", "zero2-bucketed"):
        parser.error(f"--bucket-cap-mb applies to --impl zero2 or zero2-bucketed here, not {args.impl}")
    cli.check_positive(parser, args, "--bucket-cap-mb", "MiB")
    options = {"bucket_cap_mb": args.bucket_cap_mb} if args.bucket_cap_mb is not None else {}
    preload(*TRAINING)  # every rank builds an optimizer: the fork server imports what that needs, once
    results = collectives.run(_traced_steps, args.world_size,
                              args=(args.model, args.batch_size, args.steps, args.impl, options))
    events = [e for rank, (timeline, _) in enumerate(results) for e in chrome_trace_events(timeline, rank)]
    cli.write_json(args.out + ".json", {"traceEvents": events, "displayTimeUnit": "ms"}, "--out", None)
    plot_timeline(results[0][0], args.out + ".png")
    timeline, layouts = results[0]
    for when, text in layouts.items():
        print(f"{'bucket layout, ' if args.impl == 'bucketed' else ''}{when}:\n{text}\n")
    for name, lane, start, end in timeline.get("spans", []):
        print(f"rank 0, {name:<34s} {_us(timeline, start) / 1e3:8.1f} -> {_us(timeline, end) / 1e3:8.1f} ms")
    for bucket, launched in sorted(timeline["launch"].items()):
        done = timeline["done"].get(bucket, timeline["end"])
        last_ready = max(t for _, b, t in timeline["ready"] if b == bucket)
        print(f"rank 0, bucket {bucket}: last gradient ready at {_us(timeline, last_ready) / 1e3:8.1f} ms, "
              f"all_reduce {_us(timeline, launched) / 1e3:8.1f} -> {_us(timeline, done) / 1e3:8.1f} ms")
    print(f"rank 0, end of backward at {_us(timeline, timeline['end']) / 1e3:.1f} ms (from the forward's start)")
    print(f"wrote {args.out}.json (open in ui.perfetto.dev) and {args.out}.png", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
