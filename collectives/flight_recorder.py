"""Why a job hangs, in collective terms: each rank's record of its collectives, read and compared.

torch keeps a ring buffer of every rank's collectives (its "flight recorder": per process group,
a sequence number, the op, sizes, dtypes, the Python frames) when TORCH_FR_BUFFER_SIZE is set in
the ranks' environment; Gloo records into it as NCCL does. With it set, a run that times out
asks every live rank for its record (a thread in each rank answers, so a rank blocked inside a
collective answers too) and the failure leads with what the records say:

    COLLECTIVES_... TORCH_FR_BUFFER_SIZE=2000 python prog.py
    flight recorder: rank 1 never entered all_reduce #3 on group 0 [0, 1] (rank(s) [0] waiting in it
      for 6.1 s); rank 1 last entered all_reduce #2 (completed), and is now in f (prog.py:14)

    records = {rank: dump() for each rank}       # in a rank: this rank's record, as a dict
    print("\\n".join(verdict(records, where)))    # where: {rank: what its stack shows}, optional

What it finds, per process group: the ranks that never entered the latest collective the others
are waiting in (and where they are instead), and the first sequence number at which the ranks
called different collectives, sizes or dtypes. What it cannot see: a rank that holds Python's
lock in C code does not answer (it is named as such), and the shm backend records nothing yet.
"""

from __future__ import annotations

import json
import multiprocessing.connection
import os
import pickle
import time
from typing import Dict, List, Optional, Sequence

ANSWER_WAIT_S = 3.0  # how long the launcher waits for the ranks' records


def recording() -> bool:
    """Whether torch's flight recorder is on in this process (TORCH_FR_BUFFER_SIZE > 0; the
    launcher's environment is its ranks')."""
    try:
        return int(os.environ.get("TORCH_FR_BUFFER_SIZE", "0") or 0) > 0
    except ValueError:
        return False


def dump() -> Optional[dict]:
    """This rank's record in torch's dump format, with each group's member ranks filled in (Gloo
    leaves them empty), and the time of the dump; None when nothing is recorded."""
    if not recording():
        return None
    import torch
    import torch.distributed as dist

    record = pickle.loads(torch._C._distributed_c10d._dump_fr_trace(
        includeCollectives=True, includeStackTraces=True, onlyActive=False))
    world = dist.distributed_c10d._world
    config = {}
    for pg, name in world.pg_names.items():
        ranks = sorted(world.pg_group_ranks.get(pg, {}))
        config[name] = {"name": name, "desc": getattr(pg, "group_desc", ""), "ranks": json.dumps(ranks)}
    record["pg_config"] = config
    record["dump_time_ns"] = time.time_ns()
    return record


def collect(conns: Sequence[multiprocessing.connection.Connection], wait: float = ANSWER_WAIT_S) -> Dict[int, dict]:
    """The launcher's side: ask each rank (conns[rank], answered by a thread in the rank, see
    rank_main.py) for its dump(); rank -> record, for the ranks that answered within `wait` s."""
    asked = {}
    for rank, conn in enumerate(conns):
        try:
            conn.send("dump")
            asked[conn] = rank
        except (OSError, ValueError):
            pass
    records: Dict[int, dict] = {}
    deadline = time.monotonic() + wait
    while asked and time.monotonic() < deadline:
        for conn in multiprocessing.connection.wait(list(asked), timeout=max(0.0, deadline - time.monotonic())):
            rank = asked.pop(conn)
            try:
                records[rank] = conn.recv()
            except (EOFError, OSError, pickle.UnpicklingError):
                pass
    return records


def _op(entry: dict) -> str:
    return entry["profiling_name"].split(":")[-1]


def _signature(entry: dict) -> tuple:
    return _op(entry), tuple(map(tuple, entry["input_sizes"])), tuple(entry["input_dtypes"])


def _describe(entry: dict) -> str:
    sizes = ", ".join("x".join(map(str, s)) or "scalar" for s in entry["input_sizes"])
    return f"{_op(entry)}({sizes} {'/'.join(entry['input_dtypes'])})"


def _completed(record: dict, entry: dict) -> bool:
    status = record.get("pg_status", {}).get(str(entry["pg_id"]), {})
    return entry["collective_seq_id"] <= status.get("last_completed_collective", -1)


def _groups(records: Dict[int, dict]) -> Dict[str, List[int]]:
    groups: Dict[str, List[int]] = {}
    for record in records.values():
        for name, config in record.get("pg_config", {}).items():
            ranks = json.loads(config.get("ranks") or "[]")
            if ranks:
                groups.setdefault(name, ranks)
    return groups


def verdict(records: Dict[int, Optional[dict]], where: Optional[Dict[int, str]] = None,
            ranks: Optional[Sequence[int]] = None) -> List[str]:
    """Lines that say what the records show, most telling first; [] when they show nothing wrong.

    Args:
        records: rank -> that rank's dump() (None or absent: the rank did not answer).
        where: rank -> what its Python stack shows now ("in f (prog.py:14)"), for ranks that
            never entered the collective the others wait in.
        ranks: every rank of the job (default: those in records).
    """
    where = where or {}
    answered = {r: rec for r, rec in records.items() if rec}
    lines: List[str] = []
    for name, members in sorted(_groups(answered).items()):
        lines += _group_verdict(name, members, answered, where)
    silent = sorted(set(ranks if ranks is not None else records) - set(answered))
    if silent and lines:
        lines.append(f"rank(s) {silent} did not answer (dead, or in C code that holds Python's lock)")
    return lines


def _group_verdict(name: str, members: List[int], records: Dict[int, dict], where: Dict[int, str]) -> List[str]:
    entries = {r: {e["collective_seq_id"]: e for e in records[r]["entries"]
                   if e["process_group"][0] == name and not e.get("is_p2p")} for r in members if r in records}
    lines = []
    # The first sequence number the ranks entered with different calls: later ones follow from it.
    common = sorted(set.intersection(*(set(e) for e in entries.values()))) if entries else []
    for seq in common:
        calls = {r: entries[r][seq] for r in entries}
        if len({_signature(e) for e in calls.values()}) > 1:
            lines.append(f"ranks called different collectives at #{seq} on group {name} {members}: "
                         + "; ".join(f"rank {r} {_describe(e)}" for r, e in sorted(calls.items())))
            break
    entered = {r: max(e) if e else 0 for r, e in entries.items()}
    if not entered:
        return lines
    top = max(entered.values())
    waiting = [r for r in entered if entered[r] == top and not _completed(records[r], entries[r][top])]
    behind = sorted(r for r in entered if entered[r] < top)
    if waiting and behind:
        first = entries[waiting[0]][top]
        dumped = records[waiting[0]].get("dump_time_ns") or time.time_ns()
        waited = max(0.0, (dumped - first["time_created_ns"]) / 1e9)
        text = (f"rank(s) {behind} never entered {_op(first)} #{top} on group {name} {members} "
                f"(rank(s) {sorted(waiting)} waiting in it for {waited:.1f} s)")
        for r in behind:
            last = entries[r].get(entered[r])
            did = (f"last entered {_op(last)} #{entered[r]} ({'completed' if _completed(records[r], last) else 'not completed'})"
                   if last else "entered no collective on it")
            now = where.get(r)
            text += f"; rank {r} {did}" + (f", and is now {now}" if now else "")
        lines.insert(0, text)
    return lines
