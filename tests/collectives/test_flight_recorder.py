"""collectives.flight_recorder: planted hangs on Gloo, each named in collective terms (the rank,
the group, the collective and its sequence number) by the records torch keeps when
TORCH_FR_BUFFER_SIZE is set; and the analysis alone on records written by hand.

    pytest tests/collectives/test_flight_recorder.py -q

Each planted hang costs a spawn and the 3 s timeout.
"""

import inspect
import pickle
import time

import pytest
import torch
import torch.distributed as dist

import collectives as C
from collectives import flight_recorder
from collectives.compat import all_gather_single, reduce_scatter_single
from collectives.flight_recorder import summary, verdict
from collectives.testing import run_on_ranks

TIMEOUT_S = 3.0
# Spawning the ranks, the timeout, the grace (3 s) and the records (up to ANSWER_WAIT_S): a bound
# that tells a verdict given at the timeout from a run that waits on (it would wait forever). On a
# quiet machine the whole takes about 10 s; on a loaded 2-core machine it took 63 s once.
LOADED_BOUND_S = 180


# -- planted hangs, for real -------------------------------------------------------------------------

def _skips_one_all_reduce(env):
    t = torch.ones(4)
    for step in range(5):
        if env.rank == 1 and step == 3:
            time.sleep(600)  # stuck in user code: never enters all_reduce #4
        dist.all_reduce(t)


def _line_of(fn, text: str) -> int:
    """The line of this file where `fn` has `text` (so that the test survives edits above it)."""
    lines, first = inspect.getsourcelines(fn)
    return next(first + i for i, line in enumerate(lines) if text in line)


def _different_order(env):
    a, b = torch.ones(4), torch.ones(6)
    dist.all_reduce(a)
    if env.rank == 0:
        dist.all_reduce(a)
        dist.broadcast(b, 0)
    else:
        dist.broadcast(b, 0)
        dist.all_reduce(a)


def _hang_in_a_subgroup(env):
    pair = dist.new_group([0, 1])
    t = torch.ones(4)
    dist.all_reduce(t)  # the world is fine
    if env.rank in (0, 1):
        dist.all_reduce(t, group=pair)
        if env.rank == 0:
            dist.all_reduce(t, group=pair)  # rank 1 has left: rank 0 waits here
    if env.rank == 2:
        time.sleep(600)


@pytest.mark.slow
@pytest.mark.parametrize("fn, world_size, says", [
    (_skips_one_all_reduce, 2,
     "flight recorder: rank(s) [1] never entered all_reduce #4 on group 0 [0, 1] (rank(s) [0] waiting in it for "),
    (_different_order, 2,
     "flight recorder: ranks called different collectives at #2 on group 0 [0, 1]: rank 0 all_reduce(4 Float); "
     "rank 1 broadcast(6 Float)"),
    (_hang_in_a_subgroup, 3,
     "flight recorder: rank(s) [1] never entered all_reduce #2 on group 1 [0, 1] (rank(s) [0] waiting in it for "),
], ids=["a rank skips one collective", "two orders", "a subgroup hangs, the world is fine"])
def test_a_planted_hang_is_named_in_collective_terms(fn, world_size, says, monkeypatch, tmp_path):
    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "2000")
    if fn is _different_order:  # dumps asked for in a folder that is not there: said, after the verdict
        monkeypatch.setenv("TORCH_FR_DUMP_TEMP_FILE", str(tmp_path / "missing" / "rank_"))
    start = time.monotonic()
    with pytest.raises(C.RankFailure) as info:
        C.run(fn, world_size=world_size, timeout=TIMEOUT_S)
    first = str(info.value).splitlines()[0]
    assert first.startswith(says), str(info.value)
    if fn is _different_order:
        assert f"could not write the records to {tmp_path / 'missing' / 'rank_'}<rank>: No such file or directory" \
            in str(info.value), str(info.value)
    if fn is _skips_one_all_reduce:  # and where the missing rank is instead
        assert first.endswith("rank 1 last entered all_reduce #3 (completed), and is now in _skips_one_all_reduce "
                              f"(test_flight_recorder.py:{_line_of(_skips_one_all_reduce, 'time.sleep(600)')})"), first
    assert time.monotonic() - start < LOADED_BOUND_S


@pytest.mark.slow
@pytest.mark.parametrize("fn, world_size, says", [
    (_skips_one_all_reduce, 2,
     "flight recorder: rank(s) [1] never entered all_reduce #4 on group 0 [0, 1] (rank(s) [0] waiting in it for "),
    (_hang_in_a_subgroup, 3,
     "flight recorder: rank(s) [1] never entered all_reduce #2 on group 1 [0, 1] (rank(s) [0] waiting in it for "),
], ids=["a rank skips one collective", "a subgroup hangs, the world is fine"])
def test_a_planted_hang_on_shm_is_named_from_its_own_record(fn, world_size, says, monkeypatch):
    """torch records nothing for a Python backend: these verdicts come from shm's own record
    (collectives/shm/recorder.py) in torch's format. (Two orders are no hang on shm: its call
    check makes every rank raise at once, naming both calls; tests/shm/test_shm.py.)"""
    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "2000")
    start = time.monotonic()
    with pytest.raises(C.RankFailure) as info:
        C.run(fn, world_size=world_size, backend="shm", timeout=TIMEOUT_S)
    first = str(info.value).splitlines()[0]
    assert first.startswith(says), str(info.value)
    assert time.monotonic() - start < LOADED_BOUND_S


def _records_on_shm(env):
    from collectives.flight_recorder import dump

    t = torch.ones(4, dtype=torch.float64)
    for _ in range(3):
        dist.all_reduce(t)
    dist.broadcast(torch.ones(2, dtype=torch.int32), 0)
    if env.rank == 0:
        dist.send(t, 1)
    else:
        dist.recv(t, 0)
    return dump()


@pytest.mark.parametrize("path", ["native", pytest.param("python", marks=pytest.mark.slow)])
def test_shm_records_its_calls_in_torchs_format(path, tmp_path, monkeypatch):
    """On either path of the shm backend (COLLECTIVES_SHM_PATH): the native path records the calls
    and messages it runs in C++ (native_recorder.h) with the ids the Python path's entries draw
    from, so the two merge into one record; its entries carry no frames, the Python path's do."""
    import subprocess
    import sys

    from collectives.flight_recorder import write

    monkeypatch.setenv("COLLECTIVES_SHM_PATH", path)
    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "3")  # the last 3 collectives are kept, and the message
    records = C.run(_records_on_shm, 2, backend="shm", timeout=30)
    write(dict(enumerate(records)), str(tmp_path / "rank_"))
    theirs = subprocess.run([sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace", str(tmp_path), "-j"],
                            capture_output=True, text=True, timeout=120)
    said = theirs.stdout + theirs.stderr
    assert theirs.returncode == 0 and said.count("broadcast(input_sizes=[[2]], state=completed)") == 2, said[-3000:]
    for rank, record in enumerate(records):
        mine = [e for e in record["entries"] if e["profiling_name"].startswith("shm:")]
        assert [(e["profiling_name"], e["collective_seq_id"], e["p2p_seq_id"], e["state"]) for e in mine] == [
            ("shm:all_reduce", 3, 0, "completed"), ("shm:broadcast", 4, 0, "completed"),
            ("shm:send 0->1" if rank == 0 else "shm:recv 1<-0", 0, 1, "completed")], mine
        assert mine[0]["input_sizes"] == [[4]] and mine[0]["input_dtypes"] == ["Double"]
        assert mine[1]["input_dtypes"] == ["Int"] and mine[0]["process_group"][0] == "0"
        assert mine[2]["is_p2p"] and mine[2]["input_sizes"] == [[4]], mine[2]
        for e in mine:
            if path == "python":
                assert any(f["name"] == "_records_on_shm" for f in e["frames"]), e["frames"]
            else:  # messages too run in C++ (native_p2p.h)
                assert e["frames"] == [] and e["thread_name"] == "shm native", e
        assert record["pg_status"][str(mine[0]["pg_id"])]["last_completed_collective"] == 4


def _every_collective(group, r, n):
    """One call of each kind torch issues, in the order of _expected_entries."""
    x = torch.arange(4.0) + r
    dist.all_reduce(x.clone(), group=group)
    dist.broadcast(x.clone(), 0, group=group)
    dist.reduce(x.clone(), 0, group=group)
    all_gather_single(torch.empty(4 * n), x, group=group)
    dist.all_gather([torch.empty(4) for _ in range(n)], x, group=group)
    reduce_scatter_single(torch.empty(2), torch.arange(2.0 * n), group=group)
    dist.reduce_scatter(torch.empty(2), [torch.ones(2) for _ in range(n)], group=group)
    dist.gather(x, [torch.empty(4) for _ in range(n)] if r == 0 else None, 0, group=group)
    dist.scatter(torch.empty(4), [torch.ones(4) for _ in range(n)] if r == 0 else None, 0, group=group)
    dist.all_to_all_single(torch.empty(2 * n), torch.ones(2 * n), group=group)
    # uneven: rank r sends r + 1 elements to each rank
    dist.all_to_all_single(torch.empty(n * (n + 1) // 2), torch.ones((r + 1) * n), [q + 1 for q in range(n)],
                           [r + 1] * n, group=group)
    dist.all_to_all([torch.empty(3) for _ in range(n)], [torch.ones(3) for _ in range(n)], group=group)
    dist.barrier(group=group)
    with dist._coalescing_manager(group=group):  # what DTensor and the functional collectives issue
        all_gather_single(torch.empty(2 * n), torch.ones(2), group=group)
        all_gather_single(torch.empty(3 * n), torch.ones(3), group=group)
    with dist._coalescing_manager(group=group):  # one allreduce_coalesced call
        dist.all_reduce(torch.ones(3), group=group)
        dist.all_reduce(torch.ones(2), group=group)
    dist.all_gather_coalesced([[torch.empty(2), torch.empty(2)] for _ in range(n)], [torch.ones(2), torch.ones(2)],
                              group=group)  # the list form, one call: its inputs' stack, its outputs' stack
    # non-contiguous: the native path hands it to the Python path, whose entry joins the same record
    dist.all_reduce(torch.ones(5, 2, dtype=torch.int32)[:, 0], group=group)
    dist.all_gather([torch.empty(2, dtype=torch.float64) for _ in range(n)], torch.ones(2, dtype=torch.float64),
                    group=group)


def _expected_entries(r, n):
    """(name, input sizes, output sizes, dtype) of _every_collective's calls on rank r of n: Gloo's
    names; a tensor's shape, a list's stack, nothing for no tensor (recorder.py)."""
    at_root = lambda shape: [shape] if r == 0 else []  # noqa: E731
    return [(*e, "Float") for e in [
        ("all_reduce", [[4]], [[4]]), ("broadcast", [[4]], [[4]]), ("reduce", [[4]], [[4]]),
        ("all_gather", [[4]], [[4 * n]]), ("all_gather", [[4]], [[n, 4]]),
        ("reduce_scatter", [[2 * n]], [[2]]), ("reduce_scatter", [[n, 2]], [[2]]),
        ("gather", [[4]], at_root([n, 4])), ("scatter", at_root([n, 4]), [[4]]),
        ("all_to_all", [[2 * n]], [[2 * n]]), ("all_to_all", [[(r + 1) * n]], [[n * (n + 1) // 2]]),
        ("all_to_all", [[n, 3]], [[n, 3]]), ("barrier", [], []),
        ("all_gather", [[2]], [[2 * n]]), ("all_gather", [[3]], [[3 * n]]),
        ("allreduce_coalesced", [[2, 3]], [[2, 3]]), ("all_gather", [[2, 2]], [[2 * n, 2]])]] + [
        ("all_reduce", [[5]], [[5]], "Int"), ("all_gather", [[2]], [[n, 2]], "Double")]


def _recorded_on_both_paths(env):
    from collectives.flight_recorder import dump
    from collectives.shm import new_group_with

    r, n = env.rank, env.world_size
    on = {"TORCH_FR_BUFFER_SIZE": "2000"}  # the Python path records only when it is set
    groups = {"native": new_group_with({**on, "COLLECTIVES_SHM_PATH": "native"}),
              "python": new_group_with({**on, "COLLECTIVES_SHM_PATH": "python"}),
              "mixed": new_group_with({**on, "COLLECTIVES_SHM_PATH": "native" if r % 2 == 0 else "python"})}
    for group in groups.values():
        _every_collective(group, r, n)
    record = dump()
    names = {dist.distributed_c10d._world.pg_names[g]: kind for kind, g in groups.items()}
    mine = {}
    for e in record["entries"]:
        if e["process_group"][0] in names:
            mine.setdefault(names[e["process_group"][0]], []).append(e)
    record["entries"] = [e for e in record["entries"] if e["process_group"][0] in names]
    return mine, record


@pytest.mark.parametrize("world_size", [2, 3])
def test_every_collective_is_recorded_alike_on_either_path_and_in_a_mixed_group(world_size):
    """The same call gets the same entry whichever path ran it, so a group whose ranks take
    different paths (the mixed group: even ranks native, odd ranks Python) reads as one program:
    the verdict finds no mismatch in it. (The Python path once named the tensor forms
    all_gather_single, reduce_scatter_single and all_to_all_single and gave the outputs as the
    inputs; the native path gave a list's first tensor for the list.)"""
    results = run_on_ranks(_recorded_on_both_paths, world_size, timeout=120)
    expected = [_expected_entries(r, world_size) for r in range(world_size)]
    for r, (mine, _) in enumerate(results):
        for kind in ("native", "python", "mixed"):
            got = [(e["profiling_name"], e["input_sizes"], e["output_sizes"], e["input_dtypes"], e["output_dtypes"])
                   for e in mine[kind]]
            assert got == [(f"shm:{op}", ins, outs, [dtype] * len(ins), [dtype] * len(outs))
                           for op, ins, outs, dtype in expected[r]], (r, kind)
            assert [e["collective_seq_id"] for e in mine[kind]] == list(range(1, len(expected[r]) + 1)), (r, kind)
            assert all(e["state"] == "completed" for e in mine[kind]), (r, kind)
    assert verdict({r: record for r, (_, record) in enumerate(results)}) == []


def _one_rank_dies(env):
    import os

    t = torch.ones(4)
    for step in range(5):
        if env.rank == 1 and step == 3:
            os._exit(3)
        dist.all_reduce(t)


@pytest.mark.parametrize("backend", ["gloo", "shm"])
def test_a_dead_rank_is_named_with_the_collective_the_others_wait_in(backend, monkeypatch):
    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "2000")
    start = time.monotonic()
    with pytest.raises(C.RankFailure) as info:
        C.run(_one_rank_dies, world_size=2, backend=backend, timeout=600)
    first = str(info.value).splitlines()[0]
    # rank 0 raised (the peer's error ended its call): it is waiting in nothing, whether or not its
    # record has marked the call completed yet (on Gloo it does, some time after; a loaded run's
    # report said "were waiting in" there)
    assert first == ("flight recorder: rank(s) [1] died (rank 1 exited with code 3); rank(s) [0] last entered "
                     "all_reduce(4 Float) #4 on group 0 [0, 1]"), str(info.value)
    # waiting for the 600 s timeout would take longer; a death is seen in ~1 s, plus the 3 s grace
    assert time.monotonic() - start < 300, "waited for the timeout"


def _sizes_differ(env):
    t = torch.ones(4)
    for step in range(3):
        dist.all_reduce(t if not (env.rank == 1 and step == 2) else torch.ones(6))


def test_a_size_mismatch_on_gloo_names_the_dead_rank_and_the_survivors_call(monkeypatch):
    """Gloo aborts a rank on a size mismatch (SIGABRT), taking its record with it: the verdict
    names it and the call the survivor made at that sequence number, with its size."""
    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "2000")
    with pytest.raises(C.RankFailure) as info:
        C.run(_sizes_differ, world_size=2, timeout=30)
    first = str(info.value).splitlines()[0]
    if first.startswith("flight recorder: rank(s) [0] died"):
        assert first.endswith("; rank(s) [1] last entered all_reduce(6 Float) #3 on group 0 [0, 1]"), first
    else:
        assert first.startswith("flight recorder: rank(s) [1] died (rank 1 died from SIGABRT"), str(info.value)
        assert first.endswith("; rank(s) [0] last entered all_reduce(4 Float) #3 on group 0 [0, 1]"), first


@pytest.mark.slow
def test_dumps_are_written_and_read_by_us_and_by_torchfrtrace(tmp_path, monkeypatch):
    import subprocess
    import sys

    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "2000")
    monkeypatch.setenv("TORCH_FR_DUMP_TEMP_FILE", str(tmp_path / "rank_"))
    with pytest.raises(C.RankFailure) as info:
        C.run(_skips_one_all_reduce, world_size=2, timeout=TIMEOUT_S)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank_0", "rank_1"], str(info.value)
    ours = subprocess.run([sys.executable, "-m", "collectives.flight_recorder", str(tmp_path)],
                          capture_output=True, text=True, timeout=60)
    assert ours.returncode == flight_recorder.FOUND, ours.stderr  # a hang found: its own exit status
    lines = ours.stdout.splitlines()
    assert lines[0].startswith("rank(s) [1] never entered all_reduce #4 on group 0 [0, 1]"), ours.stdout
    assert str(info.value).splitlines()[0].startswith("flight recorder: " + lines[0][:60])
    assert "rank 1 group 0: #1 all_reduce(4 Float) completed, #2 all_reduce(4 Float) completed, " \
           "#3 all_reduce(4 Float) completed" in lines, ours.stdout
    theirs = subprocess.run([sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace", str(tmp_path), "-j"],
                            capture_output=True, text=True, timeout=120)
    said = theirs.stdout + theirs.stderr  # torchfrtrace -j lists every rank's entries (on stderr)
    assert theirs.returncode == 0, said[-3000:]
    assert said.count("all_reduce(input_sizes=[[4]], state=scheduled)") == 7, said[-3000:]  # rank 0: 4, rank 1: 3


@pytest.mark.slow  # a fresh interpreter: the reader as a user runs it
def test_the_reader_run_with_dash_m_says_what_is_wrong_with_its_folder_in_one_line(tmp_path):
    import subprocess
    import sys

    (tmp_path / "notes.txt").write_text("x")
    out = subprocess.run([sys.executable, "-m", "collectives.flight_recorder", str(tmp_path)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "no dump files in it (files PREFIX<rank>" in out.stderr, out.stderr
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr  # one line: no runpy warning before it


def test_the_reader_says_what_is_wrong_with_its_folder(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(SystemExit) as info:
        flight_recorder.main([str(tmp_path)])
    assert info.value.code == 2 and "no dump files in it (files PREFIX<rank>" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:
        flight_recorder.main([str(tmp_path), "--last", "0"])
    assert info.value.code == 2
    for name in ("a_0", "b_1"):  # dumps, but of two prefixes: which is meant is for --prefix to say
        (tmp_path / name).write_bytes(b"")
    with pytest.raises(SystemExit):
        flight_recorder.main([str(tmp_path)])


@pytest.mark.slow
def test_without_the_recorder_the_failure_is_as_before(monkeypatch):
    monkeypatch.delenv("TORCH_FR_BUFFER_SIZE", raising=False)
    with pytest.raises(C.RankFailure) as info:
        C.run(_skips_one_all_reduce, world_size=2, timeout=TIMEOUT_S)
    assert str(info.value).startswith("rank 1 did not finish"), str(info.value)


# -- the analysis alone ------------------------------------------------------------------------------

def _entry(seq, op="all_reduce", sizes=((4,),), dtypes=("Float",), group="0", pg_id=0, created=0, out_sizes=None,
           out_dtypes=None):
    return {"collective_seq_id": seq, "pg_id": pg_id, "process_group": (group, ""), "profiling_name": f"gloo:{op}",
            "input_sizes": [list(s) for s in sizes], "input_dtypes": list(dtypes), "is_p2p": False,
            "output_sizes": [list(s) for s in (sizes if out_sizes is None else out_sizes)],
            "output_dtypes": list(dtypes if out_dtypes is None else out_dtypes), "time_created_ns": created}


def _record(entries, completed, groups=None):
    groups = groups or {"0": "[0, 1, 2]"}
    status = {}
    for e in entries:
        s = status.setdefault(str(e["pg_id"]), {"last_completed_collective": -1})
        s["last_completed_collective"] = completed.get(e["process_group"][0], -1)
    return {"entries": entries, "pg_status": status, "dump_time_ns": 30 * 10**9,
            "pg_config": {g: {"name": g, "desc": "", "ranks": r} for g, r in groups.items()}}


def test_the_rank_that_never_entered_is_named_with_where_it_is():
    waiting = _record([_entry(s, created=10 * 10**9) for s in (1, 2, 3)], {"0": 2})
    behind = _record([_entry(s) for s in (1, 2)], {"0": 2})
    lines = verdict({0: waiting, 1: behind, 2: waiting}, where={1: "in step (train.py:88)"})
    assert lines == ["rank(s) [1] never entered all_reduce #3 on group 0 [0, 1, 2] (rank(s) [0, 2] waiting in it for "
                     "20.0 s); rank 1 last entered all_reduce #2 (completed), and is now in step (train.py:88)"]


@pytest.mark.parametrize("others_done, said", [(True, "completed"), (False, "not completed")])
def test_a_call_is_completed_when_every_other_member_shows_it_completed(others_done, said):
    """A loaded machine: rank 1 returned from #2 and sleeps in user code, but its record still says
    #2 is only scheduled; ranks 0 and 2 completed #2 and wait in #3. The verdict and the summary
    read completion from every rank's record, so the load cannot change their words. Where
    another member has not completed #2 either, #2 is not completed."""
    waiting = _record([_entry(s, created=10 * 10**9) for s in (1, 2, 3)], {"0": 2})
    unsure = _record([_entry(s, created=10 * 10**9) for s in (1, 2, 3)], {"0": 2 if others_done else 1})
    behind = _record([_entry(1), _entry(2)], {"0": 1})
    records = {0: waiting, 1: behind, 2: unsure}
    lines = verdict(records, where={1: "in step (train.py:88)"})
    assert lines[0].endswith(f"rank 1 last entered all_reduce #2 ({said}), and is now in step (train.py:88)"), lines
    line = next(x for x in summary(records) if x.startswith("rank 1 group 0:"))
    assert line.endswith(f"#2 all_reduce(4 Float) {said}"), line


def test_the_first_call_that_differs_is_named_not_the_later_ones():
    r0 = _record([_entry(1), _entry(2, sizes=((4,),)), _entry(3, "broadcast")], {"0": 1})
    r1 = _record([_entry(1), _entry(2, sizes=((6,),)), _entry(3, "all_gather")], {"0": 1})
    lines = verdict({0: r0, 1: r1}, ranks=[0, 1])
    assert lines == ["ranks called different collectives at #2 on group 0 [0, 1, 2]: rank 0 all_reduce(4 Float); "
                     "rank 1 all_reduce(6 Float)"]


def test_calls_whose_ranks_rightly_give_other_sizes_are_no_mismatch():
    """As Gloo records them (torch 2.13): scatter's inputs are the source's alone, gather's outputs
    the destination's alone, and all_to_all with uneven splits has each rank's own sizes. None of
    them is two ranks calling different collectives; scatter's outputs and all_to_all's dtypes
    still must agree."""
    root = [_entry(1, "scatter", sizes=((2, 4),), out_sizes=((4,),)), _entry(2, "gather", out_sizes=((2, 4),)),
            _entry(3, "all_to_all", sizes=((2,),), out_sizes=((3,),))]
    other = [_entry(1, "scatter", sizes=(), dtypes=(), out_sizes=((4,),), out_dtypes=("Float",)),
             _entry(2, "gather", out_sizes=(), out_dtypes=()), _entry(3, "all_to_all", sizes=((4,),), out_sizes=((3,),))]
    assert verdict({0: _record(root, {"0": 3}), 1: _record(other, {"0": 3})}, ranks=[0, 1]) == []
    wrong = [_entry(1, "scatter", sizes=(), dtypes=(), out_sizes=((5,),), out_dtypes=("Float",))]
    lines = verdict({0: _record(root[:1], {"0": 0}), 1: _record(wrong, {"0": 0})}, ranks=[0, 1])
    assert lines[0].endswith("rank 0 scatter(4 Float); rank 1 scatter(5 Float)"), lines
    wrong = [_entry(3, "all_to_all", sizes=((2,),), dtypes=("Int",), out_sizes=((3,),))]
    lines = verdict({0: _record(root[2:], {"0": 2}), 1: _record(wrong, {"0": 2})}, ranks=[0, 1])
    assert lines[0].endswith("rank 0 all_to_all(2 Float); rank 1 all_to_all(2 Int)"), lines


def test_dtypes_differ_too():
    r0 = _record([_entry(1, dtypes=("Float",))], {"0": 0})
    r1 = _record([_entry(1, dtypes=("Int",))], {"0": 0})
    assert "rank 0 all_reduce(4 Float); rank 1 all_reduce(4 Int)" in verdict({0: r0, 1: r1})[0]


def test_a_group_whose_ranks_all_finished_says_nothing_and_a_silent_rank_is_named_only_with_a_finding():
    done = _record([_entry(1), _entry(2)], {"0": 2})
    assert verdict({0: done, 1: done, 2: None}) == []
    waiting = _record([_entry(1), _entry(2)], {"0": 1})
    behind = _record([_entry(1)], {"0": 1})
    lines = verdict({0: waiting, 1: behind, 2: None})
    assert lines[0].startswith("rank(s) [1] never entered all_reduce #2")
    assert lines[-1] == "rank(s) [2] did not answer (dead, or in C code that holds Python's lock)"


def test_a_subgroup_is_judged_on_its_own_members():
    groups = {"0": "[0, 1, 2]", "1": "[0, 1]"}
    r0 = _record([_entry(1), _entry(1, group="1", pg_id=1), _entry(2, group="1", pg_id=1)], {"0": 1, "1": 1}, groups)
    r1 = _record([_entry(1), _entry(1, group="1", pg_id=1)], {"0": 1, "1": 1}, groups)
    r2 = _record([_entry(1)], {"0": 1}, groups)
    lines = verdict({0: r0, 1: r1, 2: r2})
    assert len(lines) == 1 and lines[0].startswith("rank(s) [1] never entered all_reduce #2 on group 1 [0, 1] "), lines


_DUMP = {"version": "2.10", "comm_lib_version": "", "pg_config": {}, "pg_status": {}}  # torch's, without entries


@pytest.mark.parametrize("content, says", [
    (pickle.dumps([1, 2]), "not a flight-recorder dump (a pickled list without the 'version' and 'pg_config'"),
    (pickle.dumps({"entries": []}), "not a flight-recorder dump (a pickled dict without"),
    (pickle.dumps({**_DUMP, "entries": [1, 2]}), "its 'entries' are not torch's calls"),
    *[(pickle.dumps({**_DUMP, "entries": [_entry(1), {k: v for k, v in _entry(2).items() if k != key}]}),
       f"not a flight-recorder dump the reader can use (entry 1 has no '{key}'")
      for key in ("profiling_name", "input_sizes", "input_dtypes", "pg_id", "time_created_ns", "process_group",
                  "collective_seq_id")],
    (pickle.dumps({**_DUMP, "entries": []})[:20], "cannot unpickle it"),  # truncated
    (b"hello, not a pickle", "cannot unpickle it"),
])
def test_a_file_that_is_not_a_dump_is_named_in_one_line(content, says, tmp_path, capsys):
    (tmp_path / "rank_0").write_bytes(pickle.dumps({**_DUMP, "entries": []}))
    (tmp_path / "rank_1").write_bytes(content)
    with pytest.raises(SystemExit) as info:
        flight_recorder.main([str(tmp_path)])
    err = capsys.readouterr().err.strip().splitlines()
    assert info.value.code == 2 and len(err) == 1 and f"{tmp_path / 'rank_1'}: " in err[0] and says in err[0], err


def test_dumps_without_entries_say_they_cannot_show_anything(tmp_path, capsys):
    """With their own exit status: 0 read as "no hang" in scripts. With a rank's dump missing too,
    the missing rank's status (a planted reader that said 0 there passed every test)."""
    for rank in (0, 1):  # as torch writes them with includeCollectives=False
        (tmp_path / f"rank_{rank}").write_bytes(pickle.dumps(_DUMP))
    assert flight_recorder.main([str(tmp_path)]) == flight_recorder.CANNOT_TELL == 3
    out = capsys.readouterr().out
    assert "the records of rank(s) [0, 1] hold no calls" in out and "no hang or mismatch" not in out, out
    stamped = tmp_path / "stamped"
    stamped.mkdir()
    flight_recorder.write({0: dict(_DUMP)}, str(stamped / "rank_"), 2)  # a run of 2; rank 1 wrote nothing
    assert flight_recorder.main([str(stamped)]) == flight_recorder.MISSING == 1
    out = capsys.readouterr().out
    assert "hold no calls" in out and "rank(s) [1] of the run's 2 left no dump" in out, out


@pytest.mark.parametrize("value", ["lots", "", "-5", "2k"])
def test_a_buffer_size_torch_cannot_read_is_refused_before_any_rank_starts(value, monkeypatch):
    """torch aborts every rank in init_process_group on these (SIGABRT, read as a mismatch)."""
    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", value)
    monkeypatch.setattr(C.RankPool, "_collect", lambda *a, **k: pytest.fail("ranks were started"))
    with pytest.raises(ValueError, match=f"TORCH_FR_BUFFER_SIZE={value!r} is not a whole number of entries"):
        C.run(_rank, world_size=2, timeout=TIMEOUT_S)


def _rank(env):
    return env.rank


@pytest.mark.slow
def test_a_hang_whose_records_do_not_arrive_says_so(monkeypatch):
    """A verdict needs the records: when none arrives the report says that, not nothing."""
    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "2000")
    monkeypatch.setattr(flight_recorder, "collect", lambda conns, wait=flight_recorder.ANSWER_WAIT_S: {})
    with pytest.raises(C.RankFailure) as info:
        C.run(_skips_one_all_reduce, world_size=2, timeout=TIMEOUT_S)
    first = str(info.value).splitlines()[0]
    assert first == f"flight recorder: no live rank sent its record within {flight_recorder.ANSWER_WAIT_S:g} s", first


def _clear_settings(monkeypatch, **keep):
    """No COLLECTIVES_SHM_* or TORCH_FR_* setting at all, as a new user's shell has, but `keep`."""
    import os

    for var in list(os.environ):
        if var.startswith(("COLLECTIVES_SHM_", "TORCH_FR_")):
            monkeypatch.delenv(var)
    for var, value in keep.items():
        monkeypatch.setenv(var, value)


@pytest.mark.slow
@pytest.mark.parametrize("path", [None, ""], ids=["no settings at all", "COLLECTIVES_SHM_PATH empty"])
def test_a_hang_on_the_default_shm_world_leads_with_its_flight_record(path, monkeypatch):
    """The shm backend records by default on its native path: the launcher must read the world as
    recording when nothing is set (and when the path is set empty, which the backend reads as
    native), and lead with the verdict. Every other hang test sets a setting."""
    _clear_settings(monkeypatch, **({} if path is None else {"COLLECTIVES_SHM_PATH": path}))
    with pytest.raises(C.RankFailure) as info:
        C.run(_skips_one_all_reduce, world_size=2, backend="shm", timeout=TIMEOUT_S)
    first = str(info.value).splitlines()[0]
    assert first.startswith("flight recorder: rank(s) [1] never entered all_reduce #4 on group 0 [0, 1]"), str(info.value)


def _direct_all_reduce_one_rank_skips(env):
    import collectives.shm

    t = torch.ones(4)
    if env.rank == 1:
        time.sleep(600)  # never calls
    collectives.shm.all_reduce(t)


@pytest.mark.slow
def test_without_a_record_a_rank_waiting_in_a_direct_call_is_not_the_one_named_first(monkeypatch):
    """With recording off there is no verdict: the stacks decide, and a rank inside
    collectives.shm.all_reduce is waiting in a collective as much as one in dist.all_reduce, so
    the rank that never called leads."""
    _clear_settings(monkeypatch, TORCH_FR_BUFFER_SIZE="0")
    with pytest.raises(C.RankFailure) as info:
        C.run(_direct_all_reduce_one_rank_skips, world_size=2, backend="shm", timeout=TIMEOUT_S)
    lines = str(info.value).splitlines()
    assert lines[0].startswith("rank 1 did not finish within the 3 s timeout: in _direct_all_reduce_one_rank_skips"), lines[:6]
    assert "stopped because of it: rank(s) [0]" in str(info.value) and any(
        line.strip().startswith("rank 0 did not finish within the 3 s timeout: waiting in all_reduce") for line in lines), \
        lines[:8]


@pytest.mark.slow
def test_a_segment_too_large_leads_with_the_error_not_with_the_flight_recorder(monkeypatch):
    """A failure in start-up has no group and no record: waiting 15 s for records put 'no live rank
    sent its record' first, above rank 0's MemoryError that names the setting."""
    _clear_settings(monkeypatch, COLLECTIVES_SHM_SLOT_MB=str(1 << 20))  # 1 TiB a rank
    start = time.monotonic()
    with pytest.raises(C.RankFailure) as info:
        C.run(_rank, world_size=2, backend="shm", timeout=60)
    first = str(info.value).splitlines()[0]
    assert first.startswith("rank 0 raised MemoryError: the shm backend needs ") and \
        "COLLECTIVES_SHM_SLOT_MB lower" in first, str(info.value)[:2000]
    assert "flight recorder" not in str(info.value)
    assert time.monotonic() - start < LOADED_BOUND_S


def test_files_of_an_earlier_run_are_named_and_left_out(tmp_path, capsys):
    """rank_1 left from an earlier run (this run's rank 1 died and wrote nothing) used to be read
    with this run's rank_0: "no hang or mismatch", exit 0."""
    done = {**_DUMP, **_record([_entry(s) for s in (1, 2)], {"0": 2}, groups={"0": "[0, 1]"})}
    flight_recorder.write({0: done, 1: done}, str(tmp_path / "rank_"), 2)
    flight_recorder.write({0: done}, str(tmp_path / "rank_"), 2)  # this run: rank 1 wrote nothing
    code = flight_recorder.main([str(tmp_path)])
    out = capsys.readouterr().out.splitlines()
    assert code == 1, out
    assert out[0].startswith(f"left out {tmp_path / 'rank_1'}: written by another run (at "), out
    assert out[1] == ("the records of rank(s) [0] show no hang or mismatch, but rank(s) [1] of the run's 2 left no "
                      "dump of it, so what they did is unknown (a rank that died writes none)"), out
    assert not any(line.startswith("rank 1 group") for line in out), out
    records, world_size, notes = flight_recorder.read_run(str(tmp_path))
    assert sorted(records) == [0] and world_size == 2 and len(notes) == 1
    assert sorted(flight_recorder.read(str(tmp_path))) == [0, 1]  # read() itself takes every file


def test_torchs_dumps_of_another_world_size_are_named_and_left_out(tmp_path, capsys):
    """torch's own dumps carry no run stamp: the world size of their default group and the files'
    times tell the runs apart."""
    import os

    def dump(rank, world, mtime):
        record = {**_DUMP, **_record([_entry(s) for s in (1, 2)], {"0": 2}, groups={"0": str(list(range(world)))})}
        path = tmp_path / f"rank_{rank}"
        path.write_bytes(pickle.dumps(record))
        os.utime(path, (mtime, mtime))

    for rank in range(4):
        dump(rank, 4, 1_000_000)  # an earlier run of 4 ranks
    for rank in range(2):
        dump(rank, 2, 2_000_000)  # the latest, of 2: ranks 2 and 3 are the old run's
    dump(5, 2, 2_000_000)  # a rank a world of 2 does not have
    code = flight_recorder.main([str(tmp_path)])
    out = capsys.readouterr().out.splitlines()
    assert code == 0, out
    assert out[:3] == [f"left out {tmp_path / 'rank_2'}: a dump from a world of 4 ranks (the latest file, rank 0's, is "
                       "from a world of 2)",
                       f"left out {tmp_path / 'rank_3'}: a dump from a world of 4 ranks (the latest file, rank 0's, is "
                       "from a world of 2)",
                       f"left out {tmp_path / 'rank_5'}: rank 5 is not in the latest run's world of 2 ranks"], out
    assert out[3] == "the records of rank(s) [0, 1] show no hang or mismatch", out


def test_a_silent_rank_is_named_even_when_the_others_show_nothing():
    """A subgroup's waiting rank whose record did not arrive left the verdict empty: the failure
    then had no flight-recorder line at all, and nothing said why. (A group none of whose answering
    members entered a collective raised KeyError here.)"""
    done = _record([_entry(1, group="1", pg_id=1)], {"1": 1}, groups={"0": "[0, 1, 2]", "1": "[0, 1]"})
    where = {0: "waiting in all_reduce", 2: "in f (prog.py:9)"}  # 0 and 2 did not finish: a hang
    lines = verdict({1: done, 2: done}, where=where, ranks=range(3))
    assert lines == ["rank(s) [0] did not answer (dead, or in C code that holds Python's lock), and the records of "
                     "rank(s) [1, 2] show no hang by themselves"], lines
    dead = verdict({1: done, 2: done}, where=where, ranks=range(3), dead={0: "exited with code 1"})
    assert dead == ["rank(s) [0] died (rank 0 exited with code 1); rank(s) [1] last entered all_reduce(4 Float) #1 on "
                    "group 1 [0, 1]"], dead  # a dead rank is named as dead, not as silent
    assert verdict({1: done, 2: done}, ranks=range(3)) == []  # no hang (every rank finished): nothing to say


def test_a_rank_that_raised_is_waiting_in_nothing_whatever_its_record_says_yet():
    """Gloo marks a call that the peer's death ended as completed some time after the error reached
    Python: a record taken before then says "not completed". A rank whose work has ended (returned
    or raised) is named as having last entered the call, not as waiting in it."""
    behind = _record([_entry(s) for s in (1, 2, 3, 4)], {"0": 3}, groups={"0": "[0, 1]"})  # #4 not yet marked
    dead = {1: "exited with code 3"}
    assert verdict({0: behind}, ranks=range(2), dead=dead) == [
        "rank(s) [1] died (rank 1 exited with code 3); rank(s) [0] were waiting in all_reduce(4 Float) #4 on group 0 "
        "[0, 1]"]  # rank 0 still running
    assert verdict({0: behind}, ranks=range(2), dead=dead, ended=[0]) == [
        "rank(s) [1] died (rank 1 exited with code 3); rank(s) [0] last entered all_reduce(4 Float) #4 on group 0 "
        "[0, 1]"]


def test_a_hang_found_in_dumps_has_its_own_exit_status_and_a_rank_at_the_worlds_edge_is_left_out(tmp_path, capsys):
    """Exit 4 when the dumps show a hang (it was 0, what scripts read as "no hang"). And rank N's
    dump in a world of N (the first rank past it) is another run's: left out, named (the
    foreign rank in the test above is 5 in a world of 2, far past the edge)."""
    groups = {"0": "[0, 1]"}
    waiting = {**_DUMP, **_record([_entry(s, created=10 * 10**9) for s in (1, 2, 3)], {"0": 2}, groups=groups)}
    behind = {**_DUMP, **_record([_entry(s) for s in (1, 2)], {"0": 2}, groups=groups)}
    for rank, record in ((0, waiting), (1, behind), (2, behind)):  # rank 2: the edge of a world of 2
        (tmp_path / f"rank_{rank}").write_bytes(pickle.dumps(record))
    code = flight_recorder.main([str(tmp_path)])
    out = capsys.readouterr().out.splitlines()
    assert code == flight_recorder.FOUND == 4, out
    assert out[0] == f"left out {tmp_path / 'rank_2'}: rank 2 is not in the latest run's world of 2 ranks", out
    assert out[1].startswith("rank(s) [1] never entered all_reduce #3 on group 0 [0, 1]"), out


ORDER_SCRIPT = '''
import os, sys, time
import torch
import torch.distributed as dist
import collectives as C


def noop(env):
    return env.rank


def skips(env):
    t = torch.ones(4)
    for step in range(5):
        if env.rank == 1 and step == 3:
            time.sleep(600)
        dist.all_reduce(t)


if __name__ == "__main__":
    C.run(noop, world_size=2, backend="shm")  # first, with TORCH_FR_BUFFER_SIZE unset
    os.environ["TORCH_FR_BUFFER_SIZE"] = "2000"
    try:
        C.run(skips, world_size=3, backend="gloo", timeout=float(sys.argv[1]))
    except C.RankFailure as exc:
        print(str(exc).splitlines()[0])
'''


@pytest.mark.slow
def test_a_gloo_hang_is_named_after_an_shm_run_in_the_same_process(tmp_path):
    """The order that once lost the verdict: an shm run first (its ranks, and the fork server the
    later ranks come from, start while TORCH_FR_BUFFER_SIZE is unset), then the variable set and a
    Gloo hang: the later ranks must still keep torch's records, so the hang is named."""
    import subprocess
    import sys

    script = tmp_path / "order.py"
    script.write_text(ORDER_SCRIPT)
    import os

    env = {k: v for k, v in os.environ.items() if k != "TORCH_FR_BUFFER_SIZE"}
    out = subprocess.run([sys.executable, str(script), str(TIMEOUT_S)], capture_output=True, text=True, env=env,
                         timeout=LOADED_BOUND_S)
    assert out.stdout.startswith("flight recorder: rank(s) [1] never entered all_reduce #4 on group 0 [0, 1, 2]"), \
        out.stdout + out.stderr[-2000:]
