"""The shm backend's flight record: each call it is given, in torch's flight-recorder format, so
that collectives.flight_recorder and torch's own torchfrtrace read shm groups as they read Gloo's
and NCCL's (torch records those itself; it has no hook for a Python backend).

On by default on the native path (COLLECTIVES_SHM_PATH=native), keeping the last 2000 calls per
group (torch's default buffer on NCCL); TORCH_FR_BUFFER_SIZE sets another size, and 0 turns it
off. On the Python path, where an entry costs about a fifth of a small call, it is on only when
TORCH_FR_BUFFER_SIZE is set. Per group it keeps:
a sequence number per group (collectives and point-to-point counted apart, as torch counts
them), the op, input and output sizes and dtypes, the state (scheduled, started, completed),
the times and the caller's Python frames.

An entry names a call as Gloo's entries do (all_gather, reduce_scatter and all_to_all, whether of
one tensor or of lists) and gives one input and one output shape, as the native path records
them (native_recorder.h): a tensor's own shape, a list of tensors as their stack, [len, *shape of
the first] (Gloo's gathered outputs), no shape for no tensor (gather's outputs and scatter's
inputs off the root, barrier). So the same call gets the same entry on either path, and a group
whose ranks take different paths reads as one program.

    recorder = Recorder.from_env(2000)      # None when recording is off (TORCH_FR_BUFFER_SIZE=0)
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


def recorded_shapes(tensors) -> list:
    """The (shape, dtype) an entry gives for these tensors (see the top of this file): [] for none,
    one tensor's own, several as their stack."""
    flat = _flat(tensors)
    if not flat:
        return []
    first = flat[0]
    return [(tuple(first.shape) if len(flat) == 1 else (len(flat), *first.shape), first.dtype)]


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
        self._status = {"last_enqueued_collective": -1, "last_started_collective": -1,
                        "last_completed_collective": -1}
        # the native path's engine (forward.cpp), once the group has one: it records the calls it
        # runs itself (native_recorder.h), and the ids of every call come from its counters
        self.native = None

    @classmethod
    def from_env(cls, default: int = 0) -> Optional["Recorder"]:
        """TORCH_FR_BUFFER_SIZE entries (`default` where it is unset); None for 0."""
        size = settings.fr_buffer_size(default=default)
        return cls(size) if size > 0 else None

    @property
    def status(self) -> dict:
        """torch's pg_status: the last collective enqueued, started and completed, either path."""
        if self.native is None:
            return self._status
        native = dict(zip(("last_enqueued_collective", "last_started_collective", "last_completed_collective"),
                          self.native.recorder_status()))
        return {k: max(v, native[k]) for k, v in self._status.items()}

    def scheduled(self, op: str, inputs, outputs, p2p: bool = False) -> _Entry:
        """A new entry, in the calling thread (its frames are the caller's)."""
        e = _Entry()
        frames, f = [], sys._getframe(2)  # the caller's frames, innermost first; names read at dump time
        while f is not None and len(frames) < MAX_FRAMES:
            frames.append((f.f_code, f.f_lineno))
            f = f.f_back
        e.frames, e.op, e.p2p, e.created = frames, op, p2p, time.time_ns()
        e.inputs = recorded_shapes(inputs)
        e.outputs = e.inputs if outputs is inputs else recorded_shapes(outputs)
        e.state, e.started, e.completed, e.thread = "scheduled", None, None, threading.current_thread()
        with self._lock:
            if self.native is not None:  # one sequence with the native path's calls
                e.record_id, e.collective_seq_id, e.p2p_seq_id, e.op_id = self.native.next_ids(p2p)
            else:
                kind = "p2p" if p2p else "collective"
                self.seq[kind] += 1
                e.record_id = self.seq["collective"] + self.seq["p2p"] - 1
                e.collective_seq_id = 0 if p2p else self.seq["collective"]
                e.p2p_seq_id = self.seq["p2p"] if p2p else 0
                e.op_id = self.seq[kind]
            self._entries.append(e)
            if not p2p:
                self._status["last_enqueued_collective"] = e.collective_seq_id
        return e

    def started(self, e: _Entry) -> None:
        e.state, e.started = "started", time.time_ns()
        if not e.p2p:
            self._status["last_started_collective"] = e.collective_seq_id

    def completed(self, e: _Entry) -> None:
        e.state, e.completed = "completed", time.time_ns()
        if not e.p2p:
            self._status["last_completed_collective"] = e.collective_seq_id

    def entries(self, pg_id: int, process_group: tuple) -> List[Dict]:
        """torch's entry dicts, oldest first: this path's and the native path's, by record id,
        the last max_entries of them."""
        with self._lock:
            kept = list(self._entries)
        mine = self._dicts(kept, pg_id, process_group)
        if self.native is None:
            return mine
        both = sorted(mine + self._native_dicts(pg_id, process_group), key=lambda d: d["record_id"])
        return both[-self.max_entries:]

    def _native_dicts(self, pg_id: int, process_group: tuple) -> List[Dict]:
        """The native path's entries (native_recorder.h) as torch's dicts; no frames."""
        states = ("scheduled", "started", "completed")
        out = []
        for (record_id, seq, p2p_seq, op_id, op, created, started, completed, state, dtype, in_sizes, out_sizes,
             thread) in self.native.recorded():
            out.append({"record_id": record_id, "pg_id": pg_id, "process_group": process_group,
                        "thread_name": "shm native", "thread_id": str(thread), "collective_seq_id": seq,
                        "p2p_seq_id": p2p_seq, "op_id": op_id, "profiling_name": f"shm:{op}", "time_created_ns": created,
                        "input_sizes": [list(in_sizes)] if in_sizes is not None else [],
                        "input_dtypes": [_dtype_name(dtype)] if in_sizes is not None else [],
                        "output_sizes": [list(out_sizes)] if out_sizes is not None else [],
                        "output_dtypes": [_dtype_name(dtype)] if out_sizes is not None else [],
                        "state": states[state], "time_discovered_started_ns": started or None,
                        "time_discovered_completed_ns": completed or None, "retired": state == 2,
                        "timeout_ms": 0, "is_p2p": p2p_seq > 0, "frames": [], "collectives_path": "native"})
        return out

    @staticmethod
    def _dicts(kept, pg_id: int, process_group: tuple) -> List[Dict]:
        return [{"record_id": e.record_id, "pg_id": pg_id, "process_group": process_group,
                 "thread_name": e.thread.name, "thread_id": str(e.thread.ident),
                 "collective_seq_id": e.collective_seq_id, "p2p_seq_id": e.p2p_seq_id, "op_id": e.op_id,
                 "profiling_name": f"shm:{e.op}", "time_created_ns": e.created,
                 "input_sizes": [list(s) for s, _ in e.inputs], "input_dtypes": [_dtype_name(d) for _, d in e.inputs],
                 "output_sizes": [list(s) for s, _ in e.outputs],
                 "output_dtypes": [_dtype_name(d) for _, d in e.outputs], "state": e.state,
                 "time_discovered_started_ns": e.started, "time_discovered_completed_ns": e.completed,
                 "retired": e.state == "completed", "timeout_ms": 0, "is_p2p": e.p2p,
                 "frames": [{"name": c.co_name, "filename": c.co_filename, "line": line} for c, line in e.frames],
                 "collectives_path": "python"}
                for e in kept]
