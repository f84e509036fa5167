"""Every command-line program refuses nonsense in one line (no usage block) with exit code 2,
before any rank starts: sizes below 1, -b above -e, a step factor of 1 (it never reaches -e), zero steps or batches.

    pytest tests/test_cli_usage.py -q
"""

from __future__ import annotations

import os
import re
import sys

import pytest

from benchmarks import algorithms, bandwidth, shm, shm_native
from benchmarks.studies import recorder_cost, shm_paths, shm_small_path
from collectives.launcher.pool import RankPool
from collectives.algorithms import show
from ddp_from_scratch import trace

CASES = [
    (show.main, ["all_reduce", "--bytes", "-800"], "--bytes must be at least 1, got -800"),
    (show.main, ["all_reduce", "--bytes", "0"], "--bytes must be at least 1, got 0"),
    (trace.main, ["--steps", "0"], "--steps must be at least 1, got 0"),
    (trace.main, ["--batch-size", "0"], "--batch-size must be at least 1, got 0"),
    (trace.main, ["--world-size", "0"], "--world-size must be at least 1, got 0"),
    (bandwidth.main, ["-b", "64M", "-e", "8"], "-b 67108864 must be at least 1 and at most -e 8"),
    (bandwidth.main, ["-f", "1"], "-f 1: the step factor must be at least 2"),
    (bandwidth.main, ["--world-size", "1", "-c", "sendrecv"], "-c sendrecv needs 2 ranks or more"),
    (shm.main, ["-f", "1"], "-f 1: the step factor must be at least 2"),
    (shm.main, ["-b", "1M", "-e", "1K"], "must be at least 1 and at most -e 1024"),
    (shm_paths.main, ["-f", "1"], "-f 1: the step factor must be at least 2"),
    (algorithms.main, ["-f", "1"], "-f 1: the step factor must be at least 2"),
    (algorithms.main, ["--world-size", "0"], "--world-size must be at least 1, got 0"),
    (recorder_cost.main, ["--rounds", "1"], "--rounds must be at least 2, got 1"),
    (recorder_cost.main, ["--world-size", "1"], "--world-size must be at least 2, got 1"),
    (bandwidth.main, ["--timeout", "-1"], "--timeout must be a positive number of seconds, got -1.0"),
    (bandwidth.main, ["--timeout", "nan"], "--timeout must be a positive number of seconds, got nan"),
    (bandwidth.main, ["-n", "0"], "-n must be at least 1, got 0"),
    (bandwidth.main, ["-w", "-1"], "-w must be at least 0, got -1"),
    (trace.main, ["--model", "resnet50", "--batch-size", "1"],
     "ResNet-50's last BatchNorm would see one value per channel"),  # was a 138-line traceback from the ranks
    (trace.main, ["--impl", "zero2", "--bucket-cap-mb", "inf"], "--bucket-cap-mb must be a positive number of MiB, got inf"),
]


@pytest.mark.parametrize("main, argv, says", CASES, ids=[f"{m.__module__}:{' '.join(a)}" for m, a, _ in CASES])
def test_usage_errors_exit_2_in_one_line(main, argv, says, capsys):
    with pytest.raises(SystemExit) as info:
        main(argv)
    err = capsys.readouterr().err
    assert info.value.code == 2, err
    assert len(err.strip().splitlines()) == 1 and says in err and err.rstrip().endswith("(--help for usage)"), err


SWEEPS = [bandwidth.main, shm.main, shm_native.main, shm_paths.main, shm_small_path.main, algorithms.main]


@pytest.mark.parametrize("argv, says", [
    (["-b", "0"], r"(-b 0 must be at least 1 and at most -e|--minbytes must be at least \d+, got 0)"),
    (["-b", "64M", "-e", "8"], "-b 67108864 must be at least 1 and at most -e 8"),
    (["-b", "8", "-e", "64", "-f", "1"], "-f 1: the step factor must be at least 2"),
    (["-b", "8", "-e", "64", "-f", "0"], "-f 0: the step factor must be at least 2"),
], ids=["-b 0", "-b above -e", "-f 1", "-f 0"])
@pytest.mark.parametrize("main", SWEEPS, ids=[m.__module__ for m in SWEEPS])
def test_every_size_sweep_refuses_its_bounds_before_any_rank(main, argv, says, capsys, monkeypatch):
    """-b 0 never ends (0 x -f is 0, until MemoryError), -b above -e timed -e alone: every program
    with -b/-e/-f refuses them at both edges, in one line, before a rank starts."""
    monkeypatch.setattr(RankPool, "start", lambda self: pytest.fail("a rank was started before the sizes were checked"))
    with pytest.raises(SystemExit) as info:
        main(argv)
    err = capsys.readouterr().err
    assert info.value.code == 2 and len(err.strip().splitlines()) == 1 and re.search(says, err), err


def test_a_size_list_that_would_never_end_is_refused():
    from benchmarks.parts.sweep import size_list

    assert size_list(8, 64, 2) == [8, 16, 32, 64] and size_list(8, 100, 8, with_end=True) == [8, 64, 100]
    for begin, factor in ((0, 2), (8, 1), (-8, 2)):
        with pytest.raises(ValueError, match="a size sweep needs begin >= 1 and factor >= 2"):
            size_list(begin, 64, factor)


@pytest.mark.parametrize("content, says", [
    (None, "no such file (python -m collectives.algorithms.fit writes one)"),
    ("{not json", "is not one (a JSON object with numbers alpha, beta and gamma): JSONDecodeError"),
    ('{"alpha": 1e-5, "beta": 1e-9}', "is not one (a JSON object with numbers alpha, beta and gamma): no 'gamma' key"),
    ('{"alpha": 1e-5, "beta": "fast", "gamma": 0}', "is not one"),
    ('{"alpha": -1, "beta": 1e-9, "gamma": 0}', "must be finite and not negative"),
    ("[1, 2, 3]", "is not one"),
])
def test_a_cost_model_file_that_is_missing_or_wrong_is_a_usage_error(content, says, tmp_path, capsys):
    path = tmp_path / "model.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(SystemExit) as info:
        show.main(["all_reduce", "--model", str(path)])
    err = capsys.readouterr().err.strip().splitlines()
    assert info.value.code == 2 and f"error: --model: cost model {path}" in err[-1] and says in err[-1], err


def test_the_minimum_and_positive_checks_name_the_flag_as_typed(capsys):
    from collectives import cli

    parser = cli.ArgumentParser(prog="p")
    parser.add_argument("-n", "--iters", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=None)
    parser.add_argument("--lr", type=float, default=0.1)
    args = parser.parse_args([])
    cli.check_at_least(parser, args, {"-n": 3, "--batch-size": 1})  # at the minimum; None is not checked
    cli.check_positive(parser, args, ["--lr"])
    with pytest.raises(SystemExit):
        cli.check_at_least(parser, args, {"--iters": 4})
    assert "--iters must be at least 4, got 3" in capsys.readouterr().err
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        args.lr = bad
        with pytest.raises(SystemExit):
            cli.check_positive(parser, args, "--lr", "units")
        assert f"--lr must be a positive number of units, got {bad}" in capsys.readouterr().err
    with pytest.raises(KeyError, match="no option --nope"):
        cli.check_at_least(parser, args, {"--nope": 1})


def test_no_program_writes_the_minimum_check_by_hand():
    """"--flag must be at least N" is collectives.cli.check_at_least's, in every program: a loop
    of its own once drifted (one named the flag, another the dest)."""
    import pathlib
    import re

    root = pathlib.Path(__file__).resolve().parents[1]
    hand = re.compile(r"must be at least \{")
    found = [str(p.relative_to(root)) for folder in ("collectives", "ddp_from_scratch", "benchmarks")
             for p in (root / folder).rglob("*.py") if p.name != "cli.py" and hand.search(p.read_text())]
    assert found == [], found


@pytest.mark.parametrize("world_size, sendrecv", [(1, False), (2, True), (3, True)])
def test_all_collectives_at_one_rank_leave_out_sendrecv_and_say_so(world_size, sendrecv, monkeypatch):
    """sendrecv sends to the next rank: alone, every row read N/A with no word why."""
    for var in ("MASTER_ADDR", "WORLD_SIZE", "RANK", "LOCAL_RANK", "SLURM_PROCID"):
        monkeypatch.delenv(var, raising=False)
    parser = bandwidth.build_parser()
    args = parser.parse_args(["--world-size", str(world_size), "-c", "all"])
    bandwidth.validate(args, parser)
    assert ("sendrecv" in args.collective) == sendrecv and "all_reduce" in args.collective
    assert args.notes == ([] if sendrecv else ["# sendrecv left out: it needs 2 ranks or more (each rank sends to the next)"])


PROGRAMS_WITHOUT_PROG = ["collectives.demo", "ddp_from_scratch.compare", "ddp_from_scratch.trace",
                         "benchmarks.ddp_step_time", "benchmarks.wrapper_overhead", "benchmarks.plot",
                         "benchmarks.studies.ddp_hook_cost", "benchmarks.studies.suite_durations",
                         "benchmarks.studies.harness_speed"]


def _as_main(monkeypatch, module: str):
    """sys.modules["__main__"] as `python -m <module>` leaves it: a module whose spec names it."""
    import importlib.machinery
    import sys
    import types

    fake = types.ModuleType("__main__")
    fake.__spec__ = importlib.machinery.ModuleSpec(module, None) if module else None
    monkeypatch.setitem(sys.modules, "__main__", fake)


@pytest.mark.parametrize("running, module, says", [
    ("ddp_from_scratch.trace", "__main__", "python -m ddp_from_scratch.trace"),
    ("collectives.cluster.__main__", "__main__", "python -m collectives.cluster"),
    ("pytest", "benchmarks.bandwidth", "python -m benchmarks.bandwidth"),  # imported: its own name
    (None, "__main__", "prog.py"),  # a script run by its path
])
def test_a_program_names_itself_as_it_is_typed(running, module, says, monkeypatch):
    from collectives import cli

    _as_main(monkeypatch, running)
    monkeypatch.setattr("sys.argv", ["/some/where/prog.py"])
    assert cli.program_name(module) == says


def test_an_output_that_fails_at_the_end_names_the_program_run_with_dash_m(monkeypatch, capsys):
    import errno

    from collectives import cli, output_files

    def main(argv=None):
        raise output_files.OutputError("out.json", "--json", OSError(errno.ENOSPC, "No space left on device"))
    main.__module__ = "__main__"  # as under `python -m benchmarks.bandwidth`
    _as_main(monkeypatch, "benchmarks.bandwidth")
    assert cli.command(main)() == 1
    assert capsys.readouterr().err == ("python -m benchmarks.bandwidth: could not write --json out.json "
                                       "(No space left on device)\n")


def _stdout_on_a_pipe(monkeypatch, reader_closed: bool):
    """sys.stdout on the writing end of a new pipe, as `program | head` gives it; its reading end
    closed (head has read its lines and exited) or kept open. Returns the reading end or None."""
    import io

    read_end, write_end = os.pipe()
    if reader_closed:
        os.close(read_end)
    monkeypatch.setattr("sys.stdout", io.TextIOWrapper(io.FileIO(write_end, "w"), write_through=False))
    return None if reader_closed else read_end


def test_a_stdout_whose_reader_closed_ends_the_program_quietly_with_sigpipes_code(monkeypatch, capsys):
    """`python -m benchmarks.studies.suite_durations run.log | head`: what head did not read is
    dropped, with no traceback, neither from the print nor from the flush as Python exits."""
    from collectives import cli

    def main(argv=None):
        for i in range(100_000):
            print(f"row {i}")
        return 0

    with capsys.disabled():
        _stdout_on_a_pipe(monkeypatch, reader_closed=True)
        assert cli.command(main)() == 141
        print("still buffered as the program exits")
        sys.stdout.flush()  # what Python does at exit: stdout now leads nowhere, so no second error
        sys.stdout.close()


def test_a_broken_pipe_of_the_programs_own_keeps_its_traceback(monkeypatch, capsys):
    """Only stdout's reader going away is the user's doing; a pipe to a rank or a peer that broke
    is an error of the run, and must not pass for `| head`."""
    from collectives import cli

    def main(argv=None):
        print("a line the reader will get")
        raise BrokenPipeError(32, "Broken pipe")

    with capsys.disabled():
        read_end = _stdout_on_a_pipe(monkeypatch, reader_closed=False)
        with pytest.raises(BrokenPipeError):
            cli.command(main)()
        sys.stdout.close()
        assert os.read(read_end, 100) == b"a line the reader will get\n"
        os.close(read_end)


@pytest.mark.parametrize("module", PROGRAMS_WITHOUT_PROG)
def test_a_program_s_usage_error_names_it_as_python_dash_m(module, capsys, monkeypatch):
    import importlib

    _as_main(monkeypatch, module)  # as when run with -m: the parser is made then
    with pytest.raises(SystemExit) as info:
        importlib.import_module(module).main(["--no-such-flag"])
    err = capsys.readouterr().err
    assert info.value.code == 2 and err.startswith(f"python -m {module}: error: "), err


@pytest.mark.slow  # a fresh interpreter that imports torch
def test_trace_run_with_dash_m_names_itself_for_a_missing_folder(tmp_path):
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "ddp_from_scratch.trace", "--out", str(tmp_path / "none" / "t")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and out.stderr.startswith("python -m ddp_from_scratch.trace: error: "), out.stderr
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr
