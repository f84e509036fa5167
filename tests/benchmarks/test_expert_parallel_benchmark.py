"""benchmarks.expert_parallel: a short run reports, for a router that sends every token to
expert 0 (a huge --skew, top-1), the closed forms: all of rank 1's rows cross to rank 0 and come
back, forward and backward (T x hidden x 4 bytes, four times); expert 0 takes every slot; with a
capacity it keeps ceil(F x seq / E) of each sequence and drops the rest; the picture is drawn;
bad sizes are refused before any rank starts.

    pytest tests/benchmarks/test_expert_parallel_benchmark.py -q
"""

import json
import math

import pytest

from benchmarks import expert_parallel

SMALL = ["--nproc", "2", "--experts", "4", "--top-k", "1", "--skew", "1000", "--steps", "2", "--tokens", "32",
         "--seq", "8", "--hidden", "8", "--backend", "gloo"]


def _rows(tmp_path, *extra):
    out = tmp_path / "ep.json"
    assert expert_parallel.main([*SMALL, "--json", str(out), *extra]) == 0
    return {(r["router"], r["aux_on"]): r for r in json.loads(out.read_text())["rows"]}


def test_a_router_that_sends_everything_to_one_expert_gives_the_closed_forms(tmp_path, capsys):
    rows = _rows(tmp_path, "--capacity-factor", "0", "--plot", str(tmp_path / "ep.png"))
    skewed = rows[("skewed", False)]
    assert skewed["bytes_per_step"] == 32 * 8 * 4 * 4  # rank 1's 32 rows of 8 floats: there and back, twice
    assert skewed["expert0_share_first"] == 1.0 and skewed["dropped_share"] == 0.0
    assert skewed["rank_imbalance_first"] == 2.0  # rank 0 takes both ranks' slots: twice the mean
    balanced = rows[("balanced", False)]
    # a balanced router sends about half of each rank's rows away: about the same bytes, from both ranks
    assert 0 < balanced["bytes_per_step"] < 2 * skewed["bytes_per_step"] and balanced["expert0_share_first"] < 1.0
    assert balanced["rank_imbalance_first"] < 2.0
    assert (tmp_path / "ep.png").stat().st_size > 0
    assert "MoE / dense" in capsys.readouterr().out


def test_the_capacity_drops_what_one_expert_cannot_take(tmp_path):
    rows = _rows(tmp_path, "--capacity-factor", "1.25")
    kept = math.ceil(1.25 * 8 * 1 / 4)  # of each sequence of 8
    assert rows[("skewed", False)]["dropped_share"] == pytest.approx((8 - kept) / 8)


@pytest.mark.parametrize("argv, fragment", [
    (["--nproc", "2", "--experts", "3"], "--experts 3 must be a positive multiple of --nproc 2"),
    (["--nproc", "2", "--top-k", "5"], "--top-k 5 must be at most the 4 experts"),
    (["--tokens", "30", "--seq", "8"], "--tokens 30 must be whole sequences of --seq 8"),
    (["--lr", "0"], "--lr"),
])
def test_bad_sizes_are_refused_before_any_rank_starts(argv, fragment, capsys, monkeypatch):
    monkeypatch.setattr("collectives.run", lambda *a, **k: pytest.fail("a rank started"))
    with pytest.raises(SystemExit) as info:
        expert_parallel.main(argv)
    assert info.value.code == 2 and fragment in capsys.readouterr().err
