"""The DDP step-time benchmark runs end to end (tiny settings) and reports every variant.

    pytest tests/benchmarks/test_ddp_step_time.py -q
"""

import json

import pytest

from benchmarks import ddp_step_time


@pytest.mark.slow
def test_step_time_benchmark_smoke(tmp_path, capsys):
    """The small model: what is checked is the program's path through every variant, which does
    not depend on the model (ResNet-50's path through the wrappers: tests/ddp/test_parity.py)."""
    out = tmp_path / "steps.json"
    assert ddp_step_time.main(["--model", "small", "--rounds", "1", "--batch-size", "2", "--caps", "25", "--skip-table",
                               "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert text.startswith("the small CNN"), text
    for label in ("torch again (control)", "torch, no_sync", "naive", "flat", "bucketed", "bucket_cap_mb sweep"):
        assert label in text
    report = json.loads(out.read_text())["seconds_per_step"]
    assert set(report["comparison"]) == {"torch", "torch again (control)", "torch, no_sync", "naive", "flat",
                                         "bucketed", "bucketed, timeline=False"}
    assert all(e["median_s"] > 0 and len(e["steps"]) == 1 for e in report["comparison"].values())
    assert report["comparison"]["torch"]["ratio"] == 1
    assert set(report["bucket_cap_sweep"]["25"]) == {"torch", "bucketed"}


def test_ratios_are_paired_within_rounds():
    times = {"torch": [1.0, 2.0, 4.0], "ours": [1.1, 2.2, 4.4]}  # 10% slower in every round
    summary = ddp_step_time.summarise(times, "torch")
    assert abs(summary["ours"]["ratio"] - 1.1) < 1e-12 and summary["ours"]["median_s"] == 2.2
    assert abs(summary["ours"]["ratio_q1"] - 1.1) < 1e-12 and abs(summary["ours"]["ratio_q3"] - 1.1) < 1e-12
