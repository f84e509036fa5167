"""benchmarks.powersgd: the elements counted per step are the closed form's, the loss curves of
PowerSGD leave plain DDP's exactly where compression starts, and nonsense is refused.

    pytest tests/benchmarks/test_powersgd_benchmark.py -q
"""

import pytest

from benchmarks import powersgd
from collectives.testing import run_on_ranks


def test_counted_elements_are_the_closed_forms():
    rows = run_on_ranks(powersgd.count_bytes, 1, args=("small", [1, 2, 4]))[0]
    for row in rows:
        assert row["counted"] == row["closed_form"] < row["plain"], row
        assert row["plain_steps"] == [row["plain"]] * powersgd.START, row  # plain DDP before the start
    assert [row["counted"] for row in rows] == sorted(row["counted"] for row in rows)  # more rank, more numbers


def test_curves_part_ways_where_compression_starts():
    losses = run_on_ranks(powersgd.curves, 2, args=(6, 4, 0.05))[0]
    assert set(losses) == {"plain", "fp16", "powersgd rank 1", "powersgd rank 4", "powersgd rank 1, no error feedback"}
    for label, ys in losses.items():
        assert len(ys) == 6
        # a step's loss is computed before its update: steps 0..START see only plain updates
        assert ys[:powersgd.START + 1] == losses["plain"][:powersgd.START + 1] or label == "fp16", label
        if label.startswith("powersgd"):
            assert ys[powersgd.START + 1:] != losses["plain"][powersgd.START + 1:], label


@pytest.mark.parametrize("argv, says", [
    (["bytes", "--plot", "x.png"], "--plot draws the curves part only"),
    (["time", "--rounds", "0"], "--rounds must be at least 1, got 0"),
    (["bytes", "--ranks", "0", "2"], "--ranks must all be at least 1, got [0, 2]"),
])
def test_nonsense_is_one_line(argv, says, capsys):
    with pytest.raises(SystemExit) as info:
        powersgd.main(argv)
    err = capsys.readouterr().err
    assert info.value.code == 2 and says in err and len(err.strip().splitlines()) == 1, err
