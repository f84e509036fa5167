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
import os
import threading
import time
import traceback
from typing import Dict, List, Optional

# torch's names for dtypes in its dumps ("Float", not "float32")
_DTYPE_NAMES = {"float32": "Float", "float64": "Double", "float16": "Half", "bfloat16": "BFloat16", "int64": "Long",
                "int32": "Int", "int16": "Short", "int8": "Char", "uint8": "Byte", "bool": "Bool",
                "complex64": "ComplexFloat", "complex128": "ComplexDouble"}


def _dtype_name(t) -> str:
    name = str(t.dtype).replace("torch.", "")
    return _DTYPE_NAMES.get(name, name)


def _flat(tensors) -> list:
    out = []
    for t in tensors or []:
        out += _flat(t) if isinstance(t, (list, tuple)) else [t]
    return out


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
        try:
            size = int(os.environ.get("TORCH_FR_BUFFER_SIZE", "0") or 0)
        except ValueError:
            size = 0
        return cls(size) if size > 0 else None

    def scheduled(self, op: str, inputs, outputs, p2p: bool = False) -> dict:
        """A new entry, in the calling thread (its frames are the caller's)."""
        inputs, outputs = _flat(inputs), _flat(outputs)
        frames = [{"name": f.name, "filename": f.filename, "line": f.lineno}
                  for f in reversed(traceback.extract_stack(limit=24)[:-2])]
        with self._lock:
            kind = "p2p" if p2p else "collective"
            self.seq[kind] += 1
            entry = {"record_id": self.seq["collective"] + self.seq["p2p"] - 1, "pg_id": None,
                     "process_group": None, "thread_name": threading.current_thread().name,
                     "thread_id": str(threading.get_ident()),
                     "collective_seq_id": self.seq["collective"] if not p2p else 0,
                     "p2p_seq_id": self.seq["p2p"] if p2p else 0, "op_id": self.seq[kind],
                     "profiling_name": f"shm:{op}", "time_created_ns": time.time_ns(),
                     "input_sizes": [list(t.shape) for t in inputs], "input_dtypes": [_dtype_name(t) for t in inputs],
                     "output_sizes": [list(t.shape) for t in outputs],
                     "output_dtypes": [_dtype_name(t) for t in outputs], "state": "scheduled",
                     "time_discovered_started_ns": None, "time_discovered_completed_ns": None,
                     "retired": False, "timeout_ms": 0, "is_p2p": p2p, "frames": frames}
            self._entries.append(entry)
            if not p2p:
                self.status["last_enqueued_collective"] = entry["collective_seq_id"]
        return entry

    def started(self, entry: dict) -> None:
        entry["state"], entry["time_discovered_started_ns"] = "started", time.time_ns()
        if not entry["is_p2p"]:
            self.status["last_started_collective"] = entry["collective_seq_id"]

    def completed(self, entry: dict) -> None:
        entry["state"], entry["time_discovered_completed_ns"] = "completed", time.time_ns()
        entry["retired"] = True
        if not entry["is_p2p"]:
            self.status["last_completed_collective"] = entry["collective_seq_id"]

    def entries(self, pg_id: int, process_group: tuple) -> List[Dict]:
        with self._lock:
            return [{**e, "pg_id": pg_id, "process_group": process_group} for e in self._entries]
