"""benchmarks.studies.bridge_load: both ways load the same built bridge, and the summary names both.

    pytest tests/benchmarks/test_bridge_load.py -q
"""

import pytest

from benchmarks.studies import bridge_load


@pytest.mark.slow
def test_a_short_run_times_both_ways(capsys):
    assert bridge_load.main(["--rounds", "2"]) == 0
    printed = capsys.readouterr().out
    for way in bridge_load.WAYS:
        assert f"{way}: median" in printed, printed
    assert "cpp_extension / stamped:" in printed, printed
