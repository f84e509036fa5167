"""Link rates in tc's units ("1gbit", "100mbit"), read once for the cluster command, which
shapes links to them (cluster.py), and the simulator's two-level topology, which predicts times
over them (algorithms/topology.py).

    >>> link_rate("2.5gbit")
    2500000000.0
"""

from __future__ import annotations

import re

_UNITS = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}


def link_rate(rate: str) -> float:
    """Bits per second of a rate in tc's units: "1gbit", "100mbit", "2.5gbit", "800kbit"."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kmgt]?)bit\s*", rate.lower())
    if not match or float(match.group(1)) <= 0:
        raise ValueError(f"link rate {rate!r} is not one: a positive number and a unit, as tc writes them "
                         "(100mbit, 1gbit, 2.5gbit)")
    return float(match.group(1)) * _UNITS[match.group(2)]
