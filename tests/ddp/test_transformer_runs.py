"""The transformer runs' evaluation, sample and mixed precision on the layouts that lacked them:
a pipeline's validation loss (its forward alone through the stages) and sample (its stages
gathered into the one-rank model) are the one-rank model's; --amp trains every layout under
bfloat16 autocast within a small gap of float32; --compress acts on TP's and PP's data-parallel
all_reduce (PowerSGD's memories in the checkpoint); and a run's --deterministic is taken.

    pytest tests/ddp/test_transformer_runs.py -q
"""

from __future__ import annotations

import math

import pytest
import torch

from collectives.testing import run_on_ranks
from ddp_from_scratch import train
from ddp_from_scratch.train.args import TrainConfig, build_parser
from ddp_from_scratch.train.cp import train_cp
from ddp_from_scratch.train.ep import train_ep
from ddp_from_scratch.train.pp import train_pp
from ddp_from_scratch.train.sharded_checkpoint import one_rank_vector
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


def test_compression_acts_on_the_data_parallel_all_reduce_of_tp_and_pp():
    """fp16 on TP x DP and PowerSGD (rank 1, from step 2) on PP x DP: the runs train, their losses
    leave the uncompressed run's once the compression acts (a flag that did nothing would not),
    and fp16 stays close to it."""
    tp_dp = ("--tp", "2", "--batch-size", "4")
    plain, fp16 = _run(train_tp, 4, *tp_dp), _run(train_tp, 4, *tp_dp, "--compress", "fp16")
    gap = (torch.tensor(fp16["losses"]) - torch.tensor(plain["losses"])).abs()
    assert fp16["compress"] == "fp16" and 0 < gap.max() < 1e-2, gap
    pp_dp = ("--pp", "2", "--microbatches", "2", "--batch-size", "4")
    plain = _run(train_pp, 4, *pp_dp)
    low_rank = _run(train_pp, 4, *pp_dp, "--compress", "powersgd", "--powersgd-start-iter", "2")
    assert low_rank["losses"][:2] == plain["losses"][:2]  # plain all_reduce before its start iteration
    assert low_rank["losses"][2:] != plain["losses"][2:] and all(map(math.isfinite, low_rank["losses"]))


def test_a_powersgd_run_resumed_on_its_layout_is_bitwise(tmp_path):
    """Its error-feedback memories are in the shards: without them the resumed steps would differ."""
    flags = ("--tp", "1", "--batch-size", "4", "--compress", "powersgd", "--powersgd-start-iter", "2")
    unbroken = _run(train_tp, 2, *flags, "--checkpoint", str(tmp_path / "unbroken"))
    first = _run(train_tp, 2, *flags, "--checkpoint", str(tmp_path / "parts"), "--stop-at-step", "2")
    rest = _run(train_tp, 2, *flags, "--checkpoint", str(tmp_path / "parts"), "--resume")
    assert first["losses"] + rest["losses"] == unbroken["losses"] and rest["start_step"] == 2
    assert torch.equal(one_rank_vector(str(tmp_path / "parts")), one_rank_vector(str(tmp_path / "unbroken")))


@pytest.mark.parametrize("argv, fragment", [
    (["--cp", "2", "--nproc", "2", "--compress", "fp16"], "--compress: not taken with --cp"),
    (["--ep", "2", "--nproc", "2", "--compress", "bf16"], "--compress: not taken with --ep"),
    (["--tp", "2", "--nproc", "2", "--compress", "fp16"], "this layout has 1 data-parallel rank"),
    (["--tp", "1", "--nproc", "2", "--powersgd-rank", "2"], "--powersgd-rank applies to --compress powersgd"),
    (["--pp", "2", "--nproc", "4", "--compress", "powersgd", "--powersgd-start-iter", "1"],
     "--powersgd-start-iter must be at least 2"),
])
def test_what_compression_cannot_do_is_refused(argv, fragment, capsys, monkeypatch):
    monkeypatch.setattr("collectives.run_or_join", lambda *a, **k: pytest.fail("a rank started"))
    with pytest.raises(SystemExit) as info:
        train.main([*argv, "--synthetic"])
    err = capsys.readouterr().err
    assert info.value.code == 2 and fragment in err and len(err.strip().splitlines()) == 1, err
