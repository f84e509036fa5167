"""How recursive doubling and halving fold a world that is not a power of two into one that is.
(The per-rank chunks of a buffer are collectives/chunks.py's.)

The fold (Thakur, Rabenseifner and Gropp 2005): recursive doubling and halving need a power of
two, p = the largest one <= size. The first 2 * (size - p) ranks pair up, (0, 1), (2, 3), ...;
in each pair the even rank hands its data to the odd one and sits out, leaving p ranks that
take virtual ranks 0..p-1. At the end the odd rank hands the result back.

    fold = Fold(size=6)   # p = 4: ranks 0, 2 sit out; 1, 3, 4, 5 are virtual ranks 0, 1, 2, 3
"""

from __future__ import annotations

from typing import List, Optional


def largest_power_of_two(n: int) -> int:
    return 1 << (n.bit_length() - 1)


class Fold:
    """Virtual ranks for a world folded down to a power of two (see the module docstring)."""

    def __init__(self, size: int):
        self.size = size
        self.p = largest_power_of_two(size)
        self.extra = size - self.p  # pairs that fold

    def sits_out(self, rank: int) -> bool:
        return rank < 2 * self.extra and rank % 2 == 0

    def partner(self, rank: int) -> Optional[int]:
        """The other rank of this rank's pair, or None for a rank that does not pair."""
        if rank >= 2 * self.extra:
            return None
        return rank + 1 if rank % 2 == 0 else rank - 1

    def virtual(self, rank: int) -> int:
        """This rank's virtual rank (0..p-1); -1 for a rank that sits out."""
        if self.sits_out(rank):
            return -1
        return rank // 2 if rank < 2 * self.extra else rank - self.extra

    def real(self, virtual: int) -> int:
        """The rank that plays `virtual`."""
        return 2 * virtual + 1 if virtual < self.extra else virtual + self.extra

    def members(self, virtual: int) -> List[int]:
        """The real ranks whose chunks `virtual` is responsible for (two for a folded pair)."""
        real = self.real(virtual)
        return [real - 1, real] if virtual < self.extra else [real]
