"""The call words: what each rank writes before a collective, so that every rank can check that
all of them called the same one (kind, op, root, dtype, element count), and the words and the
error both paths use when they do not (python_path.py in Python, the engine in C++ through the
tables native_setup.py hands it).

    words = (kind index + 1 | op index << 4 | root + 1 << 8, DTYPE_CODES[dtype], low, high of numel)
    disagreement("all_reduce", rank, every_ranks_words)   # the error's text, naming each rank's call

ShmArgumentError is a raw call refused for this rank's own arguments (after the call's first
barrier, so no peer waits for this rank); its dtype word is REFUSED.
"""

from __future__ import annotations

import struct

import torch

from ..errors import CollectiveError
from ..names import COLLECTIVES
from .segment import CALL_WORDS

KINDS = COLLECTIVES + ("monitored_barrier",)  # what a rank notes it is in (its call words, below)
OPS = ("", "sum", "product", "min", "max", "band", "bor", "bxor")
DTYPES = sorted({v for v in vars(torch).values() if isinstance(v, torch.dtype)}, key=str)
DTYPE_CODES = {d: i for i, d in enumerate(DTYPES)}
CALL_STRUCT = struct.Struct(f"{CALL_WORDS}i")  # one rank's call: kind | op | root, dtype, numel (two words)
REFUSED = -2  # the dtype word of a call that this rank's own argument checks refused (ShmCollectives.refuse)


class ShmArgumentError(CollectiveError):
    """A raw torch.distributed call on an shm group whose arguments are wrong on this rank (an
    output of the wrong size, length or dtype). Raised before any byte moves, after meeting the
    other ranks at the call's first barrier, so none of them waits for this one and the group
    stays usable."""


def _describe(words) -> str:
    """One rank's call from its words: "all_reduce of 3 float32 (sum)", "broadcast of 4 int64 from rank 0"."""
    head, dtype, low, high = words
    kind, op, root = KINDS[(head & 15) - 1], OPS[(head >> 4) & 15], (head >> 8) - 1
    if dtype == REFUSED:  # before the kinds that carry no arguments: all_to_all is refused too
        return f"{kind} with arguments that rank refused"
    if kind in ("barrier", "monitored_barrier", "all_to_all"):  # no one dtype and count to compare
        return kind
    text = f"{kind} of {high << 31 | low} {str(DTYPES[dtype]).replace('torch.', '')}"
    if op:
        text += f" ({op})"
    if root >= 0:
        text += f" {'to' if kind in ('reduce', 'gather') else 'from'} rank {root}"
    return text


def disagreement(what: str, rank: int, bank) -> str:
    """The error's text: each distinct call with the ranks that made it (the first 8 of them)."""
    calls: dict = {}
    for q, words in enumerate(bank):
        calls.setdefault(_describe(words), []).append(q)
    said = "; ".join(f"rank{'s' if len(qs) > 1 else ''} {', '.join(map(str, qs))}: {call}"
                     for call, qs in list(calls.items())[:8]) + ("; ..." if len(calls) > 8 else "")
    return (f"{what} on rank {rank} of the shm group: the ranks called different collectives or disagree on "
            f"the arguments ({said}); none of them ran it, and the group is still usable")
