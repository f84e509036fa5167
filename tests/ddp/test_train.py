"""The training program end to end (small model, synthetic data, 2 spawned ranks): a run resumed
from its checkpoint ends with exactly the parameters of an uninterrupted one; a missing dataset
is a clear message; torch's DDP with bf16 autocast runs; the summary says the data was synthetic;
each sharded step (zero1, zero2, fsdp, torch-fsdp) trains and saves whole tensors, and an fsdp run
resumed from its gathered checkpoint ends where an uninterrupted one ends.

    pytest tests/ddp/test_train.py -q
"""

import json
import pickle
import types
import os

import pytest
import torch

from collectives.launcher.pool import RankPool
from ddp_from_scratch import train
from ddp_from_scratch.train import checkpoint
from collectives.testing import run_on_ranks

COMMON = ["--nproc", "2", "--model", "small", "--synthetic", "--train-size", "64", "--test-size", "32",
          "--batch-size", "8", "--lr", "0.05"]


def _final(folder):
    return torch.load(folder / "checkpoint.pt", weights_only=True)


@pytest.mark.slow
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


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [2, 3])
def test_a_run_split_mid_epoch_ends_bitwise_where_an_uninterrupted_one_ends(nproc, tmp_path, capsys):
    """4 steps an epoch: stopped at step 3 (inside epoch 1), resumed to step 6 (inside epoch 2),
    then --auto-resume to the end; the whole run writes a checkpoint every 3 steps on the way.
    A resume that restarted the epoch, or skipped the wrong samples, ends elsewhere; so does one
    whose first step reduced in the initial bucket instead of the rebuilt ones at 3 ranks (a ring
    all_reduce rounds by offset; 2 ranks cannot tell)."""
    whole, split = tmp_path / "whole", tmp_path / "split"
    ranks = ["--nproc", str(nproc), "--train-size", str(32 * nproc)]
    assert train.main(COMMON + ranks + ["--epochs", "2", "--checkpoint", str(whole), "--checkpoint-every", "3"]) == 0
    assert train.main(COMMON + ranks + ["--epochs", "2", "--checkpoint", str(split), "--stop-at-step", "3"]) == 0
    assert (_final(split)["epoch"], _final(split)["step"]) == (0, 3)
    assert train.main(COMMON + ranks + ["--epochs", "2", "--checkpoint", str(split), "--stop-at-step", "6",
                                        "--resume"]) == 0
    assert (_final(split)["epoch"], _final(split)["step"]) == (1, 2)
    assert train.main(COMMON + ranks + ["--epochs", "2", "--checkpoint", str(split), "--auto-resume"]) == 0
    summaries = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert [(s["resumed_from_epoch"], s["resumed_from_step"], s["stopped_at_step"]) for s in summaries] == [
        (0, 0, None), (0, 0, 3), (0, 3, 6), (1, 2, None)]
    assert summaries[0]["weights_sha256"] == summaries[-1]["weights_sha256"]
    assert summaries[1]["weights_sha256"] != summaries[0]["weights_sha256"]  # the stopped run had not finished
    a, b = _final(whole), _final(split)
    assert (a["epoch"], a["step"]) == (b["epoch"], b["step"]) == (2, 0)
    for key in a["model"]:
        assert torch.equal(a["model"][key], b["model"][key]), key


def test_auto_resume_without_a_checkpoint_starts(tmp_path, capsys):
    assert train.main(COMMON + ["--epochs", "1", "--checkpoint", str(tmp_path / "new"), "--auto-resume"]) == 0
    summary = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert (summary["resumed_from_epoch"], summary["resumed_from_step"]) == (0, 0)


def test_an_elastic_restart_on_fewer_ranks_is_one_line_saying_so(tmp_path, monkeypatch, capsys):
    """torchrun --nnodes 1:2 went on with one host after the other left: the restarted worker
    must not train on (another global batch) and must say why in one line."""
    _checkpoint(tmp_path / "ckpt")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    with pytest.raises(SystemExit):
        train.main(COMMON[2:] + ["--nproc", "1", "--batch-size", "8", "--epochs", "2", "--checkpoint",
                                 str(tmp_path / "ckpt"), "--auto-resume"])
    err = capsys.readouterr().err.strip().splitlines()
    assert "torchrun restarted this job (restart 1) on 1 ranks" in err[-1], err
    assert "written by 2 ranks: a host left or joined" in err[-1]


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
    assert summary["skipped_steps"] == 0  # bf16 on CPU: no GradScaler, nothing skipped


def test_a_summary_that_cannot_be_written_is_said_in_one_line_and_still_printed(tmp_path, capsys, monkeypatch):
    """A full disk at the end of training: the summary is on stdout, the error one line, rc 1,
    and the old --json file is left whole (written beside it, then renamed)."""
    from collectives import cli

    out = tmp_path / "summary.json"
    out.write_text('{"an": "older run"}\n')
    real_open = open

    def full_disk(path, *args, **kwargs):
        if str(path).endswith(".tmp"):
            raise OSError(28, "No space left on device")
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr("builtins.open", full_disk)
    assert train.main(COMMON + ["--epochs", "1", "--json", str(out)]) == 1
    captured = capsys.readouterr()
    summary = json.loads(captured.out.strip().splitlines()[-1])
    assert summary["epochs"] == 1
    lines = [line for line in captured.err.splitlines() if "could not write" in line]
    assert lines == [f"python -m ddp_from_scratch.train: could not write --json {out} (No space left on device); the "
                     "summary is the line above on stdout"], captured.err
    monkeypatch.undo()
    assert out.read_text() == '{"an": "older run"}\n' and list(tmp_path.iterdir()) == [out]
    cli.write_output(str(out), "new\n")
    assert out.read_text() == "new\n" and list(tmp_path.iterdir()) == [out]


def _deterministic_flags(env, argv):
    seen = []
    from ddp_from_scratch.train import resnet

    real_train = resnet._train
    resnet._train = lambda *a: seen.append((torch.are_deterministic_algorithms_enabled(),
                                           torch.backends.cudnn.deterministic,
                                           os.environ.get("CUBLAS_WORKSPACE_CONFIG"))) or real_train(*a)
    try:
        summary = train.train(env, train.TrainConfig.from_args(train.build_parser().parse_args(argv)))
    finally:
        resnet._train = real_train
    return summary["deterministic"], seen[0], (torch.are_deterministic_algorithms_enabled(),
                                               torch.backends.cudnn.deterministic,
                                               os.environ.get("CUBLAS_WORKSPACE_CONFIG"))


def test_deterministic_sets_the_kernel_flags_while_training_and_restores_them():
    """What --deterministic does shows only on CUDA (gpu_checks.sh train runs it twice and compares
    the losses); here: the flags are set while the rank trains, and restored after (the rank of a
    shared pool runs other work next), and left alone without the flag."""
    argv = COMMON[2:] + ["--impl", "torch", "--train-size", "16", "--test-size", "8"]
    assert run_on_ranks(_deterministic_flags, 1, args=(argv + ["--deterministic"],)) == [
        (True, (True, True, ":4096:8"), (False, False, None))]
    assert run_on_ranks(_deterministic_flags, 1, args=(argv,)) == [(False, (False, False, None), (False, False, None))]


@pytest.mark.parametrize("factor, stepped", [(1.0, True), (float("inf"), False), (float("nan"), False)])
def test_a_step_gradscaler_skips_is_reported_and_leaves_the_weights(factor, stepped):
    """train's progress and summary count the steps GradScaler skipped (fp16 on CUDA: identical
    losses step after step were the only sign before); the CPU scaler behaves the same."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    before = [p.detach().clone() for p in model.parameters()]
    loss = model(torch.ones(2, 3)).sum() * factor
    assert train.scaled_step(scaler, loss, opt) is stepped
    changed = [not torch.equal(a, p) for a, p in zip(before, model.parameters())]
    assert changed == [stepped, stepped], changed
    assert scaler.get_scale() == (1024.0 if stepped else 512.0)


@pytest.mark.parametrize("argv, fragment", [
    (["--batch-size", "0"], "--batch-size must be at least 1, got 0"),
    (["--epochs", "-1"], "--epochs must be at least 1, got -1"),
    (["--nproc", "0"], "--nproc must be at least 1"),
    (["--train-size", "0"], "--train-size must be at least 1, got 0"),  # once meant "all 50,000"
    (["--train-size", "10"], "10 training images make no full step of 32 per rank on 2 rank(s)"),  # once trained nothing
    (["--resume"], "--resume needs --checkpoint FOLDER"),  # once "no checkpoint at None"
    (["--auto-resume"], "--auto-resume needs --checkpoint FOLDER"),
    (["--checkpoint-every", "2"], "--checkpoint-every needs --checkpoint FOLDER"),
    (["--checkpoint-every", "0", "--checkpoint", "x"], "--checkpoint-every must be at least 1, got 0"),
    (["--stop-at-step", "3"], "--stop-at-step needs --checkpoint FOLDER"),
    (["--resume", "--auto-resume", "--checkpoint", "x"], "--resume and --auto-resume: give one"),
    (["--lr", "-1"], "--lr must be a positive number"),
    (["--bucket-cap-mb", "0"], "--bucket-cap-mb must be a positive number of MiB"),
    (["--impl", "fsdp", "--bucket-cap-mb", "5"], "--bucket-cap-mb applies to --impl torch, bucketed, zero1, zero2, zero2-bucketed, not fsdp"),
    (["--impl", "flat", "--compress", "fp16"], "--compress applies to --impl bucketed and torch, not flat"),
    (["--batch-size", "1"], "--batch-size 1 with 32x32 images: ResNet-50's last BatchNorm would see one value"),
    (["--test-size", "100000000000"], "--train-size/--test-size: 2 rank(s) each making 100,000,050,000 synthetic "
                                      "images need ~"),  # was a 38-line numpy MemoryError
    (["--powersgd-rank", "2"], "--powersgd-rank applies to --compress powersgd or batched_powersgd, not a run "
                               "without --compress"),
    (["--powersgd-start-iter", "5"], "--powersgd-start-iter applies to --compress powersgd"),
    (["--powersgd-start-iter", "1000"], "--powersgd-start-iter applies to --compress powersgd"),  # torch's default, given
    (["--compress", "fp16", "--powersgd-rank", "1", "--powersgd-start-iter", "5"],
     "--powersgd-rank and --powersgd-start-iter apply to --compress powersgd or batched_powersgd, not --compress fp16"),
    (["--impl", "torch", "--model", "small", "--compress", "powersgd", "--powersgd-start-iter", "2", "--bucket-cap-mb",
      "0.002"], "--impl torch --compress powersgd on Gloo: model small with --bucket-cap-mb 0.002 makes 2 buckets"),
    (["--impl", "torch", "--compress", "batched_powersgd"],  # ResNet-50 in DDP's default buckets
     "--impl torch --compress batched_powersgd on Gloo: model resnet50 with DDP's default buckets makes 5 buckets"),
    (["--compress", "powersgd", "--powersgd-rank", "0"], "--powersgd-rank must be at least 1, got 0"),
    (["--compress", "powersgd", "--powersgd-start-iter", "1"], "--powersgd-start-iter must be at least 2"),
    (["--impl", "torch", "--compress", "powersgd", "--checkpoint", "x", "--stop-at-step", "3"],
     "--stop-at-step with --impl torch --compress powersgd: torch's DDP starts a resumed run in its first-iteration "
     "bucket layout"),  # measured: not bitwise (the small CNN's initial and rebuilt layouts differ)
])
def test_bad_arguments_are_refused_before_any_rank_starts(argv, fragment, capsys, monkeypatch):
    def no_rank_may_start(self):
        raise AssertionError("a rank was started for bad arguments")

    monkeypatch.setattr(RankPool, "start", no_rank_may_start)
    with pytest.raises(SystemExit) as info:
        train.main(["--synthetic"] + argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert fragment in err and "Traceback" not in err


def test_torchs_powersgd_on_gloo_with_buckets_is_refused_naming_the_cause_and_the_alternatives(capsys):
    argv = ["--synthetic", "--impl", "torch", "--model", "small", "--compress", "powersgd", "--bucket-cap-mb", "0.002"]
    with pytest.raises(SystemExit):
        train.validate(train.build_parser().parse_args(argv), train.build_parser(), 2, 2)
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    for said in ("makes 2 buckets", "Future callback", "Gloo runs on its worker threads", "SIGABRT", "hang",
                 "--impl bucketed", "COLLECTIVES_BACKEND=shm", "one bucket"):
        assert said in err, (said, err)


@pytest.mark.parametrize("argv, backend", [
    (["--impl", "torch", "--model", "small", "--compress", "powersgd"], "gloo"),  # one bucket: torch's hook runs
    (["--impl", "torch", "--model", "small", "--compress", "powersgd", "--bucket-cap-mb", "0.002"], "shm"),
    (["--impl", "bucketed", "--model", "small", "--compress", "powersgd", "--bucket-cap-mb", "0.002"], "gloo"),
])
def test_powersgd_where_it_runs_is_not_refused(argv, backend, monkeypatch):
    monkeypatch.setenv("COLLECTIVES_BACKEND", backend)
    args = train.build_parser().parse_args(["--synthetic"] + argv)
    train.validate(args, train.build_parser(), 2, 2)  # no SystemExit
    assert train.torch_powersgd_refusal(args, 2) is None


def test_checkpoint_that_is_a_file_is_refused_up_front(tmp_path, capsys):
    target = tmp_path / "a-file"
    target.write_text("x")
    with pytest.raises(SystemExit):
        train.main(COMMON + ["--checkpoint", str(target)])
    assert f"--checkpoint {target} is a file" in capsys.readouterr().err


def _checkpoint(folder, **settings):
    folder.mkdir(exist_ok=True)
    config = train.build_parser().parse_args(COMMON)
    state = {"model": {}, "optimizer": {}, "epoch": 1, "settings": {**train.run_settings(config, 2), **settings}}
    torch.save(state, folder / "checkpoint.pt")
    return folder / "checkpoint.pt"


@pytest.mark.parametrize("damage, fragment", [
    ("empty", "is damaged (empty file)"),
    ("truncated", "is damaged ("),
    ("garbage", "is damaged ("),
])
def test_damaged_checkpoint_is_one_line_naming_the_file(damage, fragment, tmp_path, capsys):
    path = _checkpoint(tmp_path / "ckpt")
    blob = path.read_bytes()
    path.write_bytes({"empty": b"", "truncated": blob[: len(blob) // 2], "garbage": b"\x00not a checkpoint" * 10}[damage])
    with pytest.raises(SystemExit) as info:
        train.main(COMMON + ["--epochs", "2", "--checkpoint", str(tmp_path / "ckpt"), "--resume"])
    err = capsys.readouterr().err.strip().splitlines()
    assert info.value.code == 2
    assert f"{path} {fragment}" in err[-1] and "weights_only" not in err[-1], err


def test_resume_with_other_settings_is_refused_naming_them(tmp_path, capsys):
    _checkpoint(tmp_path / "ckpt")
    with pytest.raises(SystemExit):  # a 2-rank checkpoint resumed on 3 ranks used to continue silently
        train.main(COMMON[2:] + ["--nproc", "3", "--batch-size", "4", "--epochs", "2", "--checkpoint",
                                 str(tmp_path / "ckpt"), "--resume"])
    err = capsys.readouterr().err
    assert "world_size 2 in the checkpoint, 3 now" in err and "batch_size 8 in the checkpoint, 4 now" in err
    with pytest.raises(SystemExit) as info:
        train.main(COMMON + ["--epochs", "1", "--checkpoint", str(tmp_path / "ckpt"), "--resume"])
    assert info.value.code == 2 and "has already trained 1 of --epochs 1; raise --epochs" in capsys.readouterr().err


def test_auto_resume_of_a_finished_run_says_it_is_complete_and_exits_0(tmp_path, capsys, monkeypatch):
    """What torchrun's agent does when a worker dies after the last checkpoint: it starts the
    same command again. That is success, not a usage error (it was rc 2)."""
    from collectives.launcher import pool

    _checkpoint(tmp_path / "ckpt")
    monkeypatch.setattr(pool.RankPool, "start", lambda self: (_ for _ in ()).throw(AssertionError("a rank started")))
    with pytest.raises(SystemExit) as info:
        train.main(COMMON + ["--epochs", "1", "--checkpoint", str(tmp_path / "ckpt"), "--auto-resume"])
    err = capsys.readouterr().err.strip().splitlines()
    assert info.value.code == 0
    assert err == [f"python -m ddp_from_scratch.train: --auto-resume: {tmp_path / 'ckpt' / 'checkpoint.pt'} has already "
                   "trained 1 of --epochs 1: the run is complete, nothing to do"], err


def test_a_powersgd_run_resumed_with_its_default_options_is_the_same_run(tmp_path):
    """--powersgd-rank and --powersgd-start-iter left out mean torch's defaults, when saved and
    when resumed alike (not None against 1 and 1000)."""
    argv = ["--synthetic", "--compress", "powersgd", "--checkpoint", str(tmp_path)]
    config = train.TrainConfig.from_args(train.build_parser().parse_args(argv))
    said = train.run_settings(config, 2)["compress"]
    assert said == "powersgd rank 1 from step 1000"
    _checkpoint(tmp_path, compress=said)
    args = train.build_parser().parse_args(COMMON + ["--epochs", "2", "--compress", "powersgd", "--checkpoint",
                                                     str(tmp_path), "--resume"])
    train.validate(args, train.build_parser(), 2, 2)  # no SystemExit: the same settings


def _record_order(env, argv):
    """Train for real on this rank, recording which sample each __getitem__ served and the
    augmentation epoch it used."""
    from ddp_from_scratch.workload import cifar10

    seen = []
    original = cifar10._Images.__getitem__

    def recording(self, index):
        if self.augment:  # the training set
            seen.append((self.epoch, index))
        return original(self, index)

    cifar10._Images.__getitem__ = recording
    try:
        train.train(env, train.TrainConfig.from_args(train.build_parser().parse_args(argv)))
    finally:
        cifar10._Images.__getitem__ = original
    return seen


def test_each_epoch_reshuffles_and_the_shards_stay_disjoint():
    """Catches a missing sampler.set_epoch (the same order every epoch) or a missing dataset
    set_epoch (the same augmentation every epoch)."""
    argv = ["--model", "small", "--synthetic", "--train-size", "64", "--test-size", "8", "--batch-size", "8",
            "--epochs", "2"]
    per_rank = run_on_ranks(_record_order, 2, args=(argv,), timeout=300)
    epochs = {e for seen in per_rank for e, _ in seen}
    assert epochs == {0, 1}, f"the training set's augmentation saw epochs {epochs}: dataset.set_epoch not called?"
    orders = [[[i for e, i in seen if e == epoch] for epoch in range(2)] for seen in per_rank]  # [rank][epoch]
    for rank, (first, second) in enumerate(orders):
        assert len(first) == len(second) == 32, (rank, len(first), len(second))
        assert first != second, f"rank {rank} saw the same order in epochs 0 and 1"
    for epoch in range(2):
        a, b = set(orders[0][epoch]), set(orders[1][epoch])
        assert not a & b, f"epoch {epoch}: ranks 0 and 1 both trained on {sorted(a & b)}"
        assert a | b == set(range(64))


# -- the sharded steps --------------------------------------------------------------------------
@pytest.mark.slow
def test_fsdp_resume_ends_where_an_uninterrupted_run_ends(tmp_path, capsys):
    whole, split = tmp_path / "whole", tmp_path / "split"
    fsdp = COMMON + ["--impl", "fsdp"]
    assert train.main(fsdp + ["--epochs", "2", "--checkpoint", str(whole)]) == 0
    assert train.main(fsdp + ["--epochs", "1", "--checkpoint", str(split)]) == 0
    assert train.main(fsdp + ["--epochs", "2", "--checkpoint", str(split), "--resume"]) == 0
    a, b = _final(whole), _final(split)
    for key in a["model"]:  # gathered on save: whole tensors under the module's own names
        assert torch.equal(a["model"][key], b["model"][key]), key
    assert a["model"]["conv1.weight"].shape == (8, 3, 3, 3)
    assert a["optimizer"]["whole"]["momentum_buffer"]["conv1.weight"].shape == (8, 3, 3, 3)
    for key, tensor in a["optimizer"]["whole"]["momentum_buffer"].items():
        assert torch.equal(tensor, b["optimizer"]["whole"]["momentum_buffer"][key]), key


@pytest.mark.parametrize("impl, extra", [("zero1", []), ("zero2", []), ("zero2", ["--bucket-cap-mb", "0.001"]),
                                         ("torch-fsdp", [])])
def test_each_sharded_step_trains_and_saves_whole_tensors(impl, extra, tmp_path, capsys):
    assert train.main(COMMON + ["--impl", impl, "--epochs", "1", "--checkpoint", str(tmp_path)] + extra) == 0
    summary = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert summary["impl"] == impl and summary["synthetic_data"] and 0 <= summary["test_accuracy"] <= 1
    saved = _final(tmp_path)
    assert saved["model"]["conv1.weight"].shape == (8, 3, 3, 3)  # whole, not one rank's rows
    assert not any(type(v).__name__ == "DTensor" for v in saved["model"].values())


def test_amp_with_a_sharded_step_is_refused(capsys):
    with pytest.raises(SystemExit) as info:
        train.main(COMMON + ["--impl", "zero2", "--amp"])
    assert info.value.code == 2 and "--amp applies to the DDP impls" in capsys.readouterr().err


@pytest.mark.parametrize("impl", ["torch", "zero2", "fsdp"])
def test_resume_with_another_impl_is_refused_naming_it(impl, tmp_path, capsys):
    """A bucketed checkpoint resumed as another impl (whose state is laid out differently) must
    stop before any rank starts, naming the impl, not only the world size."""
    _checkpoint(tmp_path / "ckpt")
    with pytest.raises(SystemExit) as info:
        train.main(COMMON + ["--impl", impl, "--epochs", "2", "--checkpoint", str(tmp_path / "ckpt"), "--resume"])
    assert info.value.code == 2
    assert f"impl 'bucketed' in the checkpoint, '{impl}' now" in capsys.readouterr().err


def test_a_checkpoint_that_cannot_be_written_leaves_the_previous_one_and_no_tmp(tmp_path):
    """torch.save failing half-way (here: something it cannot pickle, as a full disk would fail it)
    must leave the last good checkpoint as it was and no checkpoint.pt.tmp."""
    folder = tmp_path / "ckpt"
    path = _checkpoint(folder)
    before = path.read_bytes()
    config = types.SimpleNamespace(checkpoint=str(folder), synthetic=True)  # a dict failed before any write
    with pytest.raises((AttributeError, pickle.PicklingError), match="pickle|lambda"):
        checkpoint.save(str(path), config, {"model": {"w": lambda: 0}}, 1, {}, step=2)
    assert path.read_bytes() == before
    assert sorted(p.name for p in folder.iterdir()) == ["checkpoint.pt"]


def test_the_config_holds_every_flag_a_rank_reads_and_stop_at_step_in_one_place():
    """A flag added to the parser but not to TrainConfig would never reach the ranks (from_args
    reads the config's fields): every flag but the launcher's own is a field."""
    import dataclasses

    args = train.build_parser().parse_args(["--synthetic"])
    assert {f.name for f in dataclasses.fields(train.TrainConfig)} == set(vars(args)) - {"nproc", "json"}
    config = train.TrainConfig.from_args(args)
    assert [config.end_of(e, 10) for e in range(3)] == [10, 10, 10]  # no --stop-at-step: every epoch whole
    stop = dataclasses.replace(config, stop_at_step=14)
    assert [stop.end_of(e, 10) for e in range(3)] == [10, 4, -6]  # within epoch 1; epoch 2 never starts
    assert dataclasses.replace(config, stop_at_step=20).end_of(2, 10) == 0  # on a boundary: epoch 2 has nothing


def _train_with(env, argv):
    return train.train(env, train.TrainConfig.from_args(train.build_parser().parse_args(argv)))


@pytest.mark.parametrize("compress", ["powersgd", "batched_powersgd", "fp16"])
def test_ours_and_torchs_ddp_with_the_same_compression_end_with_the_same_weights(compress):
    """The train CLI's --compress on our bucketed DDP and on torch's (its comm hook): PowerSGD rank 2
    from step 3 of 8, then the same weights bit for bit; and not the weights of plain DDP."""
    argv = ["--model", "small", "--synthetic", "--train-size", "128", "--test-size", "16", "--batch-size", "8",
            "--lr", "0.05", "--compress", compress]
    if compress != "fp16":
        argv += ["--powersgd-rank", "2", "--powersgd-start-iter", "3"]
    ours, theirs = (run_on_ranks(_train_with, 2, args=(argv + ["--impl", impl],), timeout=120)[0]
                    for impl in ("bucketed", "torch"))
    plain = run_on_ranks(_train_with, 2, args=([a for a in argv[:-2 if compress == "fp16" else -6]] +
                                           ["--impl", "bucketed"],), timeout=120)[0]
    assert ours["compress"] == theirs["compress"] == compress and plain["compress"] is None
    assert ours["weights_sha256"] == theirs["weights_sha256"] != plain["weights_sha256"]


@pytest.mark.parametrize("impl", ["bucketed"])
def test_a_powersgd_run_split_mid_epoch_ends_bitwise_where_an_uninterrupted_one_ends(impl, tmp_path):
    """PowerSGD's memories (each rank's error feedback, the warm-start Q, the step count, the
    random generator) are in the checkpoint: a run stopped at step 5 (compressed since step 3) and
    resumed ends with the uninterrupted run's weights; without them (a resumed run starting its
    memories afresh) it would not."""
    argv = ["--model", "small", "--synthetic", "--train-size", "128", "--test-size", "16", "--batch-size", "8",
            "--lr", "0.05", "--compress", "powersgd", "--powersgd-rank", "2", "--powersgd-start-iter", "3",
            "--impl", impl, "--epochs", "2"]
    whole = run_on_ranks(_train_with, 2, args=(argv,), timeout=120)[0]
    stopped = run_on_ranks(_train_with, 2, args=(argv + ["--checkpoint", str(tmp_path), "--stop-at-step", "5"],),
                       timeout=120)[0]
    resumed = run_on_ranks(_train_with, 2, args=(argv + ["--checkpoint", str(tmp_path), "--resume"],), timeout=120)[0]
    assert (stopped["stopped_at_step"], resumed["resumed_from_step"]) == (5, 5)
    assert resumed["weights_sha256"] == whole["weights_sha256"] != stopped["weights_sha256"]
    saved = torch.load(tmp_path / "checkpoint.pt", weights_only=True)
    assert len(saved["powersgd"]) == 2 and saved["settings"]["compress"] == "powersgd rank 2 from step 3"
