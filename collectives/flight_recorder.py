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
                                                 # (verdict and summary: flight_verdict.py)

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
from collectives.output_files import write_output
from collectives.flight_verdict import summary, verdict  # noqa: F401 - this module's readers' API too

# How long the launcher waits for the ranks' records; it stops as soon as every live rank has
# answered, so only a rank that cannot answer (in C code holding Python's lock) costs all of it.
# 3 s and then 5 s were too short on a loaded machine (a live rank's answer missed the verdict).
ANSWER_WAIT_S = 15.0


def recording(backend: Optional[str] = None) -> bool:
    """Whether the ranks keep a flight record (the launcher's environment is its ranks'): torch's
    (TORCH_FR_BUFFER_SIZE > 0), or, on an shm world on the native path (the default), the shm
    backend's, which is on unless TORCH_FR_BUFFER_SIZE=0."""
    from .shm.config import ShmConfig  # the settings module says what a value means (unset or empty: native)

    native_shm = backend is not None and str(backend).lower() == "shm" and ShmConfig.from_env().path == "native"
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
            write_output(path, lambda f, record=record: pickle.dump(record, f), "the flight record")
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
    if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
        raise ValueError(f"{path}: not a flight-recorder dump (its 'entries' are not torch's calls)")
    for i, e in enumerate(entries):
        missing = [k for k in ENTRY_KEYS if k not in e]
        if missing:
            raise ValueError(f"{path}: not a flight-recorder dump the reader can use (entry {i} has no "
                             f"{', '.join(repr(k) for k in missing)}; torch's entries carry {', '.join(ENTRY_KEYS)})")
    return record


# What the verdict reads of every entry (torch's dumps, and ours, carry each)
ENTRY_KEYS = ("process_group", "pg_id", "collective_seq_id", "profiling_name", "input_sizes", "input_dtypes",
              "time_created_ns")


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


if __name__ == "__main__":
    raise SystemExit(main())
