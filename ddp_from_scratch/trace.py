"""See the overlap: the last backward's bucket timeline as a Chrome trace and as a PNG.

    model = DistributedDataParallel(net)
    loss.backward()
    write_chrome_trace(model.timeline, "ddp_trace.json", rank=env.rank)   # open in ui.perfetto.dev
    plot_timeline(model.timeline, "ddp_timeline.png")

Per bucket: when each of its gradients became ready (instants), and its all_reduce from launch
to completion (a span); plus the end of backward, when every averaged gradient is in place.
Times are microseconds from the forward's start.
"""

from __future__ import annotations

import json
from typing import Dict


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
    if timeline["end"] is not None:
        events.append({"name": "end of backward", "ph": "i", "s": "p", "ts": _us(timeline, timeline["end"]), "pid": rank,
                       "tid": "backward"})
    return events


def write_chrome_trace(timeline: Dict, path: str, rank: int = 0) -> None:
    with open(path, "w") as f:
        json.dump({"traceEvents": chrome_trace_events(timeline, rank), "displayTimeUnit": "ms"}, f)


def plot_timeline(timeline: Dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(timeline["buckets"])
    fig, ax = plt.subplots(figsize=(9, 1.0 + 0.5 * n))
    for _, bucket, t in timeline["ready"]:
        ax.plot(_us(timeline, t) / 1e3, bucket, "|", color="tab:blue", markersize=12)
    for bucket, launched in timeline["launch"].items():
        done = timeline["done"].get(bucket, timeline["end"])
        ax.broken_barh([(_us(timeline, launched) / 1e3, (done - launched) * 1e3)], (bucket - 0.3, 0.6), color="tab:orange")
    if timeline["end"] is not None:
        ax.axvline(_us(timeline, timeline["end"]) / 1e3, color="black", linestyle="--", label="end of backward")
    ax.set_yticks(range(n), [f"bucket {i} ({b / 2**20:.2f} MiB)" for i, b in enumerate(timeline["bytes"])])
    ax.set_xlabel("ms since the forward started   (| gradient ready, bar: all_reduce in flight)")
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
