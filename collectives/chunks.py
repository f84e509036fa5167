"""How a buffer is cut into one chunk per rank: the one rule the from-scratch algorithms
(collectives/algorithms/) and the shm backend (collectives/shm/) both use.

A buffer of `numel` elements has one chunk per rank; the first numel % size chunks are one
element longer, so any element count works (chunks may be empty when numel < size).

    bounds(10, 4) -> [(0, 3), (3, 6), (6, 8), (8, 10)]
"""

from __future__ import annotations

from typing import List, Tuple


def bounds(numel: int, size: int) -> List[Tuple[int, int]]:
    """(start, end) of each rank's chunk of a buffer of `numel` elements."""
    base, extra = divmod(numel, size)
    out, start = [], 0
    for r in range(size):
        end = start + base + (1 if r < extra else 0)
        out.append((start, end))
        start = end
    return out
