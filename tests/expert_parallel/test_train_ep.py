"""The training program's --ep run (ddp_from_scratch/train/ep.py): the MoE transformer with its
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
from ddp_from_scratch.train.args import TrainConfig, build_parser
from ddp_from_scratch.train.ep import train_ep

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
    one = _run(1, 1, "--sample", "24")
    assert len(set(one["losses"])) == STEPS and sum(one["dropped_slots"]) > 0  # it learns, and the capacity bites
    for ep, world_size in ((2, 2), (2, 4)):
        split = _run(ep, world_size, "--sample", "24")
        case = f"--ep {ep} on {world_size} ranks"
        assert split["steps"] == STEPS and split["dp"] == world_size // ep, case
        torch.testing.assert_close(torch.tensor(split["losses"]), torch.tensor(one["losses"]), rtol=0,
                                   atol=LOSS_ATOL, msg=case)
        torch.testing.assert_close(torch.tensor(split["aux_losses"]), torch.tensor(one["aux_losses"]), rtol=0,
                                   atol=LOSS_ATOL, msg=case)
        assert split["dropped_slots"] == one["dropped_slots"], case
        assert split["sample"] == one["sample"] and one["sample"], case  # every expert gathered to sample
        assert abs(split["validation_loss"] - one["validation_loss"]) <= LOSS_ATOL, case  # evaluated at the end
        assert split["tokens_per_expert_last_step"] == one["tokens_per_expert_last_step"], case
        assert all(b > 0 for b in split["all_to_all_bytes_per_step"]) and one["all_to_all_bytes_per_step"][0] == 0


@pytest.mark.parametrize("argv, fragment", [
    (["--ep", "3", "--nproc", "2", "--synthetic"], "--ep 3 must divide the 2 rank(s)"),
    (["--ep", "2", "--nproc", "2", "--synthetic", "--experts", "3"], "--experts 3 must be a positive multiple of --ep 2"),
    (["--ep", "2", "--nproc", "2", "--synthetic", "--top-k", "5"], "--top-k 5 must be between 1 and the 4 experts"),
    (["--ep", "2", "--nproc", "2", "--synthetic", "--capacity-factor", "-1"], "--capacity-factor must be 0"),
    (["--ep", "2", "--nproc", "2", "--synthetic", "--aux-loss", "-0.1"], "--aux-loss must be 0 or more"),
    (["--ep", "2", "--tp", "2", "--nproc", "4", "--synthetic"], "composes with data parallelism only"),
    (["--ep", "2", "--nproc", "2", "--synthetic", "--text", "a.txt"], "--text and --synthetic: give one"),
    (["--ep", "2", "--nproc", "2", "--synthetic", "--impl", "torch"], "--impl torch: not taken with --ep"),
    (["--ep", "2", "--nproc", "2", "--synthetic", "--bucket-cap-mb", "1"], "--bucket-cap-mb 1.0: not taken with --ep"),
    (["--ep", "2", "--nproc", "2", "--synthetic", "--resume"], "--resume needs --checkpoint FOLDER"),
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


def _state(folder, world_size):
    from ddp_from_scratch.parts import shards

    manifest = shards.read_manifest(str(folder))
    return manifest, [shards.load_shard(str(folder), r, manifest) for r in range(world_size)]


def test_a_run_stopped_and_resumed_on_ep_x_dp_ends_bitwise_equal_to_the_unbroken_run(tmp_path):
    """EP x DP, 2 x 2: 4 steps unbroken against 2 steps, a stop, and --resume for the other 2. The
    resumed run's losses are the unbroken run's last two, bit for bit, and every rank's parameters,
    momentum and experts at the end are the same bits."""
    whole = _run(2, 4, "--train-size", "32", "--checkpoint", str(tmp_path / "whole"))
    first = _run(2, 4, "--train-size", "32", "--checkpoint", str(tmp_path / "parts"), "--stop-at-step", "2")
    assert first["losses"] == whole["losses"][:2] and first["end_step"] == 2
    assert _state(tmp_path / "parts", 4)[0]["step"] == 2
    rest = _run(2, 4, "--train-size", "32", "--checkpoint", str(tmp_path / "parts"), "--resume")
    assert rest["start_step"] == 2 and rest["losses"] == whole["losses"][2:], (rest["losses"], whole["losses"])
    (m1, a), (m2, b) = _state(tmp_path / "whole", 4), _state(tmp_path / "parts", 4)
    assert m1["step"] == m2["step"] == 4 and m1["layout"] == m2["layout"]
    for rank, (x, y) in enumerate(zip(a, b)):
        for part in ("model", "experts"):
            assert x[part].keys() == y[part].keys()
            assert all(torch.equal(x[part][k], y[part][k]) for k in x[part]), (rank, part)
        momentum = lambda s: [v["momentum_buffer"] for _, v in sorted(s["optimizer"]["state"].items())]  # noqa: E731
        assert all(torch.equal(p, q) for p, q in zip(momentum(x), momentum(y))), rank
    # each row of 2 ranks holds every expert of each block once (2 blocks x 4 experts x 2 weights and 2 biases),
    # and the ranks of a column hold the same experts with the same bits (their gradients were averaged)
    row = [k for shard in a[:2] for k in shard["experts"]]
    assert len(row) == len(set(row)) == 2 * 4 * 4
    for r in (0, 1):
        assert a[r]["experts"].keys() == a[r + 2]["experts"].keys()
        assert all(torch.equal(a[r]["experts"][k], a[r + 2]["experts"][k]) for k in a[r]["experts"])


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ep-checkpoint")
    _run(2, 2, "--train-size", "16", "--checkpoint", str(folder / "ck"))  # 2 steps of 8
    return folder / "ck"


def _refused(argv, capsys, monkeypatch):
    monkeypatch.setattr("collectives.run_or_join", lambda *a, **k: pytest.fail("a rank started"))
    with pytest.raises(SystemExit) as info:
        train.main(argv)
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    return info.value.code, err


EP_ARGS = ["--ep", "2", "--nproc", "2", "--synthetic", "--train-size", "16", "--batch-size", "4", "--lr", "0.05",
           "--experts", "4", "--top-k", "2"]


def test_a_damaged_shard_is_refused_in_one_line_naming_it(saved, tmp_path, capsys, monkeypatch):
    import shutil

    copy = tmp_path / "ck"
    shutil.copytree(saved, copy)
    shard = copy / "shard-00001-of-00002.pt"
    shard.write_bytes(shard.read_bytes()[:100])
    code, err = _refused([*EP_ARGS, "--epochs", "2", "--checkpoint", str(copy), "--resume"], capsys, monkeypatch)
    assert code == 2 and f"{shard} is damaged or from another save" in err


def test_a_foreign_or_other_layout_checkpoint_is_refused_in_one_line(saved, tmp_path, capsys, monkeypatch):
    import shutil

    code, err = _refused([*EP_ARGS, "--epochs", "2", "--experts", "6", "--checkpoint", str(saved), "--resume"],
                         capsys, monkeypatch)
    assert code == 2 and "experts 4 in the checkpoint, 6 now" in err
    foreign = tmp_path / "foreign"
    shutil.copytree(saved, foreign)
    (foreign / "manifest.json").write_text('{"format": "something else"}')
    code, err = _refused([*EP_ARGS, "--epochs", "2", "--checkpoint", str(foreign), "--resume"], capsys, monkeypatch)
    assert code == 2 and "is not a sharded checkpoint of this program" in err and str(foreign) in err
    (foreign / "manifest.json").write_text('{"format": ')
    code, err = _refused([*EP_ARGS, "--epochs", "2", "--checkpoint", str(foreign), "--resume"], capsys, monkeypatch)
    assert code == 2 and "manifest.json is damaged" in err


def test_a_finished_run_is_refused_by_resume_and_done_for_auto_resume(saved, capsys, monkeypatch):
    code, err = _refused([*EP_ARGS, "--checkpoint", str(saved), "--resume"], capsys, monkeypatch)
    assert code == 2 and "has already trained 2 of 2 steps" in err
    code, err = _refused([*EP_ARGS, "--checkpoint", str(saved), "--auto-resume"], capsys, monkeypatch)
    assert code == 0 and "the run is complete" in err
