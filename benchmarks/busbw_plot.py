"""busbw against size, one panel per collective, one line per result file (log-2 x axis): what
`python -m benchmarks.plot` and `python -m benchmarks.bandwidth --plot` draw. Needs matplotlib.
"""

from __future__ import annotations

import math
from typing import Dict, List


def plot_results(results: List[Dict], out_png: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(r["collective"] for res in results for r in res["rows"]))
    cols = min(3, len(names))
    rows = math.ceil(len(names) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 3.8 * rows), squeeze=False)
    for ax, name in zip(axes.flat, names):
        for res in results:
            env = res["environment"]
            label = f"{env['backend']} x{env['world_size']} {env['device']} {env['date']}"
            points = [(r["size"], (r["oop"] or r["ip"])["busbw"]) for r in res["rows"] if r["collective"] == name]
            if not points:
                continue
            line, = ax.plot(*zip(*points), marker="o", markersize=3, label=label)
            limit = (res.get("limits") or {}).get("p2p_gbps")
            if limit:
                ax.axhline(limit, linestyle="--", linewidth=0.8, color=line.get_color(), label=f"point-to-point {limit:.2f} GB/s")
        ax.set_xscale("log", base=2)
        ax.set_title(name)
        ax.set_xlabel("size (bytes)")
        ax.set_ylabel("busbw (GB/s)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(names):]:
        ax.set_visible(False)
    fig.tight_layout()
    fig.savefig(out_png, dpi=110)
    plt.close(fig)
