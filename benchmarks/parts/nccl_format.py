"""nccl-tests' table: columns, bus-bandwidth factors, formatting, and a parser that reads it back.

The meanings follow NVIDIA's nccl-tests (doc/PERFORMANCE.md there):
  size   bytes of the full buffer per rank (all_gather: the gathered output; reduce_scatter: the
         input before scattering; all_to_all: the send buffer)
  count  elements of that buffer
  algbw  size / time, in GB/s with 1 GB = 1e9 bytes
  busbw  algbw x a factor that makes collectives comparable with the hardware's link speed:
         all_reduce 2(n-1)/n; all_gather, reduce_scatter, all_to_all (n-1)/n; broadcast, reduce,
         sendrecv 1
"""

from __future__ import annotations

import re
from typing import Dict, List, Optional

BUS_FACTORS = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "reduce": lambda n: 1.0,
    "sendrecv": lambda n: 1.0,
}
# nccl-tests' names for torch dtypes
TYPE_NAMES = {
    "float32": "float", "float64": "double", "float16": "half", "bfloat16": "bfloat16",
    "int8": "int8", "uint8": "uint8", "int32": "int32", "int64": "int64",
}
SIDES = ("oop", "ip")  # out-of-place, in-place


def bus_factor(collective: str, world_size: int) -> float:
    """busbw / algbw for the collective on world_size ranks."""
    return BUS_FACTORS[collective](world_size)


def bandwidths(size_bytes: int, time_us: float, collective: str, world_size: int):
    """(algbw, busbw) in GB/s (1e9 bytes) for a buffer of size_bytes moved in time_us."""
    algbw = size_bytes / (time_us * 1e-6) / 1e9 if time_us > 0 else 0.0
    return algbw, algbw * bus_factor(collective, world_size)


def _side_cols(with_limit: bool, with_spread: bool = False) -> List[str]:
    return ["time"] + (["spread"] if with_spread else []) + ["algbw", "busbw"] + (["%limit"] if with_limit else []) \
        + ["#wrong"]


def size_label(nbytes: int) -> str:
    """Bytes with a binary prefix, exact where the size is a whole number of its unit: 8 B,
    1 KiB, 64 MiB (else one decimal: 1.5 KiB)."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift:
            value = nbytes / (1 << shift)
            return f"{value:.0f} {unit}" if value == int(value) else f"{value:.1f} {unit}"
    return f"{nbytes} B"


def spread_pct(side: Dict) -> Optional[float]:
    """Half the range of a cell's per-round times, in % of its median (None: one round)."""
    rounds = side.get("rounds_us") or []
    if len(rounds) < 2 or not side.get("time_us"):
        return None
    return 50 * (max(rounds) - min(rounds)) / side["time_us"]


WIDTH = 9  # every cell: a space, then the value right-aligned in 8 characters (or more: never merged)
LEAD = [("size", "(B)", 12), ("count", "(elements)", 14), ("type", "", 10), ("redop", "", 8), ("root", "", 8)]


def _cell(text: str, width: int = WIDTH) -> str:
    """One column: always at least one space before the value, however long the value is."""
    return " " + text.rjust(width - 1)


def format_time(time_us: float) -> str:
    """Microseconds in at most 8 characters where possible: fewer decimals as the value grows
    (nccl-tests also switches format for large times), so 132366.16 us prints as 132366.2."""
    for digits in (2, 1, 0):
        text = f"{time_us:.{digits}f}"
        if len(text) <= WIDTH - 1:
            return text
    return text


def header(with_limit: bool, with_spread: bool = False) -> str:
    cols = _side_cols(with_limit, with_spread)
    width = WIDTH * len(cols)
    lead = sum(w for *_, w in LEAD)
    line1 = "#" + " " * (lead - 1) + f"{'out-of-place':^{width}}" + f"{'in-place':^{width}}"
    names = "".join(_cell(c) for c in cols)
    line2 = "#" + "".join(_cell(name, w) for name, _, w in LEAD)[1:] + names + names
    units = {"time": "(us)", "spread": "(+-%)", "algbw": "(GB/s)", "busbw": "(GB/s)", "%limit": "", "#wrong": ""}
    unit_cols = "".join(_cell(units[c]) for c in cols)
    line3 = "#" + "".join(_cell(unit, w) for _, unit, w in LEAD)[1:] + unit_cols + unit_cols
    return "\n".join([line1, line2, line3])


def _fmt_side(side: Optional[Dict], with_limit: bool, with_spread: bool = False) -> str:
    n = len(_side_cols(with_limit, with_spread))
    if side is None:
        return "".join(_cell("N/A") for _ in range(n))
    cells = [format_time(side["time_us"])]
    if with_spread:
        spread = spread_pct(side)
        cells.append("N/A" if spread is None else f"{spread:.1f}")
    cells += [f"{side['algbw']:.2f}", f"{side['busbw']:.2f}"]
    if with_limit:
        cells.append(f"{side['limit_pct']:.1f}%" if side.get("limit_pct") is not None else "N/A")
    wrong = side.get("wrong")
    cells.append("N/A" if wrong is None else str(wrong))
    return "".join(_cell(c) for c in cells)


def format_row(row: Dict, with_limit: bool, with_spread: bool = False) -> str:
    """One table line; row has size, count, type, redop, root, and oop/ip dicts (or None: N/A)."""
    values = [str(row["size"]), str(row["count"]), row["type"], row["redop"], str(row["root"])]
    lead = "".join(_cell(v, w) for v, (_, _, w) in zip(values, LEAD))
    return lead + "".join(_fmt_side(row.get(s), with_limit, with_spread) for s in SIDES)


def footer(rows: List[Dict]) -> str:
    wrong = sum((r[s] or {}).get("wrong") or 0 for r in rows for s in SIDES)
    busbws = [r[s]["busbw"] for r in rows for s in SIDES if r.get(s)]
    avg = sum(busbws) / len(busbws) if busbws else 0.0
    return (f"# Out of bounds values : {wrong} {'OK' if wrong == 0 else 'FAILED'}\n"
            f"# Avg bus bandwidth    : {avg:.6g}")


def parse_table(text: str) -> List[Dict]:
    """Read the data lines of a table written by format_row back into row dicts."""
    rows = []
    with_limit, with_spread = "%limit" in text, " spread " in text
    per_side = len(_side_cols(with_limit, with_spread))
    for line in text.splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        cells = line.split()
        if len(cells) != 5 + 2 * per_side or not re.fullmatch(r"\d+", cells[0]):
            continue
        row = {"size": int(cells[0]), "count": int(cells[1]), "type": cells[2], "redop": cells[3], "root": int(cells[4])}
        for k, side in enumerate(SIDES):
            part = cells[5 + k * per_side : 5 + (k + 1) * per_side]
            if all(c == "N/A" for c in part):
                row[side] = None
                continue
            values = dict(zip(_side_cols(with_limit, with_spread), part))
            parsed = {"time_us": float(values["time"]), "algbw": float(values["algbw"]), "busbw": float(values["busbw"]),
                      "wrong": None if values["#wrong"] == "N/A" else int(values["#wrong"])}
            if with_spread:
                parsed["spread_pct"] = None if values["spread"] == "N/A" else float(values["spread"])
            if with_limit:
                parsed["limit_pct"] = None if values["%limit"] == "N/A" else float(values["%limit"].rstrip("%"))
            row[side] = parsed
        rows.append(row)
    return rows
