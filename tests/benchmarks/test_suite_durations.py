"""The suite-durations summary adds each module's phases, strips xdist's group suffix, reads the
wall time, and refuses a log without a report in one line.

    pytest tests/benchmarks/test_suite_durations.py -q
"""

import pytest

from benchmarks.studies import suite_durations

LOG = """\
........ [100%]
============================= slowest durations =============================
10.50s call     tests/multinode/test_elastic.py::test_a@hosts
2.25s setup    tests/multinode/test_elastic.py::test_a@hosts
1.00s call     tests/ddp/test_train.py::test_b[2]
0.50s call     tests/ddp/test_train.py::test_b[3]
0.25s teardown tests/ddp/test_train.py::test_b[3]
============ 4 passed, 1 skipped in 12.34s (0:00:12) ============
"""


def test_the_phases_are_summed_per_test_and_per_module(tmp_path):
    log = tmp_path / "run.log"
    log.write_text(LOG)
    per_test, wall = suite_durations.read(str(log))
    assert per_test == {"tests/multinode/test_elastic.py::test_a": 12.75, "tests/ddp/test_train.py::test_b[2]": 1.0,
                        "tests/ddp/test_train.py::test_b[3]": 0.75}
    assert wall == 12.34
    assert suite_durations.per_module(per_test) == {"tests/multinode/test_elastic.py": 12.75,
                                                    "tests/ddp/test_train.py": 1.75}


def test_two_runs_side_by_side(tmp_path, capsys):
    before, after = tmp_path / "before.log", tmp_path / "after.log"
    before.write_text(LOG)
    after.write_text(LOG.replace("10.50s call", "0.50s call").replace("in 12.34s", "in 3.21s"))
    assert suite_durations.main([str(before), str(after), "--tests", "1"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "| tests/multinode/test_elastic.py | 12.8 | 2.8 |" in out  # slowest first, in the first run's order
    assert out.index("| tests/multinode/test_elastic.py | 12.8 | 2.8 |") < out.index("| tests/ddp/test_train.py | 1.8 | 1.8 |")
    assert "| wall (pytest's summary) | 12.3 | 3.2 |" in out
    assert out[-1].endswith("tests/multinode/test_elastic.py::test_a")


def test_a_log_without_a_report_is_one_line(tmp_path, capsys):
    log = tmp_path / "plain.log"
    log.write_text("4 passed in 1.00s\n")
    with pytest.raises(SystemExit) as info:
        suite_durations.main([str(log)])
    assert info.value.code == 2
    assert "has no --durations report (run pytest with --durations=0)" in capsys.readouterr().err
