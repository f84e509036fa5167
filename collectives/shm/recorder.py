"""The shm backend's flight record: each call it is given, in torch's flight-recorder format, so
that collectives.flight_recorder and torch's own torchfrtrace read shm groups as they read Gloo's
and NCCL's (torch records those itself; it has no hook for a Python backend).

On when TORCH_FR_BUFFER_SIZE is set (as torch's is), keeping the last that many calls per group:
a sequence number per group (collectives and point-to-point counted apart, as torch counts
them), the op, input and output sizes and dtypes, the state (scheduled, started, completed),
the times and the caller's Python frames.

    recorder = Recorder.from_env()          # None when recording is off
    entry = recorder.scheduled("all_reduce", inputs, outputs)
    recorder.started(entry); recorder.completed(entry)
    recorder.entries(pg_id, (name, desc))   # torch's entry dicts, oldest first
"""

from __future__ import annotations

import collections
import functools
import threading
import sys
import time
from typing import Dict, List, Optional

import torch

from collectives import settings

MAX_FRAMES = 24
@functools.lru_cache(maxsize=None)
def _dtype_name(dtype) -> str:
    """torch's name for a dtype in its dumps ("Float", "BFloat16", "Long"): its tensor type's."""
    return torch.empty(0, dtype=dtype).type().replace("torch.", "").removesuffix("Tensor")


def _flat(tensors) -> list:
    out = []
    for t in tensors or []:
        out += _flat(t) if isinstance(t, (list, tuple)) else [t]
    return out


class _Entry:
    """One call, kept compact: it becomes torch's entry dict only when the record is dumped."""

    __slots__ = ("record_id", "collective_seq_id", "p2p_seq_id", "op_id", "op", "created", "inputs", "outputs",
                 "state", "started", "completed", "p2p", "frames", "thread")


class Recorder:
    def __init__(self, max_entries: int):
        self.max_entries = max_entries
        self._entries: collections.deque = collections.deque(maxlen=max_entries)
        self._lock = threading.Lock()
        self.seq = {"collective": 0, "p2p": 0}
        self.status = {"last_enqueued_collective": -1, "last_started_collective": -1,
                       "last_completed_collective": -1}

    @classmethod
    def from_env(cls) -> Optional["Recorder"]:
        size = settings.fr_buffer_size()
        return cls(size) if size > 0 else None

    def scheduled(self, op: str, inputs, outputs, p2p: bool = False) -> _Entry:
        """A new entry, in the calling thread (its frames are the caller's)."""
        e = _Entry()
        frames, f = [], sys._getframe(2)  # the caller's frames, innermost first; names read at dump time
        while f is not None and len(frames) < MAX_FRAMES:
            frames.append((f.f_code, f.f_lineno))
            f = f.f_back
        e.frames, e.op, e.p2p, e.created = frames, op, p2p, time.time_ns()
        e.inputs = [(t.shape, t.dtype) for t in _flat(inputs)]
        e.outputs = e.inputs if outputs is inputs else [(t.shape, t.dtype) for t in _flat(outputs)]
        e.state, e.started, e.completed, e.thread = "scheduled", None, None, threading.current_thread()
        with self._lock:
            kind = "p2p" if p2p else "collective"
            self.seq[kind] += 1
            e.record_id = self.seq["collective"] + self.seq["p2p"] - 1
            e.collective_seq_id = 0 if p2p else self.seq["collective"]
            e.p2p_seq_id = self.seq["p2p"] if p2p else 0
            e.op_id = self.seq[kind]
            self._entries.append(e)
            if not p2p:
                self.status["last_enqueued_collective"] = e.collective_seq_id
        return e

    def started(self, e: _Entry) -> None:
        e.state, e.started = "started", time.time_ns()
        if not e.p2p:
            self.status["last_started_collective"] = e.collective_seq_id

    def completed(self, e: _Entry) -> None:
        e.state, e.completed = "completed", time.time_ns()
        if not e.p2p:
            self.status["last_completed_collective"] = e.collective_seq_id

    def entries(self, pg_id: int, process_group: tuple) -> List[Dict]:
        """torch's entry dicts, oldest first."""
        with self._lock:
            kept = list(self._entries)
        return [{"record_id": e.record_id, "pg_id": pg_id, "process_group": process_group,
                 "thread_name": e.thread.name, "thread_id": str(e.thread.ident),
                 "collective_seq_id": e.collective_seq_id, "p2p_seq_id": e.p2p_seq_id, "op_id": e.op_id,
                 "profiling_name": f"shm:{e.op}", "time_created_ns": e.created,
                 "input_sizes": [list(s) for s, _ in e.inputs], "input_dtypes": [_dtype_name(d) for _, d in e.inputs],
                 "output_sizes": [list(s) for s, _ in e.outputs],
                 "output_dtypes": [_dtype_name(d) for _, d in e.outputs], "state": e.state,
                 "time_discovered_started_ns": e.started, "time_discovered_completed_ns": e.completed,
                 "retired": e.state == "completed", "timeout_ms": 0, "is_p2p": e.p2p,
                 "frames": [{"name": c.co_name, "filename": c.co_filename, "line": line} for c, line in e.frames]}
                for e in kept]
