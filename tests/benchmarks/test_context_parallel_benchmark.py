"""benchmarks.context_parallel: a short run reports the activations a rank holds falling as 1/N
exactly (every saved tensor is per token), each rank's causal work in closed form both ways (the
head-tail layout's shares all 1/N), every variant timed with a prediction, and the ring drawn;
bad sizes refused before any rank starts.

    pytest tests/benchmarks/test_context_parallel_benchmark.py -q
"""

import json

import pytest

from benchmarks import context_parallel


def test_a_short_run_reports_memory_falling_as_one_over_n_and_the_shares(tmp_path, capsys):
    out, png = tmp_path / "cp.json", tmp_path / "cp.png"
    args = ["--ranks", "1", "2", "--seq", "16", "32", "--heads", "2", "--head-dim", "4", "--rounds", "1",
            "--backend", "gloo", "--json", str(out), "--plot", str(png)]
    assert context_parallel.main(args) == 0
    summary = json.loads(out.read_text())["summary"]
    memory = {int(n): {int(s): v for s, v in by_seq.items()} for n, by_seq in summary["memory"].items()}
    for seq in (16, 32):
        assert memory[1][seq][0] > 0 and memory[2][seq] == [memory[1][seq][0] // 2] * 2
    assert memory[1][32][0] == 2 * memory[1][16][0]  # linear in the sequence: no seq x seq matrix is kept
    shares = {(v["layout"], v["overlap"]): v for v in summary["variants"]}
    assert set(shares) == {("head-tail", True), ("head-tail", False), ("contiguous", True), ("contiguous", False)}
    assert shares[("head-tail", True)]["work_share_closed_form"] == [0.5, 0.5]
    assert shares[("contiguous", True)]["work_share_closed_form"] == pytest.approx([136 / 528, 392 / 528])
    assert all(v["seconds"] > 0 and v["predicted_seconds"] > 0 and len(v["timeline"]) == 2 for v in shares.values())
    assert summary["kv_bytes"] == 2 * 16 * 2 * 4 * 4
    assert png.stat().st_size > 0 and "compute share by rank" in capsys.readouterr().out


@pytest.mark.parametrize("argv, fragment", [
    (["--ranks", "4", "--seq", "12"], "--seq 12 must cut into 2 x 4 equal pieces"),
    (["--ranks", "0"], "--ranks must be 1 or more"),
    (["--heads", "0"], "--heads"),
])
def test_bad_sizes_are_refused_before_any_rank_starts(argv, fragment, capsys, monkeypatch):
    monkeypatch.setattr("collectives.run", lambda *a, **k: pytest.fail("a rank started"))
    with pytest.raises(SystemExit) as info:
        context_parallel.main(argv)
    assert info.value.code == 2 and fragment in capsys.readouterr().err
