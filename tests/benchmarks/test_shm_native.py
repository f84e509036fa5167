"""benchmarks.shm_native: a short run times every variant at every size on the same ranks, counts
no wrong element, and the report has a row per size; a bad flag is a usage error. (How fast each
variant is, is the benchmark's to say, not a test's.)

    pytest tests/benchmarks/test_shm_native.py -q
"""

import json
import shlex

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from benchmarks import shm_native

SETTING = "COLLECTIVES_SHM_WORKER_NICE=0,COLLECTIVES_SHM_SLOT_MB=2"  # two settings for one group


def test_a_short_run_times_every_variant_at_every_size(tmp_path, capsys):
    out = tmp_path / "native.json"
    argv = ["--rounds", "2", "-b", "8", "-e", "64K", "-f", "64", "--budget-ms", "1",
            "--variants", "gloo", "shm python", "shm native", "shm direct", "floor", "--setting", SETTING,
            "--waits", "--json", str(out)]
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
    for name in ("gloo", "shm python", "shm native", "shm direct", "floor", f"native {SETTING}"):
        assert set(saved["calls_per_turn"][name]) == {str(s) for s in saved["sizes"]}, name
        assert all(1 <= k <= 500 for k in saved["calls_per_turn"][name].values()), saved["calls_per_turn"]
    for name in ("shm python", "shm native", "shm direct", "floor", f"native {SETTING}"):  # the shm groups' waits
        for s in saved["sizes"]:
            w = saved["waits"][name][str(s)]
            assert w["calls"] >= 2 * 2, (name, s, w)  # 2 timed rounds of at least one call, on each of 2 ranks
            assert w["spun"] >= w["cut"] >= 0 and w["slept"] >= 0, (name, s, w)
    assert all(w["spun"] == w["slept"] == 0 for w in saved["waits"]["floor"].values()), "the floor never waits"
    assert "gloo" not in saved["waits"]
    assert "waits per rank and call" in printed and "  shm native: 8 B " in printed
    assert saved["command"].startswith("python -m benchmarks.shm_native --rounds 2")
    assert shlex.split(saved["command"])[3:] == argv, "the saved command, pasted into a shell, reruns it"


@pytest.mark.parametrize("ranks, busy, cores, noted", [(16, 0, 16, True), (15, 0, 16, False), (2, 0, 2, True),
                                                       (2, 1, 3, True), (2, 1, 4, False)])
def test_the_report_says_when_every_core_holds_a_rank(ranks, busy, cores, noted):
    result = {"world_size": ranks, "busy": busy, "cores": cores, "sizes": [8], "wrong": {"shm native": 0},
              "deepspeed_left_out": "", "times_us": {"shm native": {"8": [10.0, 12.0]}}}
    assert ("every core holds a rank" in shm_native.report(result)) == noted


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


def test_one_slow_warm_up_turn_does_not_leave_its_cell_at_one_call_a_turn():
    """A warm-up turn that lost its core (10 ms) among ones of 10 us: the cell still makes as many
    calls a turn as fit the budget at 10 us, not one (a turn of one call times the ranks' uneven
    wake-up from the barrier with it, and that cell's median with it for the whole run)."""
    assert shm_native.calls_per_turn([0.010, 1e-5, 2e-5], budget_ms=10, iters=500) == 500
    assert shm_native.calls_per_turn([1e-5, 0.010, 2e-5], budget_ms=10, iters=500) == 500
    assert shm_native.calls_per_turn([4e-4, 0.010, 5e-4], budget_ms=10, iters=500) == 25
    assert shm_native.calls_per_turn([0.050], budget_ms=10, iters=500) == 1  # longer than the budget: one
    assert shm_native.calls_per_turn([0.0], budget_ms=10, iters=7) == 7


@settings(max_examples=200, deadline=None)
@given(paces=st.lists(st.floats(1e-7, 1.0), min_size=1, max_size=5), budget_ms=st.floats(0.1, 100),
       iters=st.integers(1, 1000))
def test_property_the_count_is_the_fastest_turns_whatever_the_order(paces, budget_ms, iters):
    k = shm_native.calls_per_turn(paces, budget_ms, iters)
    assert k == max(shm_native.calls_per_turn([p], budget_ms, iters) for p in paces)
    assert k == shm_native.calls_per_turn(list(reversed(paces)), budget_ms, iters)
    assert 1 <= k <= iters
