"""benchmarks.pipeline_parallel: a short run measures every schedule at every microbatch count,
holds what each schedule must hold (GPipe every microbatch, 1F1B at most one a stage ahead),
draws each schedule's step, and refuses what cannot run before any rank starts. (How long the
bubble is, is the benchmark's to say on quiet cores, not a test's.)

    pytest tests/benchmarks/test_pipeline_parallel_benchmark.py -q
"""

import json

import pytest

from benchmarks import pipeline_parallel
from collectives.launcher.pool import RankPool


def test_a_short_run_measures_every_schedule_and_draws_them(tmp_path, capsys):
    out, prefix = tmp_path / "pp.json", tmp_path / "pp"
    argv = ["--stages", "2", "-m", "2", "4", "--rounds", "2", "--width", "32", "--depth", "2", "--json", str(out),
            "--timeline", str(prefix), "--timeline-m", "4"]
    assert pipeline_parallel.main(argv) == 0
    rows = {(r["schedule"], r["microbatches"]): r for r in json.loads(out.read_text())["rows"]}
    names = ("gpipe", "1f1b", "interleaved", "zero-bubble")
    assert set(rows) == {(name, m) for name in names for m in (2, 4)}
    for (name, m), row in rows.items():
        v = 2 if name == "interleaved" else 1  # --chunks 2 by default, for interleaved only
        assert row["closed_form"] == pytest.approx(1 / ((3 if name == "zero-bubble" else 1) * v * m + 1))
        if name != "interleaved":  # zero bubble: rank 1 keeps one microbatch until its delayed W
            assert row["in_flight_per_rank"] == ([m, m] if name == "gpipe" else [min(m, 2), 1 + (name != "1f1b")]), row
        assert all(0 <= b < 1 for b in row["bubble_per_rank"]) and row["step_ms"] > 0
        # torch.distributed.pipelining's schedule on the same stages, timed in the same rounds
        assert row["torch_step_ms"] > 0 and row["ours_over_torch"] > 0, row
        kinds = row["compute_ms_by_kind_per_rank"]
        split = name == "zero-bubble"
        for kind, there in (("F", True), ("B", not split), ("I", split), ("W", split)):
            assert all((ms > 0) == there for ms in kinds[kind]), (name, kind, kinds)
    # measured, not computed: GPipe holds all 4 microbatches' activations, 1F1B 2 on rank 0
    assert rows[("1f1b", 4)]["saved_bytes_per_rank"][0] * 2 == rows[("gpipe", 4)]["saved_bytes_per_rank"][0] > 0
    for name in names:
        assert (tmp_path / f"pp-{name}.png").read_bytes()[:4] == b"\x89PNG"
        events = json.loads((tmp_path / f"pp-{name}.json").read_text())["traceEvents"]
        computed = sorted(e["name"] for e in events if e["tid"] == "compute")
        chunks = ("", ":1") if name == "interleaved" else ("",)
        kinds = "FIW" if name == "zero-bubble" else "FB"
        assert computed == sorted([f"{k}{i}{c}" for k in kinds for i in range(4) for c in chunks] * 2), computed
    printed = capsys.readouterr().out
    assert "closed form, p=2" in printed and "interleaved" in printed
    assert "under torch.distributed.pipelining's schedules, in the same rounds" in printed
    assert "zero bubble's I + W against 1F1B's B" in printed


@pytest.mark.parametrize("argv, says", [
    (["--stages", "4", "-m", "2"], "-m 2: 1F1B needs at least as many microbatches as stages (4)"),
    (["--stages", "8", "--depth", "2", "--schedules", "gpipe"], "--stages 8 x --chunks 1: the model has 5 layers"),
    (["--stages", "2", "-m", "5", "--schedules", "interleaved"], "-m 5: interleaved runs the microbatches in rounds"),
    (["--stages", "2", "-m", "5", "--schedules", "zero-bubble"], "-m 5: zero-bubble runs the microbatches in rounds"),
    (["-m", "0"], "every microbatch count must be at least 1"),
    (["-m", "2", "4", "--timeline", "x", "--timeline-m", "3"], "--timeline-m 3 is not one of -m [2, 4]"),
    (["-m", "2", "4000000"], "-m: 2 ranks, each with the 4000000 microbatches' inputs of 32 x 512 floats"),
])
def test_what_cannot_run_is_refused_before_any_rank(argv, says, capsys, monkeypatch):
    monkeypatch.setattr(RankPool, "start", lambda self: pytest.fail("a rank started"))
    with pytest.raises(SystemExit) as info:
        pipeline_parallel.main(argv)
    err = capsys.readouterr().err
    assert info.value.code == 2 and len(err.strip().splitlines()) == 1 and says in err, err


def test_the_memory_estimate_counts_the_inputs_on_every_rank_and_gpipe_s_activations():
    one = 32 * 512 * 4
    assert pipeline_parallel.memory_needed(2, 16, 32, 512, 8) == 2 * 16 * one + 16 * one * 2 * 17
    # the default run fits in a few tens of MB; the count that allocated 13 GB is refused on 24 GiB
    assert pipeline_parallel.memory_needed(2, 16, 32, 512, 8) < 64 << 20
    assert pipeline_parallel.memory_needed(2, 200_000, 32, 512, 8) > 24 << 30
