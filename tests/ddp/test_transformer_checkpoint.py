"""The transformer runs' sharded checkpoint (ddp_from_scratch/train/sharded_checkpoint.py): a
PP x TP x DP run (2 x 2 x 2 ranks) stopped and resumed on its layout ends bitwise equal to the
unbroken run, parameters and momentum included; the same checkpoint resumed on one rank is
resharded and its losses go on within float32 rounding; a damaged, foreign or other-settings
checkpoint is refused in one line before any rank starts.

    pytest tests/ddp/test_transformer_checkpoint.py -q
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from collectives.testing import run_on_ranks
from ddp_from_scratch import train
from ddp_from_scratch.parts import shards
from ddp_from_scratch.train.args import TrainConfig, build_parser
from ddp_from_scratch.train.pp import train_pp
from ddp_from_scratch.train.sharded_checkpoint import one_rank_vector
from ddp_from_scratch.train.tp import train_tp

# 6 steps of a global batch of 8 sequences: 4 a DP rank on PP x TP x DP, 8 on one rank
COMMON = ["--train-size", "48", "--lr", "0.05", "--eval-every", "3", "--seed", "3"]
PP_TP_DP = ["--pp", "2", "--tp", "2", "--batch-size", "4", "--microbatches", "2", *COMMON]
ONE_RANK = ["--tp", "1", "--batch-size", "8", *COMMON]

# The runs below are one module fixture, made once: under pytest-xdist (--dist loadgroup) this
# module's tests all go to one worker, which would otherwise make them again on the other.
pytestmark = pytest.mark.xdist_group("transformer-checkpoint")


def _run(loop, ranks: int, argv: list) -> dict:
    config = TrainConfig.from_args(build_parser().parse_args(argv))
    return run_on_ranks(loop, ranks, args=(config,), backend="gloo", timeout=300)[0]


def _whole(folder, what: str = "parameters") -> torch.Tensor:
    return one_rank_vector(str(folder), what)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("transformer-checkpoint")
    unbroken = _run(train_pp, 8, [*PP_TP_DP, "--checkpoint", str(d / "unbroken"), "--auto-resume"])  # none yet: from 0
    first = _run(train_pp, 8, [*PP_TP_DP, "--checkpoint", str(d / "parts"), "--stop-at-step", "2"])
    shutil.copytree(d / "parts", d / "reshard")
    shutil.copytree(d / "parts", d / "reshard-tp")
    rest = _run(train_pp, 8, [*PP_TP_DP, "--checkpoint", str(d / "parts"), "--resume"])
    one = _run(train_tp, 1, [*ONE_RANK, "--checkpoint", str(d / "reshard"), "--resume"])
    tp2 = _run(train_tp, 2, ["--tp", "2", *ONE_RANK[2:], "--checkpoint", str(d / "reshard-tp"), "--resume"])
    return {"dir": d, "unbroken": unbroken, "first": first, "rest": rest, "one": one, "tp2": tp2}


def test_a_pp_x_tp_x_dp_run_stopped_and_resumed_ends_bitwise_equal_to_the_unbroken_one(runs):
    unbroken, first, rest = runs["unbroken"], runs["first"], runs["rest"]
    assert (first["end_step"], rest["start_step"], rest["end_step"]) == (2, 2, 6)
    assert (unbroken["start_step"], unbroken["resumed"]) == (0, None)  # --auto-resume with no checkpoint starts
    assert rest["resumed"]["step"] == 2 and not rest["resumed"]["resharded"]
    assert first["losses"] + rest["losses"] == unbroken["losses"]  # the same floats, not close ones
    assert rest["validation"] == unbroken["validation"]  # steps 3 and 6, after the resume
    assert [v["step"] for v in first["validation"]] == [2]  # a stopped run evaluates at its end
    d = runs["dir"]
    for what in ("parameters", "momentum"):  # every rank's shard, the same bits
        manifest = shards.read_manifest(str(d / "unbroken"))
        for r in range(8):
            a = shards.load_shard(str(d / "unbroken"), r, manifest)
            b = shards.load_shard(str(d / "parts"), r, shards.read_manifest(str(d / "parts")))
            assert torch.equal(a[what], b[what]) and torch.equal(a["places"], b["places"]), (what, r)
    assert len(set(unbroken["losses"])) == 6  # the model learns: a resume that reset it would not match


def test_the_same_checkpoint_resumed_on_one_rank_is_resharded_and_goes_on(runs):
    one, unbroken = runs["one"], runs["unbroken"]
    assert one["resumed"]["resharded"] and one["resumed"]["from_layout"]["world_size"] == 8
    assert (one["start_step"], one["steps"]) == (2, 4)
    # another layout's arithmetic (TP's partial sums, the microbatch means): float32 rounding
    torch.testing.assert_close(torch.tensor(one["losses"]), torch.tensor(unbroken["losses"][2:]), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(torch.tensor(one["validation_loss"]), torch.tensor(unbroken["validation_loss"]),
                               rtol=1e-5, atol=1e-6)
    for what in ("parameters", "momentum"):  # the one rank's model at the end is the 8 ranks', put together
        torch.testing.assert_close(_whole(runs["dir"] / "reshard", what), _whole(runs["dir"] / "unbroken", what),
                                   rtol=1e-4, atol=1e-6)


def test_the_same_checkpoint_resumed_on_tp_2_is_resharded_over_its_shards_too(runs):
    """Another split, not only the whole model: the head's and the MLP's rows cut in two."""
    tp2, unbroken = runs["tp2"], runs["unbroken"]
    assert tp2["resumed"]["resharded"] and (tp2["tp"], tp2["start_step"]) == (2, 2)
    torch.testing.assert_close(torch.tensor(tp2["losses"]), torch.tensor(unbroken["losses"][2:]), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(_whole(runs["dir"] / "reshard-tp"), _whole(runs["dir"] / "unbroken"), rtol=1e-4,
                               atol=1e-6)


def _refused(argv, capsys, monkeypatch) -> str:
    monkeypatch.setattr("collectives.run_or_join", lambda *a, **k: pytest.fail("a rank started"))
    with pytest.raises(SystemExit) as info:
        train.main(argv)
    err = capsys.readouterr().err.strip()
    assert info.value.code == 2 and len(err.splitlines()) == 1, err
    return err


def test_a_damaged_shard_is_refused_in_one_line_naming_it(runs, tmp_path, capsys, monkeypatch):
    folder = tmp_path / "ck"
    shutil.copytree(runs["dir"] / "unbroken", folder)
    shard = folder / shards.shard_name(5, 8)
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    err = _refused([*ONE_RANK, "--nproc", "1", "--epochs", "2", "--checkpoint", str(folder), "--resume"], capsys,
                   monkeypatch)
    assert str(shard) in err and "damaged" in err


def test_a_checkpoint_of_other_settings_or_another_run_is_refused_naming_them(runs, tmp_path, capsys, monkeypatch):
    saved = runs["dir"] / "unbroken"
    err = _refused([*ONE_RANK, "--nproc", "1", "--epochs", "2", "--hidden", "32", "--checkpoint", str(saved),
                    "--resume"], capsys, monkeypatch)
    assert "model [256, 64, 4, 2, 32] in the checkpoint, [256, 32, 4, 2, 32] now" in err
    err = _refused(["--tp", "1", "--batch-size", "4", *COMMON, "--nproc", "1", "--epochs", "2", "--checkpoint",
                    str(saved), "--resume"], capsys, monkeypatch)
    assert "global_batch 8 in the checkpoint, 4 now" in err
    foreign = tmp_path / "foreign"
    shutil.copytree(saved, foreign)
    manifest = json.loads((foreign / shards.MANIFEST).read_text())
    manifest["layout"]["run"] = "ep"
    (foreign / shards.MANIFEST).write_text(json.dumps(manifest))
    err = _refused([*ONE_RANK, "--nproc", "1", "--epochs", "2", "--checkpoint", str(foreign), "--resume"], capsys,
                   monkeypatch)
    assert "was written by another run ('ep'" in err and str(foreign) in err


def test_a_finished_checkpoint_is_done_for_auto_resume_and_refused_for_resume(runs, capsys, monkeypatch):
    saved = str(runs["dir"] / "unbroken")
    err = _refused([*ONE_RANK, "--nproc", "1", "--checkpoint", saved, "--resume"], capsys, monkeypatch)
    assert "has already trained 6 of 6 steps" in err
    with pytest.raises(SystemExit) as info:
        train.main([*ONE_RANK, "--nproc", "1", "--checkpoint", saved, "--auto-resume"])
    assert info.value.code == 0 and "the run is complete" in capsys.readouterr().err


def test_a_shard_holds_its_ranks_elements_once_and_the_shards_cover_the_model(runs):
    """Each shard's places are distinct (no element saved twice by one rank), and the shards
    together cover every element of the one-rank model (assemble refuses a gap)."""
    manifest = shards.read_manifest(str(runs["dir"] / "unbroken"))
    for r in range(8):
        places = shards.load_shard(str(runs["dir"] / "unbroken"), r, manifest)["places"]
        assert places.unique().numel() == places.numel(), r
    whole = _whole(runs["dir"] / "unbroken")
    assert whole.numel() == runs["unbroken"]["parameters"] and torch.isfinite(whole).all()



@pytest.mark.parametrize("every, end, due", [(None, 5, [5]), (2, 5, [2, 4, 5]), (3, 6, [3, 6]), (1, 3, [1, 2, 3])])
def test_a_checkpoint_is_due_every_k_steps_and_at_the_end(every, end, due):
    from types import SimpleNamespace

    from ddp_from_scratch.train.sharded_checkpoint import ShardedCheckpoint

    checkpoint = ShardedCheckpoint.__new__(ShardedCheckpoint)
    checkpoint.config = SimpleNamespace(checkpoint="ck", checkpoint_every=every)
    assert [done for done in range(1, end + 1) if checkpoint.due(done, end)] == due


@pytest.mark.parametrize("schedule", ["interleaved", "zero-bubble"])
def test_a_pipeline_of_chunks_or_split_backwards_resumes_bitwise(schedule, tmp_path):
    """Two chunks a rank (stages 0 and 2 on rank 0): each chunk's parameters, momentum and DDP
    buckets go back where they were."""
    flags = ["--pp", "2", "--schedule", schedule, "--microbatches", "2", "--batch-size", "4", "--train-size", "32",
             "--lr", "0.05"]
    unbroken = _run(train_pp, 4, [*flags, "--checkpoint", str(tmp_path / "unbroken")])
    first = _run(train_pp, 4, [*flags, "--checkpoint", str(tmp_path / "parts"), "--stop-at-step", "2"])
    rest = _run(train_pp, 4, [*flags, "--checkpoint", str(tmp_path / "parts"), "--resume"])
    assert first["losses"] + rest["losses"] == unbroken["losses"] and unbroken["chunks"] == 2
    assert torch.equal(_whole(tmp_path / "parts"), _whole(tmp_path / "unbroken"))
    assert torch.equal(_whole(tmp_path / "parts", "momentum"), _whole(tmp_path / "unbroken", "momentum"))
