"""What a group's native engine (forward.cpp: native_engine.h) is handed when it is made, and how
its errors become the Python path's exceptions.

    engine = native.load().make_engine(setup(state), error_maker(rank, size))   # state: the group's GroupState

setup(state) is a dict: where the segment's control words are and their layout (segment.py), the
group's settings, the counters the Python side has reached so far (a group's first barriers run in
Python: the cross-memory-attach probe), and the tables of python_path.py the engine writes its call words
with (dtype codes, kind codes) and which (op, dtype) pairs it reduces itself: the ops every backend
allows on the dtype (reduce_ops.check_op_dtype) that torch computes in the dtype itself. Every
other call, or dtype, goes to the Python path.
"""

from __future__ import annotations

import torch

from .. import reduce_ops
from ..dtypes import arithmetic_widening
from ..errors import CollectiveError, CollectiveMismatchError
from .protocol import DTYPE_CODES, KINDS, OPS, ShmArgumentError, disagreement
from .segment import (ABORT, ABORT_SEEN_BY, ABORT_WHY, CALL0, CALL_WORDS, CONTROL_BYTES, MAIL_SENT0, MAIL_TAKEN0, PID0,
                      SLEEP0, STEP0)
from .wait import SPIN_S_OWN_CORE, PeerFailure

NATIVE_KINDS = ("broadcast", "all_reduce", "reduce", "all_gather", "reduce_scatter", "barrier", "gather", "scatter",
                "all_to_all", "monitored_barrier")  # native_engine.h's Kind order
# the dtypes the native path moves, and (with an op) reduces; others take the Python path
_REDUCED = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.complex64, torch.complex128,
            torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64, torch.bool)
NATIVE_DTYPES = _REDUCED + tuple(getattr(torch, n) for n in ("uint16", "uint32", "uint64", "float8_e4m3fn",
                                                            "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
                                 if hasattr(torch, n))
WAITS = ("futex", "spin", "yield", "sleep")  # native_wait.h's Strategy order


def reducible() -> list:
    """(op index in ops.OPS, dtype) pairs the native path reduces itself."""
    pairs = []
    for index, op in enumerate(OPS[1:], start=1):
        for dtype in _REDUCED:
            try:
                reduce_ops.check_op_dtype(op, dtype, "all_reduce")
            except CollectiveError:
                continue
            if arithmetic_widening(dtype, op) is None:
                pairs.append((index, dtype))
    return pairs


def setup(state) -> dict:
    """What the engine of a group needs, from its state (state.GroupState)."""
    seg, shm, waiter = state.segment, state.collectives, state.waiter
    return {
        "control": seg.control.ctypes.data, "step0": STEP0, "pid0": PID0, "sleep0": SLEEP0, "call0": CALL0,
        "call_words": CALL_WORDS, "abort": ABORT, "abort_seen_by": ABORT_SEEN_BY, "abort_why": ABORT_WHY,
        "control_bytes": CONTROL_BYTES, "slot_bytes": seg.slot_bytes, "half_bytes": shm.half, "regions": shm.regions, "piece_bytes": shm.piece_bytes,
        "small_bytes": shm.small, "rank": state.rank, "size": state.size,
        "strategy": WAITS.index(waiter.strategy), "timeout_s": waiter.timeout_s,
        # the native wait reads the machine (native_wait.h), so it may spin whatever the rank count
        # the pair mailboxes for send and recv (native_p2p.h); none past 64 ranks
        "mail": seg.mail.data_ptr() if seg.mail is not None else 0, "mailbox_bytes": seg.mailbox_bytes,
        "mail_sent0": MAIL_SENT0, "mail_taken0": MAIL_TAKEN0,
        "spin_s_idle": SPIN_S_OWN_CORE, "cores": state.cores, "inline_bytes": state.config.inline_bytes,
        "worker_nice": state.config.worker_nice,
        "cma_min_bytes": shm.cma_min_bytes if shm.cma is not None else -1,
        "round": shm.round, "calls": shm.calls, "step": waiter.step,
        "dtype_codes": [(d, DTYPE_CODES[d]) for d in NATIVE_DTYPES],
        "reducible": reducible(),
        "kind_codes": [KINDS.index(k) + 1 for k in NATIVE_KINDS],
        "recorder_entries": state.recorder.max_entries if state.recorder is not None else 0,
    }


def error_maker(rank: int, size: int):
    """make_error(kind, text, what, bank): the Python exception a failed native call raises, the
    Python path's own (kind 0: PeerFailure, 1: CollectiveMismatchError from every rank's call
    words, 2: ShmArgumentError, 3: CollectiveMismatchError with the engine's text)."""
    def make_error(kind: int, text: str, what: str, bank):
        if kind == 1:
            calls = [tuple(bank[4 * q:4 * q + 4]) for q in range(size)]
            return CollectiveMismatchError(disagreement(what, rank, calls))
        if kind == 3:  # a disagreement the engine described itself (all_to_all's splits)
            return CollectiveMismatchError(text)
        return ShmArgumentError(text) if kind == 2 else PeerFailure(text)
    return make_error
