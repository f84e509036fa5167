"""`python -m ddp_from_scratch.compare` prints both tables and the layouts, and its exit code
says whether everything that should be bitwise equal was.

    pytest tests/ddp/test_compare.py -q
"""

import pytest

from ddp_from_scratch import compare


def test_compare_program_prints_the_tables_and_the_layouts(capsys):
    code = compare.main(["--world-sizes", "2", "--impl", "flat", "bucketed", "--steps", "2", "--show-layout"])
    text = capsys.readouterr().out
    assert code == 0
    assert "flat             2        2  yes" in text and "bucketed         2        2  yes" in text
    for label in compare.options():
        assert f"\n{label} " in text, label
    assert "bucket layout, initial (first iteration's order), model small:\nbucket 0:   8 params" in text
    assert "bucket layout, rebuilt" in text


def test_compare_exit_code_is_1_when_a_bitwise_check_fails(monkeypatch, capsys):
    def broken(per_rank):
        return {"bitwise": False, "largest_diff": 1.0, "first_step_differing": 0}

    monkeypatch.setattr(compare, "summarise", broken)
    assert compare.main(["--world-sizes", "2", "--impl", "bucketed", "--steps", "1", "--no-options"]) == 1
    assert "bucketed         2        1  no" in capsys.readouterr().out


@pytest.mark.parametrize("argv, fragment", [
    (["--steps", "0"], "--steps must be at least 1, got 0"),  # crashed
    (["--batch-size", "0"], "--batch-size must be at least 1, got 0"),  # reported a false "not bitwise"
    (["--world-sizes", "2", "0"], "--world-sizes must all be at least 1"),
    (["--model", "resnet50", "--batch-size", "1"], "ResNet-50's last BatchNorm would see one value per channel"),
])
def test_nonsense_is_refused_before_any_rank_starts(argv, fragment, capsys):
    with pytest.raises(SystemExit) as info:
        compare.main(argv)
    assert info.value.code == 2 and fragment in capsys.readouterr().err
