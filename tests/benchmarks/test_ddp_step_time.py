"""The DDP step-time benchmark runs end to end (tiny settings) and reports every variant.

    pytest tests/benchmarks/test_ddp_step_time.py -q
"""

import json

from benchmarks import ddp_step_time


def test_step_time_benchmark_smoke(tmp_path, capsys):
    out = tmp_path / "steps.json"
    assert ddp_step_time.main(["--rounds", "1", "--batch-size", "2", "--caps", "25", "--skip-table", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    for label in ("torch, no_sync", "naive", "flat", "bucketed", "bucket_cap_mb sweep"):
        assert label in text
    report = json.loads(out.read_text())["seconds_per_step_median"]
    assert set(report["comparison"]) == {"torch", "torch, no_sync", "naive", "flat", "bucketed"}
    assert all(v > 0 for v in report["comparison"].values())
    assert set(report["bucket_cap_sweep"]) == {"torch cap 25", "bucketed cap 25"}
