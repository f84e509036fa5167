"""benchmarks.shm_native: a short run times every variant at every size on the same ranks, counts
no wrong element, and the report has a row per size; a bad flag is a usage error. (How fast each
variant is, is the benchmark's to say, not a test's.)

    pytest tests/benchmarks/test_shm_native.py -q
"""

import json
import shlex

import pytest

from benchmarks import shm_native

SETTING = "COLLECTIVES_SHM_WORKER_NICE=0,COLLECTIVES_SHM_SLOT_MB=2"  # two settings for one group


def test_a_short_run_times_every_variant_at_every_size(tmp_path, capsys):
    out = tmp_path / "native.json"
    argv = ["--rounds", "2", "-b", "8", "-e", "64K", "-f", "64", "--budget-ms", "1",
            "--variants", "gloo", "shm python", "shm native", "shm direct", "floor", "--setting", SETTING,
            "--json", str(out)]
    assert shm_native.main(argv) == 0
    printed = capsys.readouterr().out
    saved = json.loads(out.read_text())
    assert saved["sizes"] == [8, 512, 32768, 65536]  # the largest size always, though 64 x 512 passes it
    assert saved["wrong"] == {"gloo": 0, "shm python": 0, "shm native": 0, "shm direct": 0, f"native {SETTING}": 0}
    for name in ("gloo", "shm python", "shm native", "shm direct", "floor", f"native {SETTING}"):
        assert all(len(saved["times_us"][name][str(s)]) == 2 for s in saved["sizes"]), name
    for row in ("8 B", "512 B", "32 KiB", "64 KiB"):
        assert f"\n{row.rjust(6)}" in printed, printed
    assert "8 B: shm native costs" in printed and "8 B: shm direct takes" in printed and "deepspeed left out: not asked for" in printed
    assert saved["command"].startswith("python -m benchmarks.shm_native --rounds 2")
    assert shlex.split(saved["command"])[3:] == argv, "the saved command, pasted into a shell, reruns it"


@pytest.mark.parametrize("argv, says", [
    (["--budget-ms", "0"], "--budget-ms"),
    (["--setting", "COLLECTIVES_SHM_WORKER_NICE"], "give COLLECTIVES_SHM_<NAME>=<value>, one of"),
    (["--setting", "COLLECTIVES_SHM_WORKER_NICE=20"], "must be a whole number from 0 to 19"),
    (["--setting", "COLLECTIVES_SHM_NAP=1"], "COLLECTIVES_SHM_NAP is not a shm setting"),
    (["--setting", "COLLECTIVES_SHM_SLOT_MB=2,COLLECTIVES_SHM_NAP=1"], "COLLECTIVES_SHM_NAP is not a shm setting"),
])
def test_a_bad_flag_is_a_usage_error_naming_it(argv, says, capsys):
    with pytest.raises(SystemExit) as info:
        shm_native.main(argv)
    assert info.value.code == 2 and says in capsys.readouterr().err


@pytest.mark.parametrize("setting, name", [
    ("COLLECTIVES_SHM_WORKER_NICE=0", "native COLLECTIVES_SHM_WORKER_NICE=0"),
    ("COLLECTIVES_SHM_PATH=python", "python COLLECTIVES_SHM_PATH=python"),
    ("COLLECTIVES_SHM_PATH=python,COLLECTIVES_SHM_SLOT_MB=2", "python COLLECTIVES_SHM_PATH=python,COLLECTIVES_SHM_SLOT_MB=2"),
    ("COLLECTIVES_SHM_PATH=native", "native COLLECTIVES_SHM_PATH=native"),
])
def test_a_setting_s_column_names_the_path_its_group_runs_on(setting, name):
    assert shm_native.variant_name(setting) == name
