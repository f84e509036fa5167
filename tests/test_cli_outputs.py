"""Every command-line program checks its output files, its input files and its largest size
before it measures or trains: an output it cannot write (no such folder, a folder, a read-only
or full disk), a results file that is missing, not JSON or not the program's, a size or batch no
machine here can hold. Each is one line, exit code 2, and no rank is started.

    pytest tests/test_cli_outputs.py -q

The read-only and full disks are real: small tmpfs mounts (needs root; skipped otherwise).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess

import pytest

from benchmarks import algorithms, bandwidth, ddp_step_time, plot, sharded, shm, wrapper_overhead
from benchmarks.studies import harness_speed, shm_paths
from collectives import cli, output_files
from collectives.algorithms import fit, show
from collectives.launcher.pool import RankPool
from ddp_from_scratch import compare, trace, train
from ddp_from_scratch.workload.models import LAYER_OUTPUT_BYTES, MODELS, layer_output_bytes

# (program, arguments before the output path, the flag named, what the program appends to the path)
OUTPUTS = [
    (bandwidth.main, ["--json"], "--json", ""),
    (bandwidth.main, ["--csv"], "--csv", ""),
    (bandwidth.main, ["--plot"], "--plot", ".png"),
    (algorithms.main, ["--json"], "--json", ""),
    (shm.main, ["--json"], "--json", ""),
    (shm_paths.main, ["--json"], "--json", ""),
    (sharded.main, ["--json"], "--json", ""),
    (harness_speed.main, ["--json"], "--json", ""),
    (wrapper_overhead.main, ["--json"], "--json", ""),
    (ddp_step_time.main, ["--json"], "--json", ""),
    (trace.main, ["--out"], "--out", ""),
    (show.main, ["all_reduce", "--out"], "--out", ""),
    (fit.main, ["--out"], "--out", ""),
    (train.main, ["--synthetic", "--json"], "--json", ""),
    (plot.main, ["benchmarks/results/bandwidth_gloo-cpu-2core_2ranks_2026-11-22.json", "-o"], "-o", ".png"),
]
IDS = [f"{m.__module__.split('.')[-1]} {' '.join(a)}" for m, a, _, _ in OUTPUTS]


@pytest.fixture
def no_spawning(monkeypatch):
    """Any rank started fails the test: every check here must come first."""
    def refuse(self):
        raise AssertionError("a rank was started before the arguments were checked")
    monkeypatch.setattr(RankPool, "start", refuse)


def usage_error(main, argv, capsys) -> str:
    with pytest.raises(SystemExit) as info:
        main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert info.value.code == 2 and len(err) == 1, err  # one line, no usage block
    return err[0]


@contextlib.contextmanager
def tmpfs(path, options: str):
    """A real small filesystem at `path` (root only)."""
    path.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True).returncode:
        pytest.skip("mounting a tmpfs needs root")
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=True)


@pytest.mark.parametrize("main, argv, flag, suffix", OUTPUTS, ids=IDS)
def test_an_output_in_a_folder_that_does_not_exist_is_refused_first(main, argv, flag, suffix, tmp_path, capsys,
                                                                   no_spawning):
    missing = tmp_path / "no-such-folder" / "out"
    line = usage_error(main, argv + [str(missing) + suffix], capsys)
    assert f"{flag} {missing}" in line and "does not exist" in line, line


@pytest.mark.parametrize("main, argv, flag, suffix", OUTPUTS[:4] + OUTPUTS[-3:], ids=IDS[:4] + IDS[-3:])
def test_an_output_on_a_read_only_disk_is_refused_first(main, argv, flag, suffix, tmp_path, capsys, no_spawning):
    with tmpfs(tmp_path / "ro", "ro,size=1m") as ro:
        line = usage_error(main, argv + [str(ro / "out") + suffix], capsys)
    assert f"{flag} {ro / 'out'}" in line and "cannot write there (Read-only file system)" in line, line


@pytest.mark.parametrize("main, argv, flag, suffix", OUTPUTS[:2] + OUTPUTS[-2:], ids=IDS[:2] + IDS[-2:])
def test_an_output_on_a_full_disk_is_refused_first(main, argv, flag, suffix, tmp_path, capsys, no_spawning):
    with tmpfs(tmp_path / "full", "size=256k") as full:
        (full / "filler").write_bytes(b"x" * (200 * 1024))
        line = usage_error(main, argv + [str(full / "out") + suffix], capsys)
        assert "the disk is full" in line and flag in line, line
        assert sorted(p.name for p in full.iterdir()) == ["filler"]  # the check left nothing behind


def test_an_output_that_is_a_folder_is_refused(tmp_path, capsys, no_spawning):
    line = usage_error(bandwidth.main, ["--json", str(tmp_path)], capsys)
    assert f"--json {tmp_path} is a folder; give a file name" in line, line


def test_the_check_neither_truncates_an_existing_output_nor_leaves_a_new_one(tmp_path):
    import argparse

    parser = argparse.ArgumentParser()
    old, new = tmp_path / "old.json", tmp_path / "new.json"
    old.write_text("earlier results")
    cli.check_outputs(parser, {"--json": str(old), "--csv": str(new), "--plot": None})
    assert old.read_text() == "earlier results" and not new.exists()


def test_another_rank_removing_the_probe_first_is_not_an_error(tmp_path, monkeypatch):
    """Every rank of a torchrun job on hosts that share a folder checks the same --json path:
    one may remove the probe file between another's creating and removing it (seen in CI: a
    FileNotFoundError on node1's rank in tests/multinode/test_delay_and_loss.py)."""
    import argparse

    real_remove = os.remove

    def removed_first(path):  # the other rank wins the race
        real_remove(path)
        real_remove(path)

    monkeypatch.setattr(output_files.os, "remove", removed_first)
    path = tmp_path / "both.json"
    cli.check_outputs(argparse.ArgumentParser(), {"--json": str(path)})
    assert not path.exists()


def test_a_png_without_matplotlib_is_refused_before_measuring(tmp_path, capsys, monkeypatch, no_spawning):
    real = output_files.importlib.util.find_spec
    monkeypatch.setattr(output_files.importlib.util, "find_spec", lambda name: None if name == "matplotlib" else real(name))
    line = usage_error(bandwidth.main, ["--plot", str(tmp_path / "a.png")], capsys)
    assert "drawing needs matplotlib: pip install -e '.[plot]'" in line, line


# -- sizes no machine here can hold ----------------------------------------------------------------

@pytest.mark.parametrize("main, argv, says", [
    (bandwidth.main, ["-e", "1024G"], "-e: 2 rank(s) x 4 buffers of 1.0 TiB need ~8.0 TiB"),
    (shm.main, ["--world-size", "4", "-e", "64G"], "-e: 4 rank(s) x 4 buffers of 64.0 GiB need ~1.0 TiB"),
    (algorithms.main, ["-e", "1024G"], "need ~8.0 TiB"),
    (shm_paths.main, ["-e", "1024G"], "need ~16.0 TiB"),
    (train.main, ["--synthetic", "--nproc", "2", "--batch-size", "10000000"],
     "--batch-size: 2 rank(s) x 10000000 images x 2.50 MiB of resnet50's layer outputs need ~47.7 TiB"),
    (trace.main, ["--batch-size", "1000000"], "--batch-size: 2 rank(s) x 1000000 images"),
    (compare.main, ["--model", "resnet50", "--batch-size", "10000000"], "--batch-size: 4 rank(s) x 10000000 images"),
], ids=["bandwidth", "shm", "algorithms", "shm_paths", "train", "trace", "compare"])
def test_a_size_that_cannot_fit_is_refused_before_allocating(main, argv, says, capsys, no_spawning):
    line = usage_error(main, argv, capsys)
    assert says in line and "this machine has" in line and "available" in line, line


def test_sizes_that_fit_are_not_refused():
    import argparse

    parser = argparse.ArgumentParser()
    cli.check_memory(parser, "-e", 10 << 30, "test", available=11 << 30)
    with pytest.raises(SystemExit):
        cli.check_memory(parser, "-e", 12 << 30, "test", available=11 << 30)


@pytest.mark.parametrize("name", ["small", "resnet50"])
def test_the_layer_output_table_is_what_the_models_give(name):
    assert layer_output_bytes(MODELS[name]()) == LAYER_OUTPUT_BYTES[name]


# -- result files read back --------------------------------------------------------------------------

BAD_FILES = [
    (None, "no such file"),
    ("{not json", "not a JSON"),
    ("[1, 2]", "(a JSON list where an object with 'rows', 'environment' is expected)"),
    ('["rows", "environment"]', "(a JSON list where an object with 'rows'"),  # holds the key names: `in` finds them
    ('"rows, environment"', "(a JSON string where an object with 'rows'"),
    ('{"rows": [], "environment": {}}', "'rows' must be a non-empty list"),
    ('{"rows": [{"size": 8}], "environment": {"backend": "gloo", "world_size": 2, "device": "cpu", "date": "x"}}',
     "row 0 is not a measurement"),
]


@pytest.mark.parametrize("content, says", BAD_FILES, ids=["missing", "corrupt", "not an object", "a list of the keys",
                                                                  "a string of the keys", "no rows", "bad row"])
def test_plot_refuses_a_results_file_that_is_missing_or_wrong(content, says, tmp_path, capsys):
    path = tmp_path / "run.json"
    if content is not None:
        path.write_text(content)
    line = usage_error(plot.main, [str(path), "-o", str(tmp_path / "out.png")], capsys)
    assert f"file {path}" in line and says in line, line
    assert not (tmp_path / "out.png").exists()


@pytest.mark.slow
def test_plot_draws_a_real_results_file(tmp_path):
    out = tmp_path / "out.png"
    assert plot.main(["benchmarks/results/bandwidth_gloo-cpu-2core_2ranks_2026-11-22.json", "-o", str(out)]) == 0
    assert out.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("main, argv, flag", [
    (algorithms.main, ["--plot", "{tmp}/a.png", "--replot"], "--replot"),
    (sharded.main, ["--from-json"], "--from-json"),
], ids=["algorithms --replot", "sharded --from-json"])
@pytest.mark.parametrize("content, says", [(None, "no such file"), ("{not json", "not a JSON"), ('{"a": 1}', "(no ")],
                         ids=["missing", "corrupt", "wrong keys"])
def test_earlier_runs_read_back_are_checked(main, argv, flag, content, says, tmp_path, capsys, no_spawning):
    path = tmp_path / "run.json"
    if content is not None:
        path.write_text(content)
    line = usage_error(main, [a.format(tmp=tmp_path) for a in argv] + [str(path)], capsys)
    assert f"{flag} {path}" in line and says in line, line


@pytest.mark.slow
def test_a_real_earlier_run_replots(tmp_path):
    out = tmp_path / "race.png"
    run = "benchmarks/results/algorithms-race_gloo-cpu-2core_2ranks_2026-11-22.json"
    assert json.load(open(run))["rows"]
    assert algorithms.main(["--plot", str(out), "--replot", run]) == 0 and os.path.getsize(out) > 1000
