"""The hook-cost benchmark runs (tiny settings), and its hooks really fire and fill the bucket.

    pytest tests/benchmarks/test_ddp_hook_cost.py -q
"""

import pytest
import torch
import torch.nn.functional as F

from benchmarks.studies import ddp_hook_cost


@pytest.mark.slow
def test_hook_cost_benchmark_smoke(capsys):
    assert ddp_hook_cost.main(["--rounds", "1", "--batch-size", "2"]) == 0
    text = capsys.readouterr().out
    for label in ("no hooks", "161 no-op hooks", "161 hooks scaling into a bucket", "index lookup and timestamp"):
        assert label in text


def test_recording_hooks_fire_once_per_parameter():
    model, events = ddp_hook_cost._hooked("the same, with index lookup and timestamp")
    F.cross_entropy(model(torch.randn(2, 3, 32, 32)), torch.tensor([1, 2])).backward()
    assert sorted(i for i, _ in events) == list(range(161))
