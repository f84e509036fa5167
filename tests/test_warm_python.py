"""The warm interpreter (tests/warm_python.py) runs a file as `python FILE` would: its exit code,
its output, its failure, its name and arguments, its own names only, and a timeout that kills
what it started and leaves the interpreter usable. Files that start ranks through it are the docs'
examples (tests/test_readme.py).

    pytest tests/test_warm_python.py -q
"""

import os
import subprocess
import sys
import textwrap
import time

import pytest

pytestmark = pytest.mark.slow  # one interpreter that imports torch, a few seconds


def _file(folder, text, name="program.py"):
    path = folder / name
    path.write_text(textwrap.dedent(text))
    return path


def test_output_arguments_name_and_folder_are_those_of_python_file(warm_python, tmp_path):
    path = _file(tmp_path, """
        import os, sys
        print(__name__, sys.argv[1:], os.getcwd(), sys.path[0])
        print("to stderr", file=sys.stderr)
    """)
    out = warm_python.run([str(path), "a", "b"], cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["__main__", "['a',", "'b']", str(tmp_path), str(tmp_path)]
    assert out.stderr == "to stderr\n"
    fresh = subprocess.run([sys.executable, str(path), "a", "b"], cwd=tmp_path, capture_output=True, text=True)
    assert (out.returncode, out.stdout, out.stderr) == (fresh.returncode, fresh.stdout, fresh.stderr)


@pytest.mark.parametrize("body, code", [("raise SystemExit(3)", 3), ("import sys; sys.exit('bad')", 1),
                                        ("raise ValueError('planted')", 1), ("pass", 0)])
def test_exit_codes_are_those_of_python_file(warm_python, tmp_path, body, code):
    out = warm_python.run([str(_file(tmp_path, body))], cwd=tmp_path)
    assert out.returncode == code
    if "ValueError" in body:
        assert "ValueError: planted" in out.stderr and "Traceback" in out.stderr


def test_a_name_the_file_did_not_import_fails_though_the_interpreter_imported_it(warm_python, tmp_path):
    out = warm_python.run([str(_file(tmp_path, "print(torch.ones(1))"))], cwd=tmp_path)
    assert out.returncode == 1 and "NameError: name 'torch' is not defined" in out.stderr


def test_a_module_runs_with_dash_m_and_atexit_handlers_run(warm_python, tmp_path):
    _file(tmp_path, "import atexit\natexit.register(print, 'at exit')\nprint('ran')\n", name="mod_here.py")
    out = warm_python.run(["-m", "mod_here"], cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout == "ran\nat exit\n"


def test_a_timeout_kills_the_files_session_and_the_next_file_runs(warm_python, tmp_path):
    marker = tmp_path / "child.pid"
    path = _file(tmp_path, f"""
        import subprocess, sys, time
        child = subprocess.Popen(["sleep", "600"])
        open({str(marker)!r}, "w").write(str(child.pid))
        time.sleep(600)
    """)
    with pytest.raises(subprocess.TimeoutExpired):
        warm_python.run([str(path)], cwd=tmp_path, timeout=3)
    pid = int(marker.read_text())
    for _ in range(100):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.05)
    else:
        raise AssertionError(f"the file's own child {pid} outlived the timeout")
    out = warm_python.run([str(_file(tmp_path, "print('next')", name="next.py"))], cwd=tmp_path)
    assert (out.returncode, out.stdout) == (0, "next\n")
