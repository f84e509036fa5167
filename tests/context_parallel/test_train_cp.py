"""The training program's --cp run (ddp_from_scratch/train/cp.py, and train/pp.py with --pp): each
sequence cut over 2 ranks and attention by ring attention, alone, with data parallelism (CP x DP),
with tensor parallelism (CP x TP) and inside pipeline stages (CP x PP), trains with the one-rank model's losses step for step within float32
rounding; a rank saves half the activations; what --cp cannot take is refused before any rank
starts.

    pytest tests/context_parallel/test_train_cp.py -q
"""

from __future__ import annotations

import pytest
import torch

from collectives.testing import run_on_ranks
from ddp_from_scratch import train
from ddp_from_scratch.train.args import TrainConfig, build_parser
from ddp_from_scratch.train.cp import train_cp

GLOBAL_BATCH, STEPS = 8, 3
# Measured: 0 to 2 ulps of the loss (4.8e-7 at 5.7) over 4 steps; the merges of the ring and the
# all_reduce's sums are float32 in another order than one rank's kernel and mean.
LOSS_ATOL = 5e-6


def _run(cp: int, tp: int, dp: int, *extra: str) -> dict:
    args = build_parser().parse_args(["--cp", str(cp), "--tp", str(tp), "--synthetic", "--train-size",
                                      str(GLOBAL_BATCH * STEPS), "--batch-size", str(GLOBAL_BATCH // dp), "--lr", "0.05",
                                      *extra])
    summaries = run_on_ranks(train_cp, cp * tp * dp, args=(TrainConfig.from_args(args),), backend="gloo")
    assert all(s["losses"] == summaries[0]["losses"] for s in summaries)  # every rank logs the global mean
    return summaries[0]


def test_a_cp_run_has_the_one_rank_models_losses_on_cp_cp_x_dp_and_cp_x_tp():
    one = _run(1, 1, 1, "--sample", "24")
    assert len(set(one["losses"])) == STEPS  # it learns
    for cp, tp, dp in ((2, 1, 1), (2, 1, 2), (2, 2, 1)):
        split = _run(cp, tp, dp, "--sample", "24")
        case = f"--cp {cp} --tp {tp}, DP {dp}"
        assert (split["cp"], split["tp"], split["dp"], split["steps"]) == (cp, tp, dp, STEPS), case
        torch.testing.assert_close(torch.tensor(split["losses"]), torch.tensor(one["losses"]), rtol=0,
                                   atol=LOSS_ATOL, msg=case)
        assert abs(split["validation_loss"] - one["validation_loss"]) <= LOSS_ATOL, case  # evaluated at the end
        # the model put together on every rank (TP shards gathered) writes the one-rank model's bytes
        assert split["sample"] == one["sample"] and one["sample"], case
        if tp == 1:  # 1 / (cp x dp) of the tokens a rank: that share of the activations (but a few bytes)
            assert split["saved_bytes_first_step"] * cp * dp == pytest.approx(one["saved_bytes_first_step"], rel=1e-3)


def test_cp_x_pp_has_the_one_rank_models_losses():
    """2 pipeline stages (1F1B, 4 microbatches) of 2 context-parallel ranks each: the first stage
    embeds each CP rank's tokens at their places (the embedding piece holds them, not a buffer a
    DDP would broadcast from its first rank), and the blocks' ring runs inside each stage."""
    from ddp_from_scratch.train.pp import train_pp

    one = _run(1, 1, 1)
    args = build_parser().parse_args(["--cp", "2", "--pp", "2", "--synthetic", "--train-size", str(GLOBAL_BATCH * STEPS),
                                      "--batch-size", str(GLOBAL_BATCH), "--lr", "0.05"])
    summaries = run_on_ranks(train_pp, 4, args=(TrainConfig.from_args(args),), backend="gloo")
    split = summaries[0]
    assert all(s["losses"] == split["losses"] for s in summaries) and (split["pp"], split["cp"]) == (2, 2)
    torch.testing.assert_close(torch.tensor(split["losses"]), torch.tensor(one["losses"]), rtol=0, atol=LOSS_ATOL)


@pytest.mark.parametrize("argv, fragment", [
    (["--cp", "3", "--nproc", "4", "--synthetic"], "--cp 3 = 3 must divide the 4 rank(s)"),
    (["--cp", "3", "--nproc", "3", "--synthetic"], "32-token sequences do not cut into 2 x 3 equal pieces"),
    (["--cp", "2", "--pp", "2", "--nproc", "6", "--synthetic"], "--pp 2 x --cp 2 = 4 must divide the 6 rank(s)"),
    (["--cp", "2", "--ep", "2", "--nproc", "4", "--synthetic"], "--ep is not taken with --cp"),
    (["--cp", "2", "--tp", "2", "--nproc", "4", "--synthetic", "--sequence-parallel"],
     "--sequence-parallel is not taken with --cp"),
    (["--cp", "2", "--nproc", "2", "--text", "/dev/null"], "--text /dev/null: 0 bytes, too short: a window is 33 bytes"),
    (["--cp", "2", "--nproc", "2", "--synthetic", "--seq", "30"], "30-token sequences do not cut into 2 x 2 equal pieces"),
    (["--nproc", "1", "--synthetic", "--sample", "8"], "--sample applies to the transformer runs"),
])
def test_what_a_cp_run_cannot_take_is_refused_before_any_rank_starts(argv, fragment, capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("collectives.run_or_join", lambda *a, **k: pytest.fail("a rank started"))
    with pytest.raises(SystemExit) as info:
        train.main(argv)
    err = capsys.readouterr().err
    assert info.value.code == 2 and fragment in err, err
