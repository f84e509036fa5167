"""What a set of flight records says, in collective terms: the verdict (who never entered the
collective the others wait in, where ranks first called different collectives, which rank died in
which call) and each rank's last calls. Records are torch's dump dicts, one per rank, as
collectives.flight_recorder dumps, collects and reads them.

    from collectives.flight_verdict import verdict, summary
    print("\\n".join(verdict(records, where)))     # [] when the records show nothing wrong
    print("\\n".join(summary(records, last=3)))    # "rank 0 group 0: #3 all_reduce(4 Float) completed"
"""

from __future__ import annotations

import json
import time
from typing import Dict, List, Optional, Sequence


def summary(records: Dict[int, dict], last: int = 3) -> List[str]:
    """Each rank's last calls per group, one line per rank and group: "rank 0 group 0: #3 all_reduce(4 Float) completed"."""
    lines = []
    for rank, record in sorted(records.items()):
        by_group: Dict[str, list] = {}
        for e in record.get("entries", []):
            by_group.setdefault(e["process_group"][0], []).append(e)
        for name, entries in sorted(by_group.items()):
            calls = ", ".join(f"#{e['collective_seq_id'] or 'p2p ' + str(e.get('p2p_seq_id'))} {_describe(e)} "
                              f"{'completed' if _finished(records, rank, e) else e.get('state') or 'not completed'}"
                              for e in entries[-last:])
            lines.append(f"rank {rank} group {name}: {calls}")
    return lines


def _op(entry: dict) -> str:
    return entry["profiling_name"].split(":")[-1].split(" ")[0]


def _agreed(entry: dict) -> tuple:
    """The sizes and dtypes every rank of a call gives alike: the inputs, except where ranks
    rightly differ. scatter: only the source has inputs, so the outputs. all_to_all: uneven
    splits give each rank its own sizes, so the dtypes alone."""
    op = _op(entry)
    if op == "scatter":
        return entry.get("output_sizes", []), entry.get("output_dtypes", [])
    if op == "all_to_all":
        return None, entry["input_dtypes"]
    return entry["input_sizes"], entry["input_dtypes"]


def _signature(entry: dict) -> tuple:
    sizes, dtypes = _agreed(entry)
    return _op(entry), None if sizes is None else tuple(map(tuple, sizes)), tuple(dtypes)


def _describe(entry: dict) -> str:
    sizes, dtypes = _agreed(entry)
    shown = ", ".join("x".join(map(str, s)) or "scalar" for s in (entry["input_sizes"] if sizes is None else sizes))
    return f"{_op(entry)}({shown} {'/'.join(dtypes)})"


def _completed(record: dict, entry: dict) -> bool:
    """What this rank's own record says (the pg status, or the entry's state)."""
    status = record.get("pg_status", {}).get(str(entry["pg_id"]), {})
    return entry["collective_seq_id"] <= status.get("last_completed_collective", -1) or entry.get("state") == "completed"


def _finished(records: Dict[int, dict], rank: int, entry: dict) -> bool:
    """Whether collective `entry` of `rank` has finished, from every rank's record: its own says
    so, or every other member of the group that answered shows the same collective completed.
    A rank marks a call completed some time after it returns, later on a loaded machine (seen:
    a rank asleep in user code after its call, its record still saying "scheduled" 5 s later);
    the others' records settle it whatever the load."""
    if _completed(records[rank], entry):
        return True
    group, seq = entry["process_group"][0], entry["collective_seq_id"]
    others = [r for r in _groups(records).get(group, []) if r != rank and records.get(r)]
    if not seq or not others:
        return False
    for r in others:
        same = [e for e in records[r].get("entries", []) if e["process_group"][0] == group
                and e["collective_seq_id"] == seq and not e.get("is_p2p")]
        if not same or not _completed(records[r], same[0]):
            return False
    return True


def _groups(records: Dict[int, dict]) -> Dict[str, List[int]]:
    groups: Dict[str, List[int]] = {}
    for record in records.values():
        for name, config in record.get("pg_config", {}).items():
            ranks = json.loads(config.get("ranks") or "[]")
            if ranks:
                groups.setdefault(name, ranks)
    return groups


def verdict(records: Dict[int, Optional[dict]], where: Optional[Dict[int, str]] = None,
            ranks: Optional[Sequence[int]] = None, dead: Optional[Dict[int, str]] = None,
            ended: Sequence[int] = ()) -> List[str]:
    """Lines that say what the records show, most telling first; [] when they show nothing wrong.

    Args:
        records: rank -> that rank's dump() (None or absent: the rank did not answer).
        where: rank -> what its Python stack shows now ("in f (prog.py:14)"), for ranks that
            never entered the collective the others wait in.
        ranks: every rank of the job (default: those in records).
        dead: rank -> how it ended ("exited with code 3"), for ranks known to be gone.
        ended: live ranks whose work has ended (returned or raised): none of them is waiting in a
            collective, whatever its record says yet (a record marks a call that failed completed
            some time after the error reached Python, later on a loaded machine).
    """
    where, dead = where or {}, dead or {}
    answered = {r: rec for r, rec in records.items() if rec}
    lines: List[str] = []
    for name, members in sorted(_groups(answered).items()):
        lines += _group_verdict(name, members, answered, where, dead, set(ended))
    silent = sorted(set(ranks if ranks is not None else records) - set(answered))
    if silent and not set(silent) <= set(dead):
        if lines:
            lines.append(f"rank(s) {silent} did not answer (dead, or in C code that holds Python's lock)")
        elif answered and where:  # a hang, and what is missing may be the record that shows it: say so
            lines.append(f"rank(s) {silent} did not answer (dead, or in C code that holds Python's lock), and the "
                         f"records of rank(s) {sorted(answered)} show no hang by themselves")
    return lines


def _group_verdict(name: str, members: List[int], records: Dict[int, dict], where: Dict[int, str],
                   dead: Dict[int, str], ended: set) -> List[str]:
    entries = {r: {e["collective_seq_id"]: e for e in records[r].get("entries", [])
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
    if not entered or not max(entered.values()):  # no answering member entered a collective of this group
        return lines
    top = max(entered.values())
    waiting = [r for r in entered if entered[r] == top and r not in ended
               and not _completed(records[r], entries[r][top])]
    behind = sorted(r for r in entered if entered[r] < top)
    gone = [r for r in members if r in dead and r not in records]
    if gone:  # a rank died: say what the others were in (Gloo marks the call its error ended as completed)
        alive = sorted(entered)
        first = entries[alive[0]][top] if top in entries[alive[0]] else None
        how = "; ".join(f"rank {r} {dead[r].split(' without ')[0]}" for r in gone)
        if first is not None:
            state = "were waiting in" if waiting else "last entered"
            lines.insert(0, f"rank(s) {gone} died ({how}); rank(s) {sorted(r for r in alive if entered[r] == top)} "
                            f"{state} {_describe(first)} #{top} on group {name} {members}")
    if waiting and behind and not gone:
        first = entries[waiting[0]][top]
        dumped = records[waiting[0]].get("dump_time_ns") or time.time_ns()
        waited = max(0.0, (dumped - first["time_created_ns"]) / 1e9)
        text = (f"rank(s) {behind} never entered {_op(first)} #{top} on group {name} {members} "
                f"(rank(s) {sorted(waiting)} waiting in it for {waited:.1f} s)")
        for r in behind:
            last = entries[r].get(entered[r])
            did = (f"last entered {_op(last)} #{entered[r]} ({'completed' if _finished(records, r, last) else 'not completed'})"
                   if last else "entered no collective on it")
            now = where.get(r)
            text += f"; rank {r} {did}" + (f", and is now {now}" if now else "")
        lines.insert(0, text)
    return lines

