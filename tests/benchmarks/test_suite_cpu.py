"""The suite-CPU study charges each process to the test in its starting environment, counts the
CPU a process used (a busy one far more than a sleeping one), and leaves out what ran before;
inside pytest it charges a long-lived child's CPU, and pytest's own, to the test running then.

    pytest tests/benchmarks/test_suite_cpu.py -q
"""

import json
import subprocess
import sys

import pytest

from benchmarks.studies import suite_cpu

# Two children, each started as a test's: one computes for 0.6 s, one sleeps as long. The busy one then
# sleeps 1 s, so that a poll delayed on a busy machine still reads its whole CPU before it exits.
PROGRAM = """
import os, subprocess, sys
burn = "import time; t = time.process_time()\\nwhile time.process_time() - t < 0.6: pass\\ntime.sleep(1)"
kids = [subprocess.Popen([sys.executable, "-c", code], env={**os.environ, "PYTEST_CURRENT_TEST": test})
        for code, test in [(burn, "tests/a.py::test_burns@grp (call)"), ("import time; time.sleep(0.6)", "tests/a.py::test_sleeps (setup)")]]
sys.exit(sum(k.wait() for k in kids))
"""


def test_each_process_is_charged_to_its_test_by_the_cpu_it_used(tmp_path, capsys):
    out = tmp_path / "cpu.json"
    older = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert suite_cpu.main(["--json", str(out), "--", sys.executable, "-c", PROGRAM]) == 0
    finally:
        older.kill()
        older.wait()
    processes = json.loads(out.read_text())["processes"]
    totals = suite_cpu.per_test(processes)
    burn_cpu, burn_n = totals["tests/a.py::test_burns"]  # " (call)" and xdist's "@grp" dropped
    sleep_cpu, sleep_n = totals["tests/a.py::test_sleeps"]
    assert (burn_n, sleep_n) == (1, 1), totals
    assert burn_cpu >= 0.5, totals
    assert sleep_cpu < burn_cpu / 2, totals
    assert not any(key.startswith(f"{older.pid}:") for key in processes), "a process older than the command was counted"
    printed = capsys.readouterr().out
    assert "tests/a.py::test_burns" in printed.split("tests/a.py::test_sleeps")[0], printed  # costliest first
    ours = [entry for entry in processes.values() if entry["test"].startswith("tests/a.py::")]
    assert [entry["kind"] for entry in ours] == ["another Python program"] * 2, ours  # whatever else runs beside
    assert "kind of program" in printed and "another Python program" in printed.split("\n\n")[-2], printed


def test_per_test_sums_cpu_and_counts_processes():
    processes = {"1:5": {"test": "t::a", "argv": "x", "cpu": 1.5}, "2:6": {"test": "t::a", "argv": "y", "cpu": 0.25},
                 "3:7": {"test": suite_cpu.NO_TEST, "argv": "z", "cpu": 2.0}}
    assert suite_cpu.per_test(processes) == {"t::a": (1.75, 2), suite_cpu.NO_TEST: (2.0, 1)}


def test_a_failing_command_returns_its_exit_code(capsys):
    assert suite_cpu.main(["--", sys.executable, "-c", "raise SystemExit(3)"]) == 3
    assert "exit 3" in capsys.readouterr().out


# A child started as one test's forks without a new program, as a pool's fork server forks ranks;
# the fork then changes its own PYTEST_CURRENT_TEST, as pytest does between tests.
FORKING = """
import os, subprocess, sys
code = ("import os, time\\nif os.fork() == 0:\\n    os.environ['PYTEST_CURRENT_TEST'] = 'tests/b.py::test_later (call)'\\n"
        "    t = time.process_time()\\n    while time.process_time() - t < 0.4: pass\\n    time.sleep(1)\\n    os._exit(0)\\n"
        "os.wait()")
sys.exit(subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTEST_CURRENT_TEST": "tests/b.py::test_pool (call)"}).returncode)
"""


def test_a_forked_process_is_charged_to_the_test_its_forking_process_started_under(tmp_path):
    out = tmp_path / "cpu.json"
    assert suite_cpu.main(["--json", str(out), "--", sys.executable, "-c", FORKING]) == 0
    totals = suite_cpu.per_test(json.loads(out.read_text())["processes"])
    assert "tests/b.py::test_later" not in totals, totals
    cpu, n = totals["tests/b.py::test_pool"]
    assert n == 2 and cpu >= 0.35, totals


# A pytest session as the suite's: a module fixture starts a child once (a pool's rank), and a
# later test gives it work; another test computes in pytest's own process. Each test then sleeps
# 1 s, so that a poll delayed on a busy machine still sees the CPU while its test runs.
SESSION = """
import subprocess, sys, time
import pytest

RANK = "import sys, time\\nfor line in sys.stdin:\\n    t = time.process_time()\\n    while time.process_time() - t < float(line): pass\\n    print('done', flush=True)"

@pytest.fixture(scope="module")
def rank():
    p = subprocess.Popen([sys.executable, "-c", RANK], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    yield p
    p.stdin.close()
    p.wait()

def test_starts_the_rank(rank):
    time.sleep(1)

def test_gives_the_rank_work(rank):
    rank.stdin.write("0.6\\n")
    rank.stdin.flush()
    assert rank.stdout.readline() == "done\\n"
    time.sleep(1)

def test_computes_itself():
    t = time.process_time()
    while time.process_time() - t < 0.6:
        pass
    time.sleep(1)
"""


@pytest.mark.slow  # a pytest session in a fresh interpreter
def test_inside_pytest_a_long_lived_childs_cpu_and_pytests_own_go_to_the_test_running_then(tmp_path):
    (tmp_path / "test_session.py").write_text(SESSION)
    out = tmp_path / "cpu.json"
    # the study's plugin reaches pytest through PYTEST_ADDOPTS; the harness's own (which imports
    # torch) is not needed here
    assert suite_cpu.main(["--json", str(out), "--", sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "-p", "no:collectives", str(tmp_path / "test_session.py")]) == 0
    totals = suite_cpu.per_test(json.loads(out.read_text())["processes"])
    cpu = {name.split("::")[-1]: c for name, (c, _) in totals.items()}
    assert cpu.get("test_gives_the_rank_work", 0) >= 0.5, totals  # not the test that started the child
    assert cpu.get("test_starts_the_rank", 0) < 0.3, totals
    assert cpu.get("test_computes_itself", 0) >= 0.5, totals  # not "(no test: pytest and its workers)"


def test_each_program_is_put_with_its_kind_and_a_fork_servers_children_apart_from_it():
    server = "/usr/bin/python3 -c from multiprocessing.forkserver import main; main(16, 18, ['torch'])"
    worker = "/usr/bin/python3 -u -c import sys;exec(eval(sys.stdin.readline()))"
    assert suite_cpu.kind(server, worker) == "fork server (imports torch once)"
    assert suite_cpu.kind(server, server) == "forked from a fork server (a rank)"
    assert suite_cpu.kind(worker) == "pytest and its workers"
    assert suite_cpu.kind("python -m torch.distributed.run --nnodes 2 -m ddp_from_scratch.train") == "torchrun agent"
    assert suite_cpu.kind("python -c from multiprocessing.spawn import spawn_main; spawn_main(tracker_fd=5)") == \
        "spawned interpreter (a rank or a DataLoader worker)"
    assert suite_cpu.kind("/usr/lib/gcc/x86_64-linux-gnu/12/cc1plus -quiet forward.cpp") == "compiler and linker"
    assert suite_cpu.kind("python -m ddp_from_scratch.train --nproc 2") == "another Python program"
    assert suite_cpu.kind("sleep 60") == "other"
    processes = {"1:5": {"argv": server, "kind": "fork server (imports torch once)", "cpu": 6.5},
                 "2:6": {"argv": server, "kind": "forked from a fork server (a rank)", "cpu": 0.5},
                 "3:7": {"argv": server, "kind": "forked from a fork server (a rank)", "cpu": 0.25},
                 "4:8": {"argv": "sleep 1", "cpu": 0.0}}
    assert suite_cpu.per_kind(processes) == {"fork server (imports torch once)": (6.5, 1),
                                             "forked from a fork server (a rank)": (0.75, 2), "other": (0.0, 1)}
