"""The warm interpreter (tests/warm_python.py) runs a file as `python FILE` would: its exit code,
its output, its failure, its name and arguments, its own names only, and a timeout that kills
what it started and leaves the interpreter usable.

    pytest tests/test_warm_python.py -q
"""

import os
import subprocess
import sys
import textwrap
import time

import pytest

from .warm_python import WarmPython

pytestmark = pytest.mark.slow  # one interpreter that imports torch, a few seconds


@pytest.fixture(scope="module")
def python():
    with WarmPython() as warm:
        yield warm


def _file(folder, text, name="program.py"):
    path = folder / name
    path.write_text(textwrap.dedent(text))
    return path


def test_output_arguments_name_and_folder_are_those_of_python_file(python, tmp_path):
    path = _file(tmp_path, """
        import os, sys
        print(__name__, sys.argv[1:], os.getcwd(), sys.path[0])
        print("to stderr", file=sys.stderr)
    """)
    out = python.run([str(path), "a", "b"], cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["__main__", "['a',", "'b']", str(tmp_path), str(tmp_path)]
    assert out.stderr == "to stderr\n"
    fresh = subprocess.run([sys.executable, str(path), "a", "b"], cwd=tmp_path, capture_output=True, text=True)
    assert (out.returncode, out.stdout, out.stderr) == (fresh.returncode, fresh.stdout, fresh.stderr)


@pytest.mark.parametrize("body, code", [("raise SystemExit(3)", 3), ("import sys; sys.exit('bad')", 1),
                                        ("raise ValueError('planted')", 1), ("pass", 0)])
def test_exit_codes_are_those_of_python_file(python, tmp_path, body, code):
    out = python.run([str(_file(tmp_path, body))], cwd=tmp_path)
    assert out.returncode == code
    if "ValueError" in body:
        assert "ValueError: planted" in out.stderr and "Traceback" in out.stderr


def test_a_name_the_file_did_not_import_fails_though_the_interpreter_imported_it(python, tmp_path):
    out = python.run([str(_file(tmp_path, "print(torch.ones(1))"))], cwd=tmp_path)
    assert out.returncode == 1 and "NameError: name 'torch' is not defined" in out.stderr


def test_a_module_runs_with_dash_m_and_atexit_handlers_run(python, tmp_path):
    _file(tmp_path, "import atexit\natexit.register(print, 'at exit')\nprint('ran')\n", name="mod_here.py")
    out = python.run(["-m", "mod_here"], cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout == "ran\nat exit\n"


def test_ranks_started_by_the_file_run_and_report(python, tmp_path):
    path = _file(tmp_path, """
        import torch, collectives

        def body(env):
            return collectives.all_reduce(torch.tensor([env.rank + 1.0])).item()

        if __name__ == "__main__":
            print(collectives.run(body, world_size=2))
    """)
    out = python.run([str(path)], cwd=tmp_path, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[3.0, 3.0]"


def test_a_timeout_kills_the_files_session_and_the_next_file_runs(python, tmp_path):
    marker = tmp_path / "child.pid"
    path = _file(tmp_path, f"""
        import subprocess, sys, time
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        open({str(marker)!r}, "w").write(str(child.pid))
        time.sleep(600)
    """)
    with pytest.raises(subprocess.TimeoutExpired):
        python.run([str(path)], cwd=tmp_path, timeout=3)
    pid = int(marker.read_text())
    for _ in range(100):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.05)
    else:
        raise AssertionError(f"the file's own child {pid} outlived the timeout")
    out = python.run([str(_file(tmp_path, "print('next')", name="next.py"))], cwd=tmp_path)
    assert (out.returncode, out.stdout) == (0, "next\n")
