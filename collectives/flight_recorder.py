"""Why a job hangs, in collective terms: each rank's record of its collectives, read and compared.

torch keeps a ring buffer of every rank's collectives (its "flight recorder": per process group,
a sequence number, the op, sizes, dtypes, the Python frames) when TORCH_FR_BUFFER_SIZE is set in
the ranks' environment; Gloo records into it as NCCL does. The shm backend keeps its own record
in the same format, on by default (TORCH_FR_BUFFER_SIZE=0 turns it off). Where the ranks record,
a run that times out asks every live rank for its record (a thread in each rank answers, so a rank blocked inside a
collective answers too) and the failure leads with what the records say:

    COLLECTIVES_... TORCH_FR_BUFFER_SIZE=2000 python prog.py
    flight recorder: rank 1 never entered all_reduce #3 on group 0 [0, 1] (rank(s) [0] waiting in it
      for 6.1 s); rank 1 last entered all_reduce #2 (completed), and is now in f (prog.py:14)

    records = {rank: dump() for each rank}       # in a rank: this rank's record, as a dict
    print("\\n".join(verdict(records, where)))    # where: {rank: what its stack shows}, optional

Dumps as files, read by this module and by torch's own torchfrtrace: with TORCH_FR_DUMP_TEMP_FILE
set (torch's setting, a path prefix), a failed run also writes each answering rank's record to
PREFIX<rank> (a pickled dict, torch's format). Any job's dumps, ours or torchrun's with NCCL or Gloo:

    python -m collectives.flight_recorder DIR [--prefix rank_]     # the verdict, and each rank's last calls
    python -m torch.distributed.flight_recorder.fr_trace DIR -j     # torch's own reader, on the same files

What it finds, per process group: the ranks that never entered the latest collective the others
are waiting in (and where they are instead), and the first sequence number at which the ranks
called different collectives, sizes or dtypes. What it cannot see: a rank that holds Python's
lock in C code does not answer (it is named as such). The shm backend keeps its own record in
torch's format (collectives/shm/recorder.py), merged into the same dump.
"""

from __future__ import annotations

import json
import multiprocessing.connection
import os
import pickle
import time
from typing import Dict, List, Optional, Sequence

from collectives import cli, settings

# How long the launcher waits for the ranks' records; it stops as soon as every live rank has
# answered, so only a rank that cannot answer (in C code holding Python's lock) costs all of it.
# 3 s and then 5 s were too short on a loaded machine (a live rank's answer missed the verdict).
ANSWER_WAIT_S = 15.0


def recording(backend: Optional[str] = None) -> bool:
    """Whether the ranks keep a flight record (the launcher's environment is its ranks'): torch's
    (TORCH_FR_BUFFER_SIZE > 0), or, on an shm world on the native path (the default), the shm
    backend's, which is on unless TORCH_FR_BUFFER_SIZE=0."""
    native_shm = backend is not None and str(backend).lower() == "shm" and \
        os.environ.get("COLLECTIVES_SHM_PATH", "native") == "native"
    default = settings.SHM_FR_ENTRIES if native_shm else 0
    return settings.fr_buffer_size(default=default) > 0


def dump() -> Optional[dict]:
    """This rank's record in torch's dump format, with each group's member ranks filled in (Gloo
    leaves them empty), and the time of the dump; None when nothing is recorded."""
    import torch
    import torch.distributed as dist

    world = dist.distributed_c10d._world
    shm_groups = [pg for pg in world.pg_names if str(dist.get_backend(pg)).lower() == "shm"]
    if not recording() and not shm_groups:
        return None
    record = pickle.loads(torch._C._distributed_c10d._dump_fr_trace(
        includeCollectives=True, includeStackTraces=True, onlyActive=False))
    config = {}
    for pg, name in world.pg_names.items():
        ranks = sorted(world.pg_group_ranks.get(pg, {}))
        desc = getattr(pg, "group_desc", "")
        config[name] = {"name": name, "desc": desc, "ranks": json.dumps(ranks)}
        if str(dist.get_backend(pg)).lower() == "shm":  # torch has no hook for it: its own record
            from .shm import backend_of

            recorder = backend_of(pg).recorder
            if recorder is not None:
                pg_id = int(name) if name.isdigit() else 10_000 + len(config)
                record["entries"] = record.get("entries", []) + recorder.entries(pg_id, (name, desc))
                record.setdefault("pg_status", {})[str(pg_id)] = dict(recorder.status)
    record["pg_config"] = config
    record["dump_time_ns"] = time.time_ns()
    return record


def collect(conns: Sequence[multiprocessing.connection.Connection], wait: float = ANSWER_WAIT_S) -> Dict[int, dict]:
    """The launcher's side: ask each rank (conns[rank], answered by a thread in the rank, see
    launcher/rank_main.py) for its dump(); rank -> record, for the ranks that answered within `wait` s."""
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


# torchfrtrace (torch 2.13) refuses any other library name before the ":" of an entry's profiling_name
TORCHFRTRACE_LIBS = ("nccl", "ncclx", "rccl", "rcclx", "hccl", "mccl", "xccl", "gloo")


def _for_torchfrtrace(record: dict) -> dict:
    """shm's entries under a library name torchfrtrace reads ("gloo:"), the real one kept in
    each entry's "backend"; everything else as it is."""
    entries = []
    for e in record.get("entries", []):
        lib, _, name = e["profiling_name"].partition(":")
        if lib not in TORCHFRTRACE_LIBS:
            e = {**e, "profiling_name": f"gloo:{name}", "backend": lib}
        entries.append(e)
    return {**record, "entries": entries}


def write(records: Dict[int, dict], prefix: str, world_size: Optional[int] = None) -> List[str]:
    """Each rank's record to PREFIX<rank> (torch's file naming and format, readable by
    torchfrtrace: see _for_torchfrtrace); the paths written. Every file of one call carries the
    same run stamp ("collectives_run": id, world size, time written), so a reader can tell this
    run's files from an earlier run's left in the same folder."""
    import uuid

    stamp = {"id": uuid.uuid4().hex, "world_size": world_size or (max(records) + 1 if records else 0),
             "written_ns": time.time_ns()}
    paths = []
    for rank, record in sorted(records.items()):
        if record:
            record = {**_for_torchfrtrace(record), "collectives_run": stamp}
            path = f"{prefix}{rank}"
            with open(path, "wb") as f:
                pickle.dump(record, f)
            paths.append(path)
    return paths


def read(directory: str, prefix: Optional[str] = None) -> Dict[int, dict]:
    """rank -> record from the files PREFIX<rank> in directory (prefix: the one all files share,
    found as torchfrtrace finds it, when not given); every file, of whatever run (see read_run)."""
    return {rank: record for rank, (record, _) in _read_files(directory, prefix).items()}


def read_run(directory: str, prefix: Optional[str] = None):
    """(records, world_size, notes): the files of one run only, the latest written, and a line
    for each file left out. A file's run is its run stamp (write()); torch's own dumps have none,
    so there the run is told by world size (its default group's ranks) and by time (the file's
    modification time): a dump from another world size, or from a rank the world does not have,
    is left out. world_size: the run's, when any file says it (else None)."""
    files = _read_files(directory, prefix)
    facts = {rank: _run_of(record, path) for rank, (record, path) in files.items()}
    latest = max(facts, key=lambda r: facts[r][2])
    run_id, world_size, written = facts[latest]
    notes, records = [], {}
    for rank, (record, path) in sorted(files.items()):
        rid, ws, when = facts[rank]
        if run_id is not None and rid != run_id:
            notes.append(f"left out {path}: written by another run (at {_clock(when)}; the latest run's files at "
                         f"{_clock(written)})")
        elif world_size and ws and ws != world_size:
            notes.append(f"left out {path}: a dump from a world of {ws} ranks (the latest file, rank {latest}'s, "
                         f"is from a world of {world_size})")
        elif world_size and rank >= world_size:
            notes.append(f"left out {path}: rank {rank} is not in the latest run's world of {world_size} ranks")
        else:
            records[rank] = record
    return records, world_size, notes


def _read_files(directory: str, prefix: Optional[str]) -> Dict[int, tuple]:
    """rank -> (record, path) for every file PREFIX<rank>."""
    import re

    names = sorted(os.listdir(directory))
    if prefix is None and not any(re.fullmatch(r"[\w\-]*?\d+", n) for n in names):
        raise ValueError(f"{directory}: no dump files in it (files PREFIX<rank>, as TORCH_FR_DUMP_TEMP_FILE=DIR/PREFIX "
                         "writes them)")
    if prefix is None:
        prefixes = {m.group(1) for n in names if (m := re.fullmatch(r"([\w\-]*?)(\d+)", n))}
        if len(prefixes) != 1:
            raise ValueError(f"{directory}: cannot tell the dump files' common prefix (found {sorted(prefixes) or 'none'}); "
                             "give --prefix")
        prefix = prefixes.pop()
    files = {}
    for name in names:
        rest = name[len(prefix):] if name.startswith(prefix) else ""
        if rest.isdigit():
            path = os.path.join(directory, name)
            files[int(rest)] = (_load_dump(path), path)
    if not files:
        raise ValueError(f"{directory}: no dump files named {prefix}<rank>")
    return files


def _run_of(record: dict, path: str) -> tuple:
    """(run id or None, world size or None, time written in ns) of one dump."""
    stamp = record.get("collectives_run")
    if isinstance(stamp, dict) and {"id", "world_size", "written_ns"} <= set(stamp):
        return stamp["id"], int(stamp["world_size"]) or None, int(stamp["written_ns"])
    world = record.get("pg_config", {}).get("0", {})
    try:
        ranks = json.loads(world.get("ranks") or "[]") if isinstance(world, dict) else []
    except ValueError:
        ranks = []
    return None, len(ranks) or None, os.stat(path).st_mtime_ns


def _clock(ns: int) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ns / 1e9))


def _load_dump(path: str) -> dict:
    """One rank's dump (ours or torch's, with or without entries), or a ValueError naming the file."""
    try:
        with open(path, "rb") as f:
            record = pickle.load(f)
    except OSError:
        raise
    except Exception as exc:  # truncated (EOFError), not a pickle, or a pickle of a class not here
        raise ValueError(f"{path}: not a flight-recorder dump (cannot unpickle it: {type(exc).__name__}: "
                         f"{str(exc).splitlines()[0] if str(exc) else 'no detail'})") from None
    if not isinstance(record, dict) or not {"version", "pg_config"} <= set(record):
        raise ValueError(f"{path}: not a flight-recorder dump (a pickled {type(record).__name__} without the "
                         "'version' and 'pg_config' of torch's dumps)")
    entries = record.get("entries", [])
    if not isinstance(entries, list) or not all(isinstance(e, dict) and {"process_group", "collective_seq_id"} <= set(e)
                                                for e in entries):
        raise ValueError(f"{path}: not a flight-recorder dump (its 'entries' are not torch's calls)")
    return record


def summary(records: Dict[int, dict], last: int = 3) -> List[str]:
    """Each rank's last calls per group, one line per rank and group: "rank 0 group 0: #3 all_reduce(4 Float) completed"."""
    lines = []
    for rank, record in sorted(records.items()):
        by_group: Dict[str, list] = {}
        for e in record.get("entries", []):
            by_group.setdefault(e["process_group"][0], []).append(e)
        for name, entries in sorted(by_group.items()):
            calls = ", ".join(f"#{e['collective_seq_id'] or 'p2p ' + str(e['p2p_seq_id'])} {_describe(e)} "
                              f"{'completed' if _finished(records, rank, e) else e.get('state') or 'not completed'}"
                              for e in entries[-last:])
            lines.append(f"rank {rank} group {name}: {calls}")
    return lines


# The reader's exit status beyond 0 (read, nothing found) and 2 (a usage error), for scripts
MISSING, CANNOT_TELL, FOUND = 1, 3, 4


def build_parser():
    from .cli import ArgumentParser

    parser = ArgumentParser(prog="python -m collectives.flight_recorder",
                            description="Read flight-recorder dumps (ours, or torch's from any job) and say what they show.",
                            epilog="Only the latest run's files are read: a file from an earlier run left in the folder "
                                   "is named and left out. Exit status: 0 every rank's dump read and none shows a hang "
                                   "or mismatch; 1 a rank of the run left no dump (its part of the story is missing); "
                                   "2 a folder or file that cannot be read; 3 the dumps hold no calls, so they cannot "
                                   "tell; 4 a hang or a mismatch found.")
    parser.add_argument("directory", help="the folder of dump files PREFIX<rank>")
    parser.add_argument("--prefix", default=None, help="the files' common prefix (default: found from the names)")
    parser.add_argument("--last", type=int, default=3, help="how many of each rank's last calls to list (default 3)")
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    cli.check_at_least(parser, args, {"--last": 1})
    try:
        records, world_size, notes = read_run(args.directory, args.prefix)
    except (OSError, ValueError, pickle.UnpicklingError, EOFError) as exc:
        parser.error(str(exc))
    for note in notes:
        print(note)
    missing = sorted(set(range(world_size or 0)) - set(records))
    if not records:
        print(f"no dump of the latest run is left to read in {args.directory}")
        return MISSING
    if not any(record.get("entries") for record in records.values()):
        print(f"the records of rank(s) {sorted(records)} hold no calls (dumped without entries, as torch does with "
              "includeCollectives=False, or before any call): they cannot show a hang or a mismatch"
              + (f"; and rank(s) {missing} of the run's {world_size} left no dump" if missing else ""))
        return MISSING if missing else CANNOT_TELL
    lines = verdict(records, ranks=range(world_size) if world_size else None)
    if lines:
        print("\n".join(lines))
    elif missing:
        print(f"the records of rank(s) {sorted(records)} show no hang or mismatch, but rank(s) {missing} of the "
              f"run's {world_size} left no dump of it, so what they did is unknown (a rank that died writes none)")
    else:
        print(f"the records of rank(s) {sorted(records)} show no hang or mismatch")
    print("\n".join(summary(records, args.last)))
    return FOUND if lines else MISSING if missing else 0


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


if __name__ == "__main__":
    raise SystemExit(main())
