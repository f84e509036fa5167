"""Link rates in tc's units ("1gbit", "100mbit"), read once for the cluster command, which
shapes links to them (cluster/hosts.py), and the simulator's two-level topology, which predicts times
over them (algorithms/topology.py), and the bytes a token bucket at a rate lets through at once.

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


BURST_SECONDS = 0.004  # a token bucket holds 4 ms of the rate (the kernel's tick at HZ=250)


def burst(rate: str) -> int:
    """Bytes a token bucket at `rate` may send at once: BURST_SECONDS of the rate, at least
    64 KiB. Measured across two hosts, torchrun 2 x 1 rank, Gloo all_reduce of 4-32 MiB: at
    4gbit a 64 KiB bucket let through 0.24-0.28 GB/s (about half the rate), 512 KiB or 2 MiB
    0.47-0.49 (94-98%); at 1gbit 64 KiB gave 0.11-0.12, as did 128 KiB."""
    return max(64 << 10, int(link_rate(rate) / 8 * BURST_SECONDS))


TBF_MAX_BURST = (1 << 32) - 1  # tc's tbf takes a burst of at most this many bytes (a 32-bit field)


def shapeable(rate: str) -> float:
    """link_rate(rate), or a ValueError when tc's token bucket cannot shape it (its burst, 4 ms of
    the rate, must fit in 32 bits: at most about 8589gbit)."""
    bits = link_rate(rate)
    if burst(rate) > TBF_MAX_BURST:
        top = TBF_MAX_BURST * 8 / BURST_SECONDS / 1e9
        raise ValueError(f"link rate {rate!r} is more than tc's token bucket can shape (at most {top:.0f}gbit: "
                         f"its burst, {BURST_SECONDS * 1e3:g} ms of the rate, must fit in 4 GiB)")
    return bits
