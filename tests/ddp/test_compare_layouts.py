"""The compare program's layouts table (ddp_from_scratch/compare/layouts.py): every layout of the
transformer run trains 8 steps on real text within its bound of the one-rank run (the pipeline of
one microbatch bit for bit); a row out of its bound says NO and makes the program exit 1.

    pytest tests/ddp/test_compare_layouts.py -q
"""

from __future__ import annotations

import importlib

import pytest
import torch

from collectives.testing import run_on_ranks
from ddp_from_scratch import compare

table = importlib.import_module("ddp_from_scratch.compare.layouts")  # the package's `layouts` is the bucket layouts' function


def _pooled(loop, n, args):
    return run_on_ranks(loop, n, args=args, backend="gloo", timeout=300)


@pytest.mark.slow  # every layout, up to 8 ranks; the quick run keeps each layout's one-rank losses (tests/*/test_train_*.py)
def test_every_layout_trains_as_one_rank_within_its_bound():
    rows, ok = table.layout_rows(8, progress=False, runner=_pooled)
    by_name = {r[0]: r for r in rows}
    assert ok, rows
    assert [r[0] for r in rows] == [layout.name for layout in table.LAYOUTS]
    assert all(r[2] == 8 and r[7] == "yes" for r in rows), rows
    bitwise = by_name["PP 2, GPipe, 1 microbatch"]
    assert bitwise[6] == "bitwise" and bitwise[3:6] == ["0.00e+00"] * 3
    # the others differ by rounding, not by nothing: a layout that ran the one-rank model would show 0
    assert any(float(r[3]) > 0 for r in rows if r[6] != "bitwise")


def _result(losses, validation, params):
    return {"losses": losses, "validation_loss": validation}, torch.tensor(params)


@pytest.mark.parametrize("bitwise, got, within", [
    (True, _result([1.0, 0.5], 0.4, [1.0, 2.0]), "yes"),
    (True, _result([1.0, 0.5 + 2 ** -23], 0.4, [1.0, 2.0]), "NO"),  # one ulp off a bitwise row
    (False, _result([1.0, 0.5 + 2 ** -23], 0.4, [1.0, 2.0 + 1e-7]), "yes"),
    (False, _result([1.0, 0.5], 0.4, [1.0, 2.0 + 1e-5]), "NO"),  # a parameter off by more than rounding
    (False, _result([1.0, 0.51], 0.4, [1.0, 2.0]), "NO"),
    (False, _result([1.0, 0.5], 0.41, [1.0, 2.0]), "NO"),
])
def test_a_row_out_of_its_bound_says_no(bitwise, got, within):
    layout = table.Layout("x", None, 2, (), bitwise, "why")
    r, ok = table.row(layout, got, _result([1.0, 0.5], 0.4, [1.0, 2.0]))
    assert r[7] == within and ok == (within == "yes")


def test_the_program_prints_the_table_and_exits_1_on_a_row_out_of_bounds(monkeypatch, capsys):
    def rows(steps, **kwargs):
        assert steps == 8  # the table's default, not the wrappers' 4
        return [["TP 2", 2, 8, "1e-3", "0", "0", "loss 1e-05 rel, params 1e-06", "NO", "why"]], False

    monkeypatch.setattr("ddp_from_scratch.compare.program.layout_rows", rows)
    assert compare.main(["--impl", "layouts"]) == 1
    out = capsys.readouterr().out
    assert "TP 2" in out and "NO" in out and "8 steps on Python's documentation" in out


def test_a_flag_the_layouts_table_does_not_take_is_refused(capsys):
    with pytest.raises(SystemExit) as info:
        compare.main(["--impl", "layouts", "--world-sizes", "2"])
    assert info.value.code == 2 and "--world-sizes has no effect on the rows asked for" in capsys.readouterr().err
