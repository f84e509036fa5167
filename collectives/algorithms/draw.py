"""See an algorithm run: the step table, a space-time picture, and a Chrome trace.

    table = step_table(result.snapshots, world_size)        # after simulate(..., watch=chunk_sets)
    plot_spacetime(result.messages, result.computes, world_size, "ring.png")
    write_chrome_trace(result.messages, result.computes, "ring.json")   # open in ui.perfetto.dev

The step table runs the algorithm on data that names its origin: rank r's buffer holds 2**r in
every element and the op is a sum, so any value's bits say which ranks' contributions it
contains. After each step, for each rank and each chunk, the table lists those ranks:
"0+1" is the sum of ranks 0 and 1's chunk, "all" every rank's, "-" an empty chunk (nothing
arrived yet).
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence

import torch

from ..chunks import bounds
from ..output_files import save_figure, write_json


def origin_inputs(collective: str, world_size: int, numel: int, root: int = 0) -> List[torch.Tensor]:
    """Rank r's input: 2**r everywhere (broadcast and scatter: only the root has data)."""
    if world_size > 62:
        raise ValueError("the step table names ranks by bits of an int64: at most 62 ranks")
    if collective in ("broadcast", "scatter"):
        return [torch.full((numel,), (1 << r) if r == root else 0, dtype=torch.int64) for r in range(world_size)]
    return [torch.full((numel,), 1 << r, dtype=torch.int64) for r in range(world_size)]


def chunk_sets(world_size: int):
    """watch function for simulate(): per chunk of the buffer, the ranks its values come from."""
    def summary(buf: torch.Tensor):
        out = []
        for a, b in bounds(buf.numel(), world_size):
            part = buf[a:b]
            if part.numel() == 0:
                out.append(None)
            elif bool((part == part[0]).all()):
                value = int(part[0])
                out.append(tuple(r for r in range(world_size) if value >> r & 1) if value >= 0 else "?")
            else:
                out.append("mixed")
        return out
    return summary


def _cell(chunks) -> str:
    shown = []
    for c, owners in enumerate(chunks):
        if not owners:
            text = "-"
        elif isinstance(owners, str):
            text = owners
        else:
            text = "all" if len(owners) == len(chunks) > 1 else "+".join(map(str, owners))
        shown.append(f"c{c}:{text}")
    return " ".join(shown)


def step_table(snapshots: Dict[int, list], world_size: int) -> str:
    """Rows: the start, then each step; columns: ranks; each cell: which ranks' data each chunk
    holds (snapshots from simulate(..., watch=chunk_sets(world_size)))."""
    from tabulate import tabulate

    rows = []
    for k in range(max(len(s) for s in snapshots.values())):
        row = ["start" if k == 0 else f"after step {k - 1}"]
        for r in range(world_size):
            taken = snapshots[r]
            row.append(_cell(taken[k]) if k < len(taken) else "(done)")
        rows.append(row)
    return tabulate(rows, headers=["", *[f"rank {r}" for r in range(world_size)]])


def chrome_trace_events(messages, computes=(), pid: int = 0) -> list:
    """Each message as a slice on its sender's and its receiver's row, joined by an arrow; each
    local reduction as a slice. Times in microseconds."""
    events = []
    for i, m in enumerate(messages):
        name = f"chunk {m.chunk} ({m.nbytes} B)"
        start, dur = m.start * 1e6, max(0.001, (m.end - m.start) * 1e6)
        args = {"step": m.step, "src": m.src, "dst": m.dst, "bytes": m.nbytes, "chunk": str(m.chunk)}
        events.append({"name": f"send {name} -> {m.dst}", "ph": "X", "ts": start, "dur": dur, "pid": pid,
                       "tid": m.src, "args": args})
        events.append({"name": f"recv {name} <- {m.src}", "ph": "X", "ts": start, "dur": dur, "pid": pid,
                       "tid": m.dst, "args": args})
        events.append({"name": "message", "cat": "message", "ph": "s", "id": i, "ts": start, "pid": pid, "tid": m.src})
        events.append({"name": "message", "cat": "message", "ph": "f", "bp": "e", "id": i, "ts": start + dur,
                       "pid": pid, "tid": m.dst})
    for c in computes:
        events.append({"name": f"reduce {c.nbytes} B", "ph": "X", "ts": c.start * 1e6,
                       "dur": max(0.001, (c.end - c.start) * 1e6), "pid": pid, "tid": c.rank, "args": {"step": c.step}})
    ranks = sorted({m.src for m in messages} | {m.dst for m in messages} | {c.rank for c in computes})
    events += [{"name": "thread_name", "ph": "M", "pid": pid, "tid": r, "args": {"name": f"rank {r}"}} for r in ranks]
    return events


def write_chrome_trace(messages, computes, path: str) -> None:
    write_json(path, {"traceEvents": chrome_trace_events(messages, computes), "displayTimeUnit": "ns"}, None, None)


def plot_spacetime(messages, computes, world_size: int, path: str, title: str = "", predicted: Optional[float] = None):
    """Ranks as rows, time across; each message an arrow from its sender (when it left) to its
    receiver (when it arrived), coloured by step; local reductions as bars on their rank's row."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scale, unit = _time_unit(max([m.end for m in messages] + [c.end for c in computes] + [1e-9]))
    fig, ax = plt.subplots(figsize=(10, 1.2 + 0.45 * world_size))
    steps = max([m.step for m in messages] + [0]) + 1
    cmap = plt.get_cmap("viridis", max(steps, 2))
    for m in messages:
        ax.annotate("", xy=(m.end * scale, m.dst), xytext=(m.start * scale, m.src),
                    arrowprops={"arrowstyle": "->", "color": cmap(m.step), "lw": 1.2, "alpha": 0.85})
    for c in computes:
        ax.plot([c.start * scale, c.end * scale], [c.rank, c.rank], color="tab:red", lw=5, solid_capstyle="butt")
    if predicted:
        ax.axvline(predicted * scale, color="black", linestyle="--", lw=1, label="closed-form prediction")
        ax.legend(loc="upper right", fontsize=8)
    right = max([m.end for m in messages] + [c.end for c in computes] + [predicted or 0, 1e-9]) * scale
    ax.set_xlim(0, right * 1.03)
    ax.set_yticks(range(world_size), [f"rank {r}" for r in range(world_size)])
    ax.set_ylim(world_size - 0.5, -0.5)
    ax.set_xlabel(f"time ({unit})   arrows: messages, coloured by step; red bars: local reductions")
    ax.set_title(title, fontsize=10)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    save_figure(fig, path, None, dpi=110)
    plt.close(fig)


def _time_unit(seconds: float):
    for scale, unit in ((1e6, "us"), (1e3, "ms")):
        if seconds * scale < 10_000:
            return scale, unit
    return 1.0, "s"


def message_summary(messages: Sequence) -> str:
    steps = max([m.step for m in messages] + [-1]) + 1
    total = sum(m.nbytes for m in messages)
    return f"{len(messages)} messages in {steps} step(s), {total} bytes in all"
