"""benchmarks.studies.shm_small_path: each group takes the small path up to its own limit and no further,
every call's result is right, and the report has a row per size marking the small path; a bad
flag is a usage error. (Which limit is fastest is the benchmark's to say, not a test's.)

    pytest tests/benchmarks/test_shm_small_path.py -q
"""

import json

import pytest

from benchmarks.studies import shm_small_path


def test_a_short_run_gives_each_group_its_own_limit(tmp_path, capsys):
    out = tmp_path / "small.json"
    argv = ["--rounds", "2", "--iters", "3", "--limits", "16K", "32K", "-b", "16K", "-e", "64K", "--json", str(out)]
    assert shm_small_path.main(argv) == 0
    printed = capsys.readouterr().out
    saved = json.loads(out.read_text())
    assert saved["sizes"] == [16 << 10, 32 << 10, 64 << 10] and saved["wrong"] == 0
    assert saved["paths"] == {"16384/16384": "small", "16384/32768": "whole", "16384/65536": "whole",
                              "32768/16384": "small", "32768/32768": "small", "32768/65536": "whole"}
    assert all(len(v) == 2 for v in saved["times_us"].values()) and len(saved["times_us"]) == 6
    assert saved["library_limit"] == 64 << 10
    rows = {line.split()[0] + " " + line.split()[1]: line for line in printed.splitlines() if "KiB " in line[:8]}
    assert rows["32 KiB"].count("*") == 1 and rows["16 KiB"].count("*") == 2 and "*" not in rows["64 KiB"], printed
    assert saved["command"].startswith("python -m benchmarks.studies.shm_small_path --rounds 2")


@pytest.mark.parametrize("argv, says", [
    (["--rounds", "0"], "--rounds must be at least 1"),
    (["-b", "64K", "-e", "4K"], "must be at least 1 and at most -e 4096"),
    (["-f", "1"], "the step factor must be at least 2"),
    (["--limits", "lots"], "--limits"),
])
def test_a_bad_flag_is_a_usage_error_naming_it(argv, says, capsys):
    with pytest.raises(SystemExit) as info:
        shm_small_path.main(argv)
    assert info.value.code == 2 and says in capsys.readouterr().err
