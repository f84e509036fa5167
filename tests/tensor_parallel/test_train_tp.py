"""The training program's --tp run (ddp_from_scratch/train/tp.py): TP over 2, TP x DP on 2 x 2 and
TP with sequence parallelism train the small transformer with the one-rank model's losses, step
for step, within float32 rounding; TP sends the closed form's elements; what --tp cannot take is
refused before any rank starts.

    pytest tests/tensor_parallel/test_train_tp.py -q
"""

from __future__ import annotations

import pytest
import torch

from collectives.testing import run_on_ranks
from ddp_from_scratch import train
from ddp_from_scratch.tensor_parallel.messages import Shape, step_messages
from ddp_from_scratch.train.args import TrainConfig, build_parser
from ddp_from_scratch.train.tp import HEADS, HIDDEN, LAYERS, SEQ, VOCAB, train_tp

GLOBAL_BATCH, STEPS = 8, 3


def _config(tp: int, dp: int, *extra: str) -> TrainConfig:
    args = build_parser().parse_args(["--tp", str(tp), "--synthetic", "--train-size", str(GLOBAL_BATCH * STEPS),
                                      "--batch-size", str(GLOBAL_BATCH // dp), "--lr", "0.05", *extra])
    return TrainConfig.from_args(args)


def _losses(tp: int, dp: int, *extra: str) -> list:
    summaries = run_on_ranks(train_tp, tp * dp, args=(_config(tp, dp, *extra),), backend="gloo")
    assert all(s["losses"] == summaries[0]["losses"] for s in summaries)  # every rank logs the global mean
    return summaries[0]


@pytest.mark.parametrize("tp, dp, extra", [(2, 1, ()), (2, 2, ()), (2, 1, ("--sequence-parallel",)),
                                          (2, 2, ("--bucket-cap-mb", "0.05"))],
                         ids=["tp2", "tp2xdp2", "tp2+sp", "tp2xdp2-buckets"])  # the last: ~6 buckets a rank
def test_a_tp_run_has_the_one_rank_models_losses(tp, dp, extra):
    """The same global batch every step, whatever the layout: the split model's losses after each
    SGD step are the one-rank model's, within float32 rounding (the partial sums add in another
    order), over 3 steps with momentum; and TP all-reduced the closed form's elements."""
    one = _losses(1, 1)
    split = _losses(tp, dp, *extra)
    assert one["steps"] == split["steps"] == STEPS
    torch.testing.assert_close(torch.tensor(split["losses"]), torch.tensor(one["losses"]), rtol=1e-5, atol=1e-6)
    assert len(set(one["losses"])) == STEPS  # the model learns: a run that never stepped would not match
    want = step_messages(Shape(VOCAB, HIDDEN, HEADS, LAYERS, GLOBAL_BATCH * SEQ), tp * dp, tp).elements["tp"]
    if "--sequence-parallel" in extra:  # sequence parallelism: each T h all_reduce is a reduce_scatter of T h and an all_gather of T h / p
        tokens = GLOBAL_BATCH // dp * SEQ
        want = (4 * LAYERS + 2) * tokens * HIDDEN * (tp + 1) // tp + 3 * tokens
    assert split["tp_elements_per_step"] == want and one["tp_elements_per_step"] == 0
    buckets = split["dp_buckets"]  # the small cap: several buckets (whole parameters each), so a second bucket runs
    assert (buckets > 1 if "--bucket-cap-mb" in extra else buckets == (dp > 1)), buckets


@pytest.mark.parametrize("argv, fragment", [
    (["--tp", "3", "--nproc", "3", "--synthetic"], "--tp 3 does not divide the transformer's 4 heads"),
    (["--tp", "2", "--nproc", "3", "--synthetic"], "--tp 2 must divide the 3 rank(s)"),
    (["--tp", "2", "--nproc", "2", "--text", "missing.txt"], "--text missing.txt: cannot read it (No such file"),
    (["--tp", "2", "--nproc", "2", "--synthetic", "--impl", "torch"], "--impl torch is not taken with --tp"),
    (["--tp", "2", "--nproc", "2", "--synthetic", "--compress", "fp16"], "this layout has 1 data-parallel rank"),
    (["--tp", "4", "--nproc", "4", "--synthetic", "--heads", "6", "--hidden", "48"],
     "--tp 4 does not divide the transformer's 6 heads"),
    (["--tp", "1", "--nproc", "1", "--synthetic", "--hidden", "30"], "--hidden 30 does not split into --heads 4"),
    (["--tp", "2", "--nproc", "2", "--synthetic", "--sequence-parallel", "--seq", "33"],
     "--tp 2 does not divide the 33-token sequences"),
    (["--nproc", "1", "--synthetic", "--layers", "3"], "--layers: applies to the transformer runs"),
    (["--tp", "1", "--nproc", "1", "--synthetic", "--seq", "0"], "--seq must be at least 1"),
    (["--nproc", "2", "--synthetic", "--sequence-parallel"], "--sequence-parallel applies to a --tp run"),
    (["--tp", "1", "--nproc", "1", "--synthetic", "--sequence-parallel"], "give --tp 2 or more"),
    (["--tp", "2", "--nproc", "4", "--synthetic", "--train-size", "8", "--batch-size", "8"],
     "8 sequences make no full step of 8 per DP rank on 2 DP rank(s)"),
])
def test_what_a_tp_run_cannot_take_is_refused_before_any_rank_starts(argv, fragment, capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("collectives.run_or_join", lambda *a, **k: pytest.fail("a rank started"))
    with pytest.raises(SystemExit) as info:
        train.main(argv)
    assert info.value.code == 2 and fragment in capsys.readouterr().err


# A value each flag takes; the rest are switches.
_VALUES = {"compress": "fp16", "powersgd_rank": "2", "powersgd_start_iter": "10", "test_size": "10"}


@pytest.mark.parametrize("name", ["compress", "compress powersgd", "powersgd_rank", "powersgd_start_iter", "test_size",
                                  "model small", "model resnet50"])
def test_every_flag_a_tp_run_cannot_take_is_refused_alone(name, capsys, monkeypatch, tmp_path):
    """Each one by itself (a check that returned early let --powersgd-rank through, and --model
    small trained the transformer): the whole option space, not a sample of it. Here, on TP alone,
    --compress has no data-parallel all_reduce to act on; the ResNet run's other flags (--amp,
    --deterministic, the checkpoint's, --compress with DP ranks) work with the transformer runs
    (tests/ddp/test_transformer_checkpoint.py, tests/ddp/test_transformer_runs.py)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("collectives.run_or_join", lambda *a, **k: pytest.fail("a rank started"))
    flag, _, value = name.partition(" ")
    argv = [f"--{flag.replace('_', '-')}"] + ([value or _VALUES[flag]] if value or flag in _VALUES else [])
    with pytest.raises(SystemExit) as info:
        train.main(["--tp", "2", "--nproc", "2", "--synthetic", *argv])
    err = capsys.readouterr().err
    assert info.value.code == 2 and len(err.strip().splitlines()) == 1 and argv[0] in err, err
