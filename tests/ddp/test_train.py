"""The training program end to end (small model, synthetic data, 2 spawned ranks): a run resumed
from its checkpoint ends with exactly the parameters of an uninterrupted one; a missing dataset
is a clear message; torch's DDP with bf16 autocast runs; the summary says the data was synthetic.

    pytest tests/ddp/test_train.py -q
"""

import json

import pytest
import torch

from ddp_from_scratch import train

COMMON = ["--nproc", "2", "--model", "small", "--synthetic", "--train-size", "64", "--test-size", "32",
          "--batch-size", "8", "--lr", "0.05"]


def _final(folder):
    return torch.load(folder / "checkpoint.pt", weights_only=True)


def test_resume_ends_where_an_uninterrupted_run_ends(tmp_path, capsys):
    whole, split = tmp_path / "whole", tmp_path / "split"
    assert train.main(COMMON + ["--epochs", "3", "--checkpoint", str(whole)]) == 0
    assert train.main(COMMON + ["--epochs", "1", "--checkpoint", str(split)]) == 0
    assert train.main(COMMON + ["--epochs", "3", "--checkpoint", str(split), "--resume"]) == 0
    summaries = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert summaries[-1]["resumed_from_epoch"] == 1 and all(s["synthetic_data"] for s in summaries)
    a, b = _final(whole), _final(split)
    assert a["epoch"] == b["epoch"] == 3
    for key in a["model"]:
        assert torch.equal(a["model"][key], b["model"][key]), key


def test_missing_dataset_is_a_clear_message(tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        train.main(["--data", str(tmp_path)])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "cifar-10-python.tar.gz" in err and "--synthetic" in err


def test_torch_ddp_with_amp(tmp_path, capsys):
    out = tmp_path / "summary.json"
    assert train.main(COMMON + ["--impl", "torch", "--amp", "--epochs", "1", "--json", str(out)]) == 0
    summary = json.loads(out.read_text())
    assert summary["impl"] == "torch" and summary["amp"] and summary["world_size"] == 2
    assert 0.0 <= summary["test_accuracy"] <= 1.0 and summary["images_per_second"] > 0
