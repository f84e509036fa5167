"""A pipeline step as it ran: each rank's forwards and backwards on one time axis, as a Chrome
trace and as a picture (ranks by time, a block an action, coloured by microbatch: forwards
plain, backwards (and a split backward's I) hatched, W dotted; the gaps are the bubble).

    results = [stage.run(...) for each rank]                 # StepResults, gathered to one rank
    write_chrome_trace(results, "pipeline.json")             # open in ui.perfetto.dev
    plot(results, "pipeline.png", title="1F1B, 2 stages, 8 microbatches")

Times are the executor's own (stage.py): time.perf_counter(), one clock for every process of a
machine, so the ranks line up.
"""

from __future__ import annotations

from typing import List

from collectives.output_files import save_figure, write_json

from .schedule import BACKWARD, FORWARD, INPUT, WEIGHT, stage_index

HATCH = {FORWARD: None, BACKWARD: "///", INPUT: "///", WEIGHT: "..."}


def _origin(results) -> float:
    return min(r.started for r in results)


def chrome_trace_events(results) -> list:
    t0, events = _origin(results), []
    for rank, result in enumerate(results):
        for action, waited, began, ended in result.timeline:
            base = (result.started - t0) * 1e6
            if began > waited:
                events.append({"name": f"wait for {action}", "ph": "X", "ts": base + waited * 1e6,
                               "dur": (began - waited) * 1e6, "pid": rank, "tid": "messages"})
            events.append({"name": str(action), "ph": "X", "ts": base + began * 1e6, "dur": (ended - began) * 1e6,
                           "pid": rank, "tid": "compute", "args": {"microbatch": action.microbatch}})
    return events


def write_chrome_trace(results, path: str, flag: str = None) -> None:
    write_json(path, {"traceEvents": chrome_trace_events(results), "displayTimeUnit": "ms"}, flag, None)


def plot(results: List, path: str, title: str = "", flag: str = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t0 = _origin(results)
    microbatches = max(a.microbatch for r in results for a, *_ in r.timeline) + 1
    colours = plt.get_cmap("tab10" if microbatches <= 10 else "viridis", max(microbatches, 2))
    fig, ax = plt.subplots(figsize=(10, 0.9 + 0.55 * len(results)))
    for rank, result in enumerate(results):
        base = (result.started - t0) * 1e3
        for action, _, began, ended in result.timeline:
            ax.broken_barh([(base + began * 1e3, max(ended - began, 1e-6) * 1e3)], (rank - 0.35, 0.7),
                           facecolor=colours(action.microbatch), edgecolor="black", linewidth=0.4,
                           hatch=HATCH[action.kind])
            if ended - began > 0.02 * max(r.step_s for r in results):
                ax.text(base + (began + ended) / 2 * 1e3, rank, str(action), ha="center", va="center", fontsize=7)
    p = len(results)
    chunks = 1 + max(a.chunk for r in results for a, *_ in r.timeline)
    ax.set_yticks(range(p), [f"rank {r} (stage{'s' if chunks > 1 else ''} "
                             f"{', '.join(str(stage_index(c, r, p)) for c in range(chunks))})" for r in range(p)])
    ax.set_ylim(len(results) - 0.5, -0.5)
    split = any(a.kind == WEIGHT for r in results for a, *_ in r.timeline)
    ax.set_xlabel("ms   (plain: forward, hatched: " + ("input gradient I, dotted: weight gradient W" if split else "backward")
                  + ", colour: microbatch, :c the chunk; gaps: the bubble)")
    ax.set_title(title, fontsize=10)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    save_figure(fig, path, flag, dpi=110)
    plt.close(fig)
