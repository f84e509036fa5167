"""What a bandwidth run says besides its tables: the limit each collective is held against, %limit
from the point-to-point reference at the same size, which backend is faster over which sizes (with
the ratio), and every busbw past its limit named with why.

    add_limits(rows, reference)               # each side's limit_pct, from the reference at its size
    for line in faster_by_size(rows, backends) + over_limit(rows, reference): print(line)

The limit: busbw (nccl-tests' convention) scales each collective's algbw to the bytes one rank's
link must carry, so that one figure applies to all of them; the most a link carries is what one
message of the same size moves from rank 0 to rank 1 on the same backend, measured in the same
rounds as the collectives. On shm the link is memory (its point-to-point messages go through a
mailbox in pieces, slower than its collectives), so there the reference is one memory copy of
the same size. A reference taken once, at the largest size, is no limit: at sizes that stay in
cache the link is faster than at 64 MiB.
"""

from __future__ import annotations

import math
import statistics
from typing import Dict, List, Optional, Tuple

from .nccl_format import SIDES, size_label

# What busbw counts, per collective: the bytes the busiest rank's link carries for one call
LINK_BYTES = {
    "all_reduce": "2(n-1)/n of the buffer, sent and received by every rank (reduce-scatter, then all-gather)",
    "all_gather": "(n-1)/n of the output, received by every rank",
    "reduce_scatter": "(n-1)/n of the input, sent by every rank",
    "all_to_all": "(n-1)/n of the send buffer, sent and received by every rank",
    "broadcast": "the whole buffer, sent by the root",
    "reduce": "the whole buffer, received by the root",
    "sendrecv": "the whole buffer, sent by every rank to the next and received from the one before",
}
DUPLEX = {"all_reduce", "all_to_all", "all_gather", "reduce_scatter", "sendrecv"}  # every rank sends and receives at once


REFERENCES = {
    "point-to-point": "one point-to-point message of the same size (rank 0 -> 1, same backend, same rounds)",
    "copy": "one memory copy of the same size (the path the data takes on shm or one rank; same rounds)",
}


def limit_line(collective: str, kind: str) -> str:
    return f"# limit: busbw counts {LINK_BYTES[collective]}; held against {REFERENCES[kind]}"


def side_of(row: Dict) -> Optional[Dict]:
    """The side a summary reads: in place where torch has it, else out of place (as the plot)."""
    return row.get("ip") or row.get("oop")


def _reference(reference: List[Dict]) -> Dict[Tuple[str, int], Dict]:
    return {(r["backend"], r["size"]): r for r in reference}


def add_limits(rows: List[Dict], reference: List[Dict]) -> None:
    """Each measured side's limit_pct: its busbw against the reference's bandwidth at its size."""
    by_size = _reference(reference)
    for row in rows:
        ref = by_size.get((row.get("backend"), row.get("requested", row["size"])))
        for side in SIDES:
            if row.get(side):
                row[side]["limit_pct"] = 100 * row[side]["busbw"] / ref["gbps"] if ref and ref["gbps"] else None


def _ratio(a: Dict, b: Dict) -> float:
    """The median over rounds of a's time / b's in the same round, taken on the ratios' logarithms
    so that b's over a's is its reciprocal: with an even count of rounds the plain median of
    [0.5, 2] and of [2, 0.5] is 1.25 both ways, and each backend read as the slower one."""
    pairs = list(zip(a.get("rounds_us") or [], b.get("rounds_us") or []))
    if not pairs:
        return a["time_us"] / b["time_us"]
    return math.exp(statistics.median(math.log(x / y) for x, y in pairs))


def faster_by_size(rows: List[Dict], backends: List[str]) -> List[str]:
    """Per collective, the faster backend over each run of sizes where it stays the faster one,
    with its time as a fraction of the next one's: the median over rounds of the ratio within a
    round (the backends ran the cell back to back, so a slow spell moves both)."""
    if len(backends) < 2:
        return []
    lines = ["# faster backend, by size (in place where torch has it; ratio: its time / the other's, median "
             "over rounds)"]
    for collective in dict.fromkeys(r["collective"] for r in rows):
        by_backend = {b: {r["size"]: side_of(r) for r in rows if r["collective"] == collective and r["backend"] == b}
                      for b in backends}
        sizes = sorted(by_backend[backends[0]])
        runs: List[list] = []  # [winner, other, first size, last size, ratios]
        for size in sizes:
            cells = {b: by_backend[b].get(size) for b in backends}
            if any(c is None for c in cells.values()):
                continue
            ranked = sorted(backends, key=lambda b: cells[b]["time_us"])
            winner, other = ranked[0], ranked[1]
            ratio = _ratio(cells[winner], cells[other])
            if ratio > 1:  # the medians and the rounds' ratios disagree: the rounds, paired, decide
                winner, other, ratio = other, winner, _ratio(cells[other], cells[winner])
            if runs and runs[-1][0] == winner and runs[-1][1] == other:
                runs[-1][3] = size
                runs[-1][4].append(ratio)
            else:
                runs.append([winner, other, size, size, [ratio]])
        parts = []
        for winner, other, first, last, ratios in runs:
            where = size_label(first) if first == last else f"{size_label(first)}-{size_label(last)}"
            span = f"{min(ratios):.2f}x" if len(ratios) == 1 else f"{min(ratios):.2f}x-{max(ratios):.2f}x"
            parts.append(f"{winner} at {where} ({span} {other}'s time)")
        lines.append(f"#   {collective}: " + "; ".join(parts))
    return lines


def over_limit(rows: List[Dict], reference: List[Dict]) -> List[str]:
    """One line per backend and collective whose busbw passes its limit somewhere: the sizes, the
    most it passes by, and why: within the rounds' spread (the two ranges overlap), or a reason
    that holds for the collective (both directions at once, which the one-way reference does not
    use)."""
    by_size = _reference(reference)
    lines = []
    groups: Dict[Tuple[str, str], List[Tuple[int, float, bool]]] = {}
    for row in rows:
        cell = side_of(row)
        if not cell or cell.get("limit_pct") is None or cell["limit_pct"] <= 100:
            continue
        ref = by_size[(row["backend"], row.get("requested", row["size"]))]
        # the best busbw the rounds saw against the slowest reference round: overlapping ranges
        within = cell["busbw"] * cell["time_us"] / cell["time_us_max"] <= \
            ref["gbps"] * ref["time_us"] / min(ref["rounds_us"])
        groups.setdefault((row["backend"], row["collective"]), []).append((row["size"], cell["limit_pct"], within))
    for (backend, collective), cells in groups.items():
        sizes = ", ".join(size_label(s) for s, _, _ in cells)
        most = max(p for _, p, _ in cells)
        noisy = [s for s, _, w in cells if w]
        why = []
        if noisy:
            why.append(f"{'all' if len(noisy) == len(cells) else len(noisy)} within the rounds' spread (the slowest "
                       "round of the collective is under the fastest of the reference)")
        if len(noisy) < len(cells):
            why.append("every rank sends and receives at once, both directions of each link, where the reference "
                       "sends one way" if collective in DUPLEX else
                       "the collective's data takes another path than the reference's on this backend")
        lines.append(f"# over the limit: {backend} {collective} at {sizes} (up to {most:.0f}%): " + "; ".join(why))
    return lines
