"""The training program's --pp run (ddp_from_scratch/train/pp.py): each schedule, PP x DP with
several buckets, and PP x TP x DP on 2 x 2 x 2 ranks train the small transformer with the
one-rank model's losses, step for step, within float32 rounding; the mesh puts every rank where
its closed form says; what --pp cannot take is refused in one line before any rank starts.

    pytest tests/pipeline_parallel/test_train_pp.py -q
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from collectives.testing import run_on_ranks
from ddp_from_scratch import train
from ddp_from_scratch.pipeline_parallel.mesh3d import Mesh3D
from ddp_from_scratch.train.args import TrainConfig, build_parser
from ddp_from_scratch.train.pp import train_pp
from ddp_from_scratch.train.tp import train_tp

GLOBAL_BATCH, STEPS = 8, 3


def _config(*flags: str, dp: int = 1) -> TrainConfig:
    args = build_parser().parse_args(["--synthetic", "--train-size", str(GLOBAL_BATCH * STEPS), "--batch-size",
                                      str(GLOBAL_BATCH // dp), "--lr", "0.05", *flags])
    return TrainConfig.from_args(args)


def _one_rank() -> dict:
    return run_on_ranks(train_tp, 1, args=(_config("--tp", "1"),), backend="gloo")[0]


@pytest.fixture(scope="module")
def one_rank():
    return _one_rank()


@pytest.mark.parametrize("flags, ranks", [
    (("--pp", "2", "--schedule", "gpipe", "--microbatches", "2"), 2),
    (("--pp", "2", "--schedule", "1f1b", "--microbatches", "4"), 2),
    (("--pp", "2", "--schedule", "interleaved", "--microbatches", "4"), 2),
    (("--pp", "2", "--schedule", "zero-bubble", "--microbatches", "4", "--chunks", "1"), 2),
    (("--pp", "4", "--schedule", "1f1b", "--microbatches", "4"), 4),
    (("--pp", "2", "--schedule", "zero-bubble", "--microbatches", "2", "--bucket-cap-mb", "0.02"), 4),
    pytest.param(("--pp", "2", "--tp", "2", "--schedule", "1f1b", "--microbatches", "2"), 8, marks=pytest.mark.slow),  # 8 ranks
], ids=["gpipe", "1f1b", "interleaved", "zero-bubble", "pp4", "pp2xdp2-buckets", "pp2xtp2xdp2"])
def test_a_pp_run_has_the_one_rank_models_losses(flags, ranks, one_rank):
    """The same global batch every step, whatever the layout: the losses after each SGD step are
    the one-rank model's within float32 rounding (microbatch means averaged, DP replicas averaged:
    the same mean, added in another order), over 3 steps with momentum. A DP run that never
    all-reduced, a step that forgot to divide by the microbatches, or a stage that missed its
    gradients would move off them from the second step."""
    pp, tp = int(flags[1]), int(flags[flags.index("--tp") + 1]) if "--tp" in flags else 1
    dp = ranks // (pp * tp)
    summaries = run_on_ranks(train_pp, ranks, args=(_config(*flags, dp=dp),), backend="gloo", timeout=300)
    assert all(s["losses"] == summaries[0]["losses"] for s in summaries)  # every rank logs the global mean
    got = summaries[0]
    assert (got["pp"], got["tp"], got["dp"], got["steps"]) == (pp, tp, dp, STEPS) == (pp, tp, dp, one_rank["steps"])
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(one_rank["losses"]), rtol=1e-5, atol=1e-6)
    assert len(set(one_rank["losses"])) == STEPS  # the model learns: a run that never stepped would not match
    if "--bucket-cap-mb" in flags:
        assert got["dp_buckets"] > 2 * 2, got["dp_buckets"]  # several a chunk: a second bucket runs
    assert len(got["idle_share_by_stage"]) == pp and 0 < got["bubble_closed_form"] < 1
    by_rank = got["idle_share_by_rank"]  # each stage's share is one measured by a rank of that stage
    for k, share in enumerate(got["idle_share_by_stage"]):
        assert share in [r["idle_share"] for r in by_rank if r["stage"] == k], (k, share, by_rank)
    assert [r["stage"] for r in by_rank] == [rank // (dp * tp) for rank in range(ranks)]


def test_the_transformer_as_a_sequence_is_its_forward():
    from ddp_from_scratch.workload.transformer import TinyTransformer, token_batch

    model = TinyTransformer(32, 16, 4, 3)
    tokens, _ = token_batch(0, 0, 3, 8, 32)
    sequence = model.as_sequence()
    assert torch.equal(sequence(tokens), model(tokens))
    assert {id(p) for p in sequence.parameters()} == {id(p) for p in model.parameters()}  # shared, not copied


def _mesh(env, pp, tp):
    mesh = Mesh3D(pp=pp, tp=tp)
    ranks = dist.get_process_group_ranks
    return (mesh.stage, mesh.dp_index, mesh.tp_index), ranks(mesh.pp), ranks(mesh.dp), ranks(mesh.tp)


@pytest.mark.parametrize("pp, tp, world", [(2, 1, 4), (2, 2, 4), (1, 2, 4), (3, 1, 3)])
def test_the_mesh_puts_each_rank_where_its_closed_form_says(pp, tp, world):
    """rank = (stage x dp + d) x tp + t; its pipeline holds its (d, t) at every stage, its DP group
    its (stage, t) in every replica, its TP group its (stage, d) at every t."""
    dp = world // (pp * tp)
    for rank, (coords, pipe, data, tensor) in enumerate(run_on_ranks(_mesh, world, args=(pp, tp), backend="gloo")):
        s, d, t = coords
        assert rank == (s * dp + d) * tp + t
        assert pipe == [(k * dp + d) * tp + t for k in range(pp)]
        assert data == [(s * dp + k) * tp + t for k in range(dp)]
        assert tensor == [(s * dp + d) * tp + k for k in range(tp)]


@pytest.mark.parametrize("argv, fragment", [
    (["--pp", "3", "--nproc", "2"], "--pp 3 = 3 must divide the 2 rank(s)"),
    (["--pp", "2", "--tp", "2", "--nproc", "2"], "--pp 2 x --tp 2 = 4 must divide the 2 rank(s)"),
    (["--pp", "2", "--tp", "2", "--nproc", "6"], "--pp 2 x --tp 2 = 4 must divide the 6 rank(s)"),
    (["--pp", "5", "--nproc", "5"], "the transformer has 4 pieces to cut into 5 stages"),
    (["--pp", "2", "--schedule", "interleaved", "--chunks", "3", "--nproc", "2"], "--pp 2 x --chunks 3: the transformer"),
    (["--pp", "2", "--microbatches", "3", "--batch-size", "8", "--nproc", "2"], "--microbatches 3 does not divide --batch-size 8"),
    (["--pp", "4", "--microbatches", "2", "--batch-size", "8", "--nproc", "4"], "--schedule 1f1b needs at least as many microbatches as stages"),
    (["--pp", "2", "--schedule", "zero-bubble", "--microbatches", "5", "--batch-size", "10", "--nproc", "2"],
     "--microbatches 5 on --pp 2 make 2 rounds, which must divide them"),
    (["--pp", "2", "--chunks", "2", "--nproc", "2"], "--chunks applies to --schedule interleaved and zero-bubble, not 1f1b"),
    (["--pp", "2", "--impl", "torch", "--nproc", "2"], "--impl torch is not taken with --pp"),
    (["--pp", "2", "--nproc", "2", "--sequence-parallel", "--tp", "1"], "--sequence-parallel is not taken with --pp"),
    (["--pp", "2", "--nproc", "2", "--model", "small"], "--model small: a --pp run trains the small transformer"),
    (["--pp", "4", "--nproc", "4", "--layers", "1"], "the transformer has 3 pieces to cut into 4 stages"),
    (["--pp", "0", "--nproc", "2"], "--pp must be at least 1"),
    (["--schedule", "gpipe", "--nproc", "2"], "--schedule: applies to a --pp run"),
    (["--microbatches", "4", "--chunks", "2", "--nproc", "2"], "--microbatches, --chunks: apply to a --pp run"),
])
def test_what_a_pp_run_cannot_take_is_refused_before_any_rank_starts(argv, fragment, capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("collectives.run_or_join", lambda *a, **k: pytest.fail("a rank started"))
    with pytest.raises(SystemExit) as info:
        train.main([*argv, *([] if "--model" in argv or "--sequence-parallel" in argv else []), "--synthetic"])
    err = capsys.readouterr().err
    assert info.value.code == 2 and len(err.strip().splitlines()) == 1 and fragment in err, err


class _Started(Exception):
    pass


@pytest.mark.parametrize("argv", [
    ["--pp", "2", "--schedule", "1f1b", "--microbatches", "2", "--nproc", "2"],  # 1F1B: as many microbatches as stages
    ["--pp", "4", "--schedule", "1f1b", "--microbatches", "4", "--batch-size", "8", "--nproc", "4"],
    ["--pp", "2", "--schedule", "gpipe", "--microbatches", "1", "--nproc", "2"],
    ["--pp", "2", "--schedule", "interleaved", "--microbatches", "2", "--nproc", "2"],
    ["--pp", "2", "--schedule", "zero-bubble", "--microbatches", "2", "--chunks", "2", "--nproc", "2"],
    ["--pp", "2", "--tp", "2", "--schedule", "1f1b", "--microbatches", "2", "--nproc", "4"],
])
def test_a_pp_run_at_the_edge_of_what_its_schedule_takes_passes_the_checks(argv, monkeypatch, tmp_path):
    def started(*args, **kwargs):
        raise _Started

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("collectives.run_or_join", started)
    with pytest.raises(_Started):
        train.main([*argv, "--synthetic"])


def test_a_pp_run_on_a_text_too_short_for_a_window_is_refused_naming_it(capsys, monkeypatch, tmp_path):
    short = tmp_path / "short.txt"
    short.write_bytes(b"x" * 329)  # a window is 33 bytes and the last tenth is held out: 330 needed
    monkeypatch.setattr("collectives.run_or_join", lambda *a, **k: pytest.fail("a rank started"))
    with pytest.raises(SystemExit) as info:
        train.main(["--pp", "2", "--nproc", "2", "--text", str(short)])
    assert info.value.code == 2 and f"--text {short}: 329 bytes, too short" in capsys.readouterr().err
