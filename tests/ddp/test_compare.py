"""`python -m ddp_from_scratch.compare` prints both tables and the layouts, and its exit code
says whether everything that should be bitwise equal was.

    pytest tests/ddp/test_compare.py -q
"""

import pytest
import torch

from ddp_from_scratch import compare
from ddp_from_scratch.compare import options as compare_options
from ddp_from_scratch.parts import step_check
from collectives.testing import run_on_ranks


def test_compare_program_prints_the_tables_and_the_layouts(capsys):
    code = compare.main(["--world-sizes", "2", "--impl", "flat", "bucketed", "--steps", "2", "--show-layout"])
    text = capsys.readouterr().out
    assert code == 0
    assert "flat             2        2  yes" in text and "bucketed         2        2  yes" in text
    for label in compare_options.options():
        assert f"\n{label} " in text, label
    assert "bucket layout, initial (first iteration's order), model small:\nbucket 0:   8 params" in text
    assert "bucket layout, rebuilt" in text


def test_a_row_whose_steps_never_reach_its_option_says_so_and_never_yes(capsys):
    """--steps 2 with PowerSGD from step 2: no step compressed, so the rows compare nothing of
    PowerSGD; they print "not compared" and "not compressed in these steps", and run no rank."""
    code = compare.main(["--world-sizes", "2", "--impl", "bucketed", "--steps", "2"])
    text = capsys.readouterr().out
    assert code == 0
    rows = [line for line in text.splitlines() if line.startswith(("powersgd", "batched powersgd"))]
    assert len(rows) == 3, text
    for row in rows:
        assert "not compared" in row and "not compressed in these steps (from step 2: run --steps 3 or more)" in row
        assert " yes " not in row, row
    set_to_none = next(line for line in text.splitlines() if line.startswith("gradient_as_bucket_view, set_to_none"))
    assert "yes" in set_to_none and "step 0 before it acts, step 1 with it" in set_to_none


@pytest.mark.parametrize("acts_from, steps, says", [
    (0, 1, "step 0"), (0, 4, "steps 0-3"), (2, 2, None), (2, 1, None), (2, 3, "steps 0-1 plain, step 2 compressed"),
    (2, 5, "steps 0-1 plain, steps 2-4 compressed"), (1, 2, "step 0 plain, step 1 compressed"),
])
def test_what_a_row_compared(acts_from, steps, says):
    option = compare_options.Option({}, acts_from_step=acts_from, phases=("plain", "compressed"))
    assert compare_options.what_was_compared(option, steps) == says


def test_every_powersgd_row_acts_from_its_start_iteration_and_runs_on_shm():
    """Where torch's hook runs with any number of buckets (on Gloo it dies with two or more)."""
    rows = {label: o for label, o in compare_options.options("resnet50").items() if "powersgd" in label}
    assert len(rows) == 3
    for label, option in rows.items():
        assert option.backend == "shm" and option.acts_from_step == 2, label


def test_compare_exit_code_is_1_when_a_bitwise_check_fails(monkeypatch, capsys):
    def broken(per_rank):
        return {"bitwise": False, "largest_diff": 1.0, "first_step_differing": 0}

    monkeypatch.setattr(compare.program, "summarise", broken)
    assert compare.main(["--world-sizes", "2", "--impl", "bucketed", "--steps", "1", "--no-options"]) == 1
    assert "bucketed         2        1  no" in capsys.readouterr().out


@pytest.mark.parametrize("argv, fragment", [
    (["--steps", "0"], "--steps must be at least 1, got 0"),  # crashed
    (["--batch-size", "0"], "--batch-size must be at least 1, got 0"),  # reported a false "not bitwise"
    (["--world-sizes", "2", "0"], "--world-sizes must all be at least 1"),
    (["--model", "resnet50", "--batch-size", "1"], "ResNet-50's last BatchNorm would see one value per channel"),
    (["--impl", "pp", "--steps", "8"], "--steps has no effect on the rows asked for (--impl pp)"),
    (["--impl", "pp", "--model", "resnet50"], "--model has no effect on the rows asked for (--impl pp)"),
    (["--impl", "pp", "tp", "--batch-size", "8"], "--batch-size has no effect on the rows asked for (--impl pp tp)"),
    (["--impl", "naive", "--units", "blocks"], "--units has no effect on the rows asked for (--impl naive): it acts on "
                                               "the sharded steps' rows"),
    (["--impl", "tp", "--no-options"], "--no-options has no effect on the rows asked for (--impl tp)"),
])
def test_nonsense_is_refused_before_any_rank_starts(argv, fragment, capsys):
    with pytest.raises(SystemExit) as info:
        compare.main(argv)
    assert info.value.code == 2 and fragment in capsys.readouterr().err


def test_same_bits_counts_identical_nans_as_equal():
    nan = torch.tensor([float("nan"), 1.0])
    assert step_check.same_bits(nan, nan.clone())  # torch.equal says False here
    assert not torch.equal(nan, nan.clone())
    assert not step_check.same_bits(nan, torch.tensor([1.0, 1.0]))  # a NaN against a number
    assert not step_check.same_bits(torch.tensor([0.0]), torch.tensor([-0.0]))  # torch.equal says True here
    assert step_check.same_bits(torch.tensor([-0.0], dtype=torch.bfloat16), torch.tensor([-0.0], dtype=torch.bfloat16))
    assert not step_check.same_bits(torch.ones(2), torch.ones(2, dtype=torch.float64))
    assert step_check.same_bits(None, None) and not step_check.same_bits(None, torch.ones(1))
    assert step_check.same_bits(torch.tensor([1 + 2j]), torch.tensor([1 + 2j]))


def _fp16_resnet50_batch2(env):
    kwargs = compare_options.options()["compress fp16"].kwargs
    return compare.train_side_by_side(env, "bucketed", 1, model="resnet50", batch_size=2, image=32, **kwargs)


@pytest.mark.slow
def test_fp16_overflow_on_resnet50_is_identical_on_both_sides():
    """At batch 2, ResNet-50's step-0 gradients exceed fp16's range: ours and torch's
    fp16_compress_hook must overflow into the very same NaN bit patterns, and the report says so."""
    per_rank = run_on_ranks(_fp16_resnet50_batch2, 2, timeout=300)
    for steps in per_rank:
        check = steps[0]
        assert check.bitwise, check
        assert check.nonfinite_ours == check.nonfinite_theirs > 100, check
    res = step_check.summarise(per_rank)
    assert res["bitwise"] and res["nonfinite"]["first_step"] == 0
    assert step_check.describe_nonfinite(res).startswith("both sides overflow (inf/NaN) from step 0")
    assert "run with 4 images per rank" in compare_options.options("resnet50", 2)["compress fp16"].note
    assert compare_options.options("resnet50", 2)["compress fp16"].kwargs["batch_size"] == 4


def test_compare_program_prints_the_sharded_table_and_the_shard_layout(capsys):
    from ddp_from_scratch import compare

    code = compare.main(["--impl", "zero2", "fsdp", "--world-sizes", "2", "--steps", "2",
                         "--show-layout"])
    out = capsys.readouterr().out
    assert code == 0, out
    table = [line for line in out.splitlines() if line.startswith(("zero2 ", "fsdp "))]
    assert len(table) == 4 and all(" yes " in line for line in table), table  # 2 ranks: every pair bitwise
    assert "unit 0 (conv1): 2 ranks" in out and "rows r0: 0-3, r1: 4-7" in out  # conv1.weight (8, 3, 3, 3)


def test_the_tensor_parallel_table_proves_its_rows(capsys):
    """--impl tp on 2 ranks: every block bit for bit torch's parallelize_module (attention but its
    input gradient), the split transformer within float32 rounding of the one-rank model."""
    code = compare.main(["--world-sizes", "2", "--impl", "tp", "--steps", "2"])
    text = capsys.readouterr().out
    assert code == 0, text
    for label in ("MLP block", "attention (heads split) (all but dx)", "LayerNorm + MLP, sequence parallel"):
        assert any(line.startswith(label) and "  yes  " in line and line.rstrip().endswith("yes")
                   for line in text.splitlines()), (label, text)
    for label in ("transformer, TP over 2", "transformer, TP + SP over 2"):
        assert any(line.startswith(label) and "no (within 0.0001)" in line for line in text.splitlines()), text
    assert "model small" not in text  # no CNN table was asked for


@pytest.mark.parametrize("rank_rows, ok", [
    ([("MLP block", "torch", 1, True, 0.0, True)], True),
    ([("MLP block", "torch", 1, False, 1e-7, True)], False),       # a must-be-bitwise row that is not
    ([("transformer", "one rank", 4, None, 5e-5, False)], True),
    ([("transformer", "one rank", 4, None, 2e-4, False)], False),  # past the tolerance
    ([("transformer", "one rank", 4, None, 1.004e-4, False)], False),  # past it, though it prints as 1.00e-04
])
def test_the_tensor_parallel_verdict_needs_every_rank(rank_rows, ok):
    from ddp_from_scratch.compare import tp as compare_tp

    good = [("MLP block", "torch", 1, True, 0.0, True)] if rank_rows[0][5] else [("transformer", "one rank", 4, None, 0.0, False)]
    rows, verdict = compare_tp.table_rows([good, rank_rows], 2, 4)  # rank 0 agrees; rank 1 as given
    assert verdict == ok, rows
    assert compare_tp.table_rows([good], 3, 4)[1]  # a world size the blocks do not fit: not run


def test_the_pipeline_table_runs_every_schedule_against_torch_and_one_rank(capsys):
    """--impl pp: GPipe, 1F1B, interleaved 1F1B and zero bubble (1 and 2 chunks) against
    torch.distributed.pipelining's and the one-rank model, every row bit for bit, exit 0; a world
    of 1 says a pipeline needs 2 ranks."""
    assert compare.main(["--impl", "pp", "--world-sizes", "1", "2"]) == 0
    captured = capsys.readouterr()
    out = captured.out
    assert "the bucketed wrapper's options" not in out  # no wrapper asked for: no options table trained
    assert "[2/2] running pipeline schedules on 2 ranks" in captured.err, captured.err
    rows = [line.split() for line in out.splitlines() if line.startswith(("gpipe", "1f1b", "interleaved", "zero"))]
    assert len(rows) == 20 and all("yes" in row for row in rows), out
    assert "a pipeline needs 2 ranks or more" in out
    for name in ("ScheduleGPipe", "Schedule1F1B", "ScheduleInterleaved1F1B", "ScheduleInterleavedZeroBubble"):
        assert f"torch {name}" in out


def test_a_pipeline_row_that_differs_on_one_rank_fails_the_table():
    from ddp_from_scratch.compare.pp import table_rows

    good = [("gpipe", "torch ScheduleGPipe", 2, True, 10)]
    rows, ok = table_rows([good, good], 2)
    assert ok and rows == [["gpipe", "torch ScheduleGPipe", 2, 2, "yes", 20]]
    rows, ok = table_rows([good, [("gpipe", "torch ScheduleGPipe", 2, False, 10)]], 2)
    assert not ok and rows[0][4] == "no"
