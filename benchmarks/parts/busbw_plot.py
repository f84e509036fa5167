"""The bandwidth figure: per collective, time per call (us) against size, log-log, and busbw
against size, log x, with the limit; one line per backend of each result file, a band for the
spread over rounds, sizes labelled in bytes with binary prefixes (8 B, 1 KiB, 1 MiB, 64 MiB).
What `python -m benchmarks.bandwidth --plot` and `python -m benchmarks.plot` draw. Needs
matplotlib.

    fig = figure(results)            # results: what benchmarks.bandwidth --json writes
    plot_results(results, "busbw.png")
"""

from __future__ import annotations

import math
from typing import Dict, List

from collectives import cli

from .nccl_format import size_label


def _series(res: Dict) -> List[Dict]:
    """One line per backend of a result: its label, and per collective the points (size, the
    cell, the reference's bandwidth at that size or None)."""
    env = res["environment"]
    backends = env.get("backends") or [env["backend"]]
    reference = {(r["backend"], r["size"]): r for r in res.get("reference") or []}
    flat_limit = (res.get("limits") or {}).get("p2p_gbps")  # files from before the per-size reference
    out = []
    for backend in backends:
        rows = [r for r in res["rows"] if r.get("backend", backend) == backend]
        points: Dict[str, list] = {}
        for r in rows:
            cell = r.get("ip") or r.get("oop")
            ref = reference.get((backend, r.get("requested", r["size"])))
            points.setdefault(r["collective"], []).append((r["size"], cell, ref["gbps"] if ref else flat_limit))
        kinds = {r.get("kind", "point-to-point") for (b, _), r in reference.items() if b == backend}
        out.append({"label": f"{backend} x{env['world_size']} {env['device']} {env['date']}", "points": points,
                    "limit": f"limit: {backend} {kinds.pop() if kinds else 'point-to-point'}"})
    return out


def _binary_axis(ax, sizes: List[int]) -> None:
    """Log-2 x axis with ticks labelled 8 B, 64 B, 1 KiB, ..., 64 MiB (about 8 of them)."""
    import matplotlib.ticker as ticker

    ax.set_xscale("log", base=2)
    low, high = int(math.log2(min(sizes))), int(math.ceil(math.log2(max(sizes))))
    span = high - low
    # within each power of 1024: every power of 2, every other, or 1, 8 and 64 of the unit
    offsets = range(10) if span <= 8 else (0, 2, 4, 6, 8) if span <= 16 else (0, 3, 6)
    exponents = [k for k in range(low, high + 1) if k % 10 in offsets]
    for end in (low, high):  # the sweep's ends, unless a tick sits next to them
        if all(abs(end - k) > 1 for k in exponents):
            exponents.append(end)
    ticks = [2 ** k for k in sorted(exponents)]
    ax.xaxis.set_major_locator(ticker.FixedLocator(ticks))
    ax.xaxis.set_major_formatter(ticker.FuncFormatter(lambda x, _pos: size_label(int(round(x)))))
    ax.xaxis.set_minor_locator(ticker.NullLocator())
    ax.set_xlabel("size")


def figure(results: List[Dict]):
    """A matplotlib Figure: a row per collective, time (left) and busbw (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = [s for res in results for s in _series(res)]
    names = list(dict.fromkeys(name for s in series for name in s["points"]))
    fig, axes = plt.subplots(len(names), 2, figsize=(11, 3.4 * len(names)), squeeze=False)
    for (ax_time, ax_bw), name in zip(axes, names):
        sizes, top = [], 0.0
        for s in series:
            points = s["points"].get(name)
            if not points:
                continue
            x = [size for size, _, _ in points]
            sizes += x
            t = [cell["time_us"] for _, cell, _ in points]
            line, = ax_time.plot(x, t, marker="o", markersize=3, label=s["label"])
            color = line.get_color()
            ax_bw.plot(x, [cell["busbw"] for _, cell, _ in points], marker="o", markersize=3, color=color,
                       label=s["label"])
            if all("time_us_min" in cell for _, cell, _ in points):
                low = [cell["time_us_min"] for _, cell, _ in points]
                high = [cell["time_us_max"] for _, cell, _ in points]
                ax_time.fill_between(x, low, high, color=color, alpha=0.2, linewidth=0)
                ax_bw.fill_between(x, [c["busbw"] * c["time_us"] / c["time_us_max"] for _, c, _ in points],
                                   [c["busbw"] * c["time_us"] / c["time_us_min"] for _, c, _ in points],
                                   color=color, alpha=0.2, linewidth=0)
            limits = [(size, ref) for size, _, ref in points if ref]
            if limits:
                ax_bw.plot(*zip(*limits), linestyle="--", linewidth=0.9, color=color,
                           label=f"{s['limit']} (at most {max(ref for _, ref in limits):.3g} GB/s)")
            top = max(top, max(c["busbw"] * c["time_us"] / c.get("time_us_min", c["time_us"]) for _, c, _ in points))
        for ax in (ax_time, ax_bw):
            _binary_axis(ax, sizes)
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=7)
        if top > 0:  # the data fill the panel; a limit far above runs off it (its top is in the legend)
            ax_bw.set_ylim(0, 1.35 * top)
        ax_time.set_yscale("log")
        ax_time.set_title(f"{name}: time per call")
        ax_time.set_ylabel("time (us)")
        ax_bw.set_title(f"{name}: bus bandwidth")
        ax_bw.set_ylabel("busbw (GB/s)")
    fig.tight_layout()
    return fig


def plot_results(results: List[Dict], out_png: str, flag: str = "--plot") -> None:
    import matplotlib.pyplot as plt

    fig = figure(results)
    cli.save_figure(fig, out_png, flag, dpi=100)
    plt.close(fig)
