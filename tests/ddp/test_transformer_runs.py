"""The transformer runs' evaluation, sample and mixed precision on the layouts that lacked them:
a pipeline's validation loss (its forward alone through the stages) and sample (its stages
gathered into the one-rank model) are the one-rank model's; --amp trains every layout under
bfloat16 autocast within a small gap of float32, and a run's --deterministic is taken.

    pytest tests/ddp/test_transformer_runs.py -q
"""

from __future__ import annotations

import pytest
import torch

from collectives.testing import run_on_ranks
from ddp_from_scratch.train.args import TrainConfig, build_parser
from ddp_from_scratch.train.cp import train_cp
from ddp_from_scratch.train.ep import train_ep
from ddp_from_scratch.train.pp import train_pp
from ddp_from_scratch.train.tp import train_tp

COMMON = ["--train-size", "32", "--lr", "0.05", "--eval-every", "2", "--seed", "1"]  # 4 steps of 8 sequences


def _run(loop, ranks: int, *flags: str) -> dict:
    config = TrainConfig.from_args(build_parser().parse_args([*flags, *COMMON]))
    summaries = run_on_ranks(loop, ranks, args=(config,), backend="gloo", timeout=300)
    assert all(s["validation"] == summaries[0]["validation"] for s in summaries)  # every rank reports the same
    return summaries[0]


@pytest.fixture(scope="module")
def one_rank():
    return _run(train_tp, 1, "--tp", "1", "--batch-size", "8", "--sample", "16")


@pytest.mark.parametrize("flags, ranks", [
    (("--pp", "2", "--schedule", "1f1b", "--microbatches", "2", "--batch-size", "8"), 2),
    (("--pp", "2", "--schedule", "interleaved", "--microbatches", "2", "--batch-size", "4"), 4),  # PP x DP, 2 chunks
], ids=["pp2", "pp2xdp2-interleaved"])
def test_a_pipeline_evaluates_and_samples_as_the_one_rank_model(flags, ranks, one_rank):
    got = _run(train_pp, ranks, *flags, "--sample", "16")
    assert [v["step"] for v in got["validation"]] == [v["step"] for v in one_rank["validation"]] == [2, 4]
    torch.testing.assert_close(torch.tensor([v["loss"] for v in got["validation"]]),
                               torch.tensor([v["loss"] for v in one_rank["validation"]]), rtol=1e-5, atol=1e-6)
    assert got["validation"][1]["loss"] < got["validation"][0]["loss"]  # it learned between the two
    assert got["sample"] == one_rank["sample"] and len(one_rank["sample"].encode()) >= 16


@pytest.mark.parametrize("loop, ranks, flags", [
    (train_tp, 1, ("--tp", "1", "--batch-size", "8")),
    (train_tp, 2, ("--tp", "2", "--batch-size", "8", "--sequence-parallel")),
    (train_pp, 2, ("--pp", "2", "--schedule", "zero-bubble", "--microbatches", "2", "--batch-size", "8")),
    (train_cp, 2, ("--cp", "2", "--batch-size", "8")),
    (train_ep, 2, ("--ep", "2", "--batch-size", "4")),
], ids=["one-rank", "tp2+sp", "pp2-zero-bubble", "cp2", "ep2"])
def test_amp_trains_every_layout_close_to_float32(loop, ranks, flags):
    """bfloat16 keeps 8 bits of mantissa: the losses move by a few thousandths, not more, and
    they are not float32's (a flag that did nothing would give exactly those)."""
    plain, amp = _run(loop, ranks, *flags), _run(loop, ranks, *flags, "--amp")
    assert amp["amp"] and not plain["amp"]
    gap = (torch.tensor(amp["losses"]) - torch.tensor(plain["losses"])).abs()
    assert 0 < gap.max() < 0.02, gap
    assert abs(amp["validation_loss"] - plain["validation_loss"]) < 0.02


def test_deterministic_is_taken_and_changes_nothing_on_the_cpu(one_rank):
    got = _run(train_tp, 1, "--tp", "1", "--batch-size", "8", "--sample", "16", "--deterministic")
    assert got["losses"] == one_rank["losses"] and got["sample"] == one_rank["sample"]
