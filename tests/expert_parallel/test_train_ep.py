"""The training program's --ep run (ddp_from_scratch/train_ep.py): the MoE transformer with its
experts over 2 ranks, and EP x DP on 2 x 2, train with the one-rank model's losses step for step
(a few float32 ulps), its balance losses, the same dropped slots and the same load per expert;
what --ep cannot take is refused before any rank starts.

    pytest tests/expert_parallel/test_train_ep.py -q
"""

from __future__ import annotations

import pytest
import torch

from collectives.testing import run_on_ranks
from ddp_from_scratch import train
from ddp_from_scratch.train_args import TrainConfig, build_parser
from ddp_from_scratch.train_ep import train_ep

GLOBAL_BATCH, STEPS = 8, 3
# Measured: 1 to 3 ulps of the loss (4.8e-7 at 5.7) over 4 steps on 2 and 4 ranks; 10 allowed.
# Routing is discrete, so a larger gap from a step on (a token whose top two probabilities sit
# within rounding of each other, picking the other expert) would mean a difference to look at.
LOSS_ATOL = 5e-6


def _config(ep: int, world_size: int, *extra: str) -> TrainConfig:
    args = build_parser().parse_args(["--ep", str(ep), "--synthetic", "--train-size", str(GLOBAL_BATCH * STEPS),
                                      "--batch-size", str(GLOBAL_BATCH // world_size), "--lr", "0.05",
                                      "--experts", "4", "--top-k", "2", *extra])
    return TrainConfig.from_args(args)


def _run(ep: int, world_size: int, *extra: str) -> dict:
    summaries = run_on_ranks(train_ep, world_size, args=(_config(ep, world_size, *extra),), backend="gloo")
    assert all(s["losses"] == summaries[0]["losses"] for s in summaries)  # every rank logs the global mean
    return summaries[0]


def test_an_ep_run_has_the_one_rank_models_losses_drops_and_load():
    """The same global batch every step, whatever the layout: after each SGD step with momentum
    the losses and balance losses are the one-rank model's within a few ulps, each sequence drops
    the same slots, and the experts of the first block took the same tokens in the last step."""
    one = _run(1, 1)
    assert len(set(one["losses"])) == STEPS and sum(one["dropped_slots"]) > 0  # it learns, and the capacity bites
    for ep, world_size in ((2, 2), (2, 4)):
        split = _run(ep, world_size)
        case = f"--ep {ep} on {world_size} ranks"
        assert split["steps"] == STEPS and split["dp"] == world_size // ep, case
        torch.testing.assert_close(torch.tensor(split["losses"]), torch.tensor(one["losses"]), rtol=0,
                                   atol=LOSS_ATOL, msg=case)
        torch.testing.assert_close(torch.tensor(split["aux_losses"]), torch.tensor(one["aux_losses"]), rtol=0,
                                   atol=LOSS_ATOL, msg=case)
        assert split["dropped_slots"] == one["dropped_slots"], case
        assert split["tokens_per_expert_last_step"] == one["tokens_per_expert_last_step"], case
        assert all(b > 0 for b in split["all_to_all_bytes_per_step"]) and one["all_to_all_bytes_per_step"][0] == 0


@pytest.mark.parametrize("argv, fragment", [
    (["--ep", "3", "--nproc", "2", "--synthetic"], "--ep 3 must divide the 2 rank(s)"),
    (["--ep", "2", "--nproc", "2", "--synthetic", "--experts", "3"], "--experts 3 must be a positive multiple of --ep 2"),
    (["--ep", "2", "--nproc", "2", "--synthetic", "--top-k", "5"], "--top-k 5 must be between 1 and the 4 experts"),
    (["--ep", "2", "--nproc", "2", "--synthetic", "--capacity-factor", "-1"], "--capacity-factor must be 0"),
    (["--ep", "2", "--nproc", "2", "--synthetic", "--aux-loss", "-0.1"], "--aux-loss must be 0 or more"),
    (["--ep", "2", "--tp", "2", "--nproc", "4", "--synthetic"], "composes with data parallelism only"),
    (["--ep", "2", "--nproc", "2"], "add --synthetic"),
    (["--ep", "2", "--nproc", "2", "--synthetic", "--impl", "torch"], "--impl torch: not taken with --ep"),
    (["--ep", "2", "--nproc", "2", "--synthetic", "--bucket-cap-mb", "1"], "--bucket-cap-mb 1.0: not taken with --ep"),
    (["--ep", "2", "--nproc", "2", "--synthetic", "--checkpoint", "ck"], "--checkpoint: not taken with --ep"),
    (["--nproc", "2", "--synthetic", "--experts", "4"], "--experts: applies to an --ep run"),
    (["--tp", "2", "--nproc", "2", "--synthetic", "--top-k", "2"], "--top-k: applies to an --ep run"),
])
def test_what_an_ep_run_cannot_take_is_refused_before_any_rank_starts(argv, fragment, capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("collectives.run_or_join", lambda *a, **k: pytest.fail("a rank started"))
    with pytest.raises(SystemExit) as info:
        train.main(argv)
    err = capsys.readouterr().err
    assert info.value.code == 2 and fragment in err, err
