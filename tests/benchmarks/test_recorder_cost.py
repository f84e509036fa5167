"""benchmarks.studies.recorder_cost: the two groups really differ only in recording, and the summary is
the medians' ratio.

    pytest tests/benchmarks/test_recorder_cost.py -q
"""

import json

import pytest

from benchmarks.studies import recorder_cost


def test_the_summary_is_the_ratio_of_medians():
    raw = {"all_reduce_8B_us": {"recording": [12.0, 10.0, 11.0], "off": [10.0, 9.0, 11.0]},
           "ddp_step_s": {"recording": [2.0, 2.0, 2.0], "off": [1.0, 1.0, 1.0]}}
    s = recorder_cost.summarise(raw)
    assert s["all_reduce_8B_us"]["recording"] == 11.0 and s["all_reduce_8B_us"]["off"] == 10.0
    assert s["all_reduce_8B_us"]["ratio"] == pytest.approx(1.1) and s["ddp_step_s"]["ratio"] == 2.0
    assert "recording adds +10.0% to an 8-byte all_reduce" in recorder_cost.report(s, 2)


def test_a_short_run_measures_both_sides(tmp_path, capsys):
    out = tmp_path / "cost.json"
    assert recorder_cost.main(["--rounds", "3", "--iters", "5", "--batch", "2", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "us per 8-byte all_reduce: recording" in printed and "s per DDP step: recording" in printed
    saved = json.loads(out.read_text())
    assert len(saved["raw"]["all_reduce_8B_us"]["recording"]) == 3 == len(saved["raw"]["all_reduce_8B_us"]["off"])
    assert saved["command"].startswith("python -m benchmarks.studies.recorder_cost --rounds 3")
