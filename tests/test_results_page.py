"""benchmarks/RESULTS.md and the files under benchmarks/results/: every file the page names (a
name, or a pattern with {a,b} and *) is there, and no file is named by when it was measured
against a change (before, after, now, head, final, a commit hash) or by the time of day it ran
(morning, late, 0900) rather than by what it measured and where. A measurement run more than once
keeps its runs in one file: the text has a part a run ("## run 2 of 3"), the JSON a row set a run
under "runs", and the two agree.

    pytest tests/test_results_page.py -q
"""

from __future__ import annotations

import fnmatch
import json
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
FILE = re.compile(r"`([A-Za-z0-9_.{},*\-]+\.(?:\*|json|txt|png|csv|md|\{[a-z,]+\}))`")
HISTORY = re.compile(
    r"(^|[-_])(before|after|now|head|final|old|new|earlier|late|morning|evening|night|midnight)([-_.]|$)"
    r"|[-_][0-9a-f]{7}[-_.]"  # a commit hash between separators
    r"|[-_](?:[01][0-9]|2[0-3])[0-5][0-9](?!-[0-9]{2}-[0-9]{2})[-_.]"  # a time of day, 0900; not a date's year
    # a repeat of a measurement kept beside its first run (its place: the first run's file, as runs[i])
    r"|(^|[-_])(?:run[0-9]+|repeat|rerun|again|second|third|[b-e])([-_.]|$)")


def expand(pattern: str) -> list:
    """`a_{1,2}.*` -> ["a_1.*", "a_2.*"] (every {x,y} alternative, nested ones too)."""
    m = re.search(r"\{([^{}]*)\}", pattern)
    if not m:
        return [pattern]
    return [out for alt in m.group(1).split(",") for out in expand(pattern[:m.start()] + alt + pattern[m.end():])]


def named_files(text: str) -> list:
    """The result file names and patterns the text names in backticks, expanded."""
    return [p.replace("...", "*") for token in FILE.findall(text) for p in expand(token)]


def test_every_file_the_results_page_names_is_there():
    files = [p.name for p in RESULTS.iterdir()]
    names = named_files((ROOT / "benchmarks" / "RESULTS.md").read_text())
    assert len(names) > 50
    missing = [n for n in names if not any(fnmatch.fnmatch(f, n) for f in files)]
    assert missing == [], missing


def test_no_result_file_is_named_by_a_change_or_a_commit():
    assert [p.name for p in RESULTS.iterdir() if HISTORY.search(p.name)] == []


def runs_disagreeing(text: str, saved) -> str:
    """Why a file of several runs is not whole ("" if it is): its first line says how many runs,
    its parts are numbered 1 to that many, each part pointing at its row set in the JSON, which
    holds that many (saved: the JSON's content, None where there is none)."""
    head = re.match(r"(\d+) runs\b", text)
    parts = re.findall(r"^## run (\d+) of (\d+)(?: \(its rows: runs\[(\d+)\] in [^)]+\.json\))?(?:, .+)?$", text, flags=re.M)
    if head is None:
        return "its first line does not say how many runs it holds" if parts else ""
    n = int(head.group(1))
    if [(int(i), int(of)) for i, of, _ in parts] != [(i, n) for i in range(1, n + 1)]:
        return f"it says {n} runs; its parts are {[f'{i} of {of}' for i, of, _ in parts]}"
    if saved is not None:
        if not isinstance(saved, dict) or len(saved.get("runs", ())) != n:
            return f"its JSON does not hold {n} row sets under runs"
        if [r for _, _, r in parts] != [str(i) for i in range(n)]:
            return "its parts do not point at runs[0], runs[1], ... in turn"
    return ""


def test_a_file_of_several_runs_holds_each_run_once_in_its_text_and_its_json():
    bad = {}
    for path in sorted(RESULTS.glob("*.txt")):
        text = path.read_text()
        json_path = path.with_suffix(".json")
        saved = json.loads(json_path.read_text()) if json_path.exists() and re.match(r"\d+ runs\b", text) else None
        why = runs_disagreeing(text, saved)
        if why:
            bad[path.name] = why
    assert bad == {}, bad
    assert sum(1 for p in RESULTS.glob("*.txt") if re.match(r"\d+ runs\b", p.read_text())) >= 10


def test_the_runs_check_fails_on_a_run_left_out():
    whole = ("2 runs on the 2-core VM\n\n## run 1 of 2 (its rows: runs[0] in a.json)\nx\n\n"
             "## run 2 of 2 (its rows: runs[1] in a.json)\ny\n")
    assert runs_disagreeing(whole, {"runs": [{}, {}]}) == ""
    assert "JSON does not hold 2" in runs_disagreeing(whole, {"runs": [{}]})
    assert "parts are" in runs_disagreeing(whole.replace("## run 2 of 2", "## run 1 of 2"), {"runs": [{}, {}]})
    assert "parts are" in runs_disagreeing("3" + whole[1:], None)
    assert "in turn" in runs_disagreeing(whole.replace("runs[1]", "runs[0]"), {"runs": [{}, {}]})
    assert "how many" in runs_disagreeing(whole.split("\n", 1)[1], None)


def test_the_expansion_and_the_history_names():
    assert expand("a_{1,2}_{x,y}.*") == ["a_1_x.*", "a_1_y.*", "a_2_x.*", "a_2_y.*"]
    assert named_files("(file `shm-native_{2,4}ranks.txt`, `..._b.json`)") == [
        "shm-native_2ranks.txt", "shm-native_4ranks.txt", "*_b.json"]
    for name in ("shm-native-busy-now_cpu.txt", "suite-durations_before_cpu.txt", "gpu-checks_h100_ed7d1f0.txt",
                 "suite_fresh-clone-ci-a1e082f_cpu.txt", "suite-durations_after_cpu-2core_2026-11-25.txt",
                 "suite-durations_ab-0900-head_cpu.txt", "shm-ddp-floor-late_cpu.txt", "shm-native-final_cpu.txt",
                 "suite_fresh-clone-ci-midnight_cpu.txt", "suite_fresh-clone-ci-2359_cpu.txt",
                 "shm-native_16ranks_2026-11-26_run2.txt", "shm-native-regions_cpu-2core_2026-11-26_b.json",
                 "shm-ddp-floor-121rounds-c_cpu-2core_2026-11-27.txt", "bandwidth_cpu-2core_2026-11-26_repeat.json"):
        assert HISTORY.search(name), name
    for name in ("shm-native-busy_cpu.txt", "pipeline-nowait.txt", "bandwidth_2026-11-22.json", "latency_cpu.txt",
                 "suite_fresh-clone-ci-2778-tests_cpu-2core_2026-11-28.txt", "newton_2026-11-22.txt",
                 "shm-native-rounds-slow-handoff-spell_cpu-2core_2026-11-26.txt", "shm-ddp-repeats_cpu-2core.txt",
                 "shm-native-busy_h200-host-2of16cores_2ranks_2026-11-27.json", "runtime_b8_cpu.txt"):
        assert not HISTORY.search(name), name
