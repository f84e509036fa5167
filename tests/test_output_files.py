"""An output path is written as what it is, never destroyed: a regular file is replaced whole or
not at all, a link keeps its link and its target gets the content, a FIFO's reader gets it, a
character device stays a device, and this process's own stdout is written through its descriptor.
A device that cannot take the bytes (/dev/full) is exit code 1 and one line, with nothing left.

    pytest tests/test_output_files.py -q

The devices are made with os.mknod in a temporary folder (needs root), never touched under /dev.
"""

from __future__ import annotations

import ast
import json
import os
import stat
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from benchmarks import plot
from collectives import cli, output_files
from collectives.output_files import OutputError, check_outputs, write_output

ROOT = Path(__file__).resolve().parents[1]
# A results file of one collective at two sizes: the smallest figure benchmarks.plot draws (about
# 1 s; a real run's file takes 2.5 s a figure)
SMALL_RESULT = {"environment": {"backend": "gloo", "world_size": 2, "device": "cpu", "date": "2026-11-27"},
                "rows": [{"collective": "all_reduce", "size": size, "ip": {"time_us": 10.0 + size / 1e3,
                                                                              "busbw": size / 1e4, "algbw": size / 1e4}}
                         for size in (8, 1024)]}
CONTENTS = {"text": "a result\n", "bytes": b"a result\n", "function": lambda f: f.write(b"a result\n")}


def device(path: Path, minor: int) -> Path:
    """A character device like /dev/null (minor 3) or /dev/full (minor 7), made at `path`."""
    try:
        os.mknod(path, stat.S_IFCHR | 0o666, os.makedev(1, minor))
    except PermissionError:
        pytest.skip("making a device node needs root")
    return path


def read_fifo(path: Path, out: list) -> threading.Thread:
    """A reader of the FIFO at `path`, in a thread; what it read lands in `out`."""
    def reader():
        with open(path, "rb") as f:
            out.append(f.read())
    thread = threading.Thread(target=reader, daemon=True)
    thread.start()
    return thread


# -- write_output, over every kind of path and every form of content -------------------------------

@pytest.mark.parametrize("content", CONTENTS.values(), ids=CONTENTS.keys())
@pytest.mark.parametrize("kind", ["new", "regular", "link", "link to a link", "dangling link", "relative link"])
def test_a_file_or_a_link_gets_the_content_and_a_link_stays_a_link(kind, content, tmp_path):
    target = tmp_path / "runs" / "7" / "summary.json"
    target.parent.mkdir(parents=True)
    path = tmp_path / "summary.json"
    if kind != "new":
        if kind != "dangling link":
            target.write_text("an older run\n")
            target.chmod(0o640)
        if kind == "regular":
            path = target
        elif kind == "link to a link":
            (tmp_path / "middle.json").symlink_to(target)
            path.symlink_to(tmp_path / "middle.json")
        elif kind == "relative link":
            path.symlink_to(os.path.join("runs", "7", "summary.json"))
        else:
            path.symlink_to(target)
    write_output(str(path), content)
    assert path.read_text() == "a result\n"
    if "link" in kind:
        assert path.is_symlink() and target.read_text() == "a result\n"
    if kind in ("regular", "link", "link to a link", "relative link"):
        assert stat.S_IMODE(target.stat().st_mode) == 0o640  # the replaced file keeps its mode
    leftovers = [p for p in tmp_path.rglob("*") if p.name.endswith(".tmp")]
    assert leftovers == []


def test_a_fifo_is_written_into_and_its_reader_gets_the_content(tmp_path):
    fifo = tmp_path / "results.fifo"
    os.mkfifo(fifo)
    got = []
    thread = read_fifo(fifo, got)
    write_output(str(fifo), "a result\n")
    thread.join(10)
    assert got == [b"a result\n"] and stat.S_ISFIFO(os.lstat(fifo).st_mode)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results.fifo"]


def test_a_null_device_stays_a_device(tmp_path):
    null = device(tmp_path / "null", 3)
    write_output(str(null), "a result\n")
    assert stat.S_ISCHR(os.lstat(null).st_mode) and os.major(os.lstat(null).st_rdev) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["null"]


@pytest.mark.parametrize("content", CONTENTS.values(), ids=CONTENTS.keys())
def test_a_full_device_raises_one_line_naming_the_flag_and_stays_a_device(content, tmp_path):
    full = device(tmp_path / "full", 7)
    with pytest.raises(OutputError) as info:
        write_output(str(full), content, "--json")
    assert str(info.value) == f"could not write --json {full} (No space left on device)"
    assert stat.S_ISCHR(os.lstat(full).st_mode) and sorted(p.name for p in tmp_path.iterdir()) == ["full"]


def test_a_full_disk_leaves_the_old_file_and_nothing_else(tmp_path, monkeypatch):
    old = tmp_path / "run.json"
    old.write_text("an older run\n")

    def fail(f):
        f.write(b"half")
        raise OSError(28, "No space left on device")
    with pytest.raises(OutputError, match="No space left on device"):
        write_output(str(old), fail, "--json")
    assert old.read_text() == "an older run\n" and list(tmp_path.iterdir()) == [old]


def test_stdout_redirected_to_a_file_is_appended_to_through_its_descriptor(tmp_path):
    """`--json /dev/stdout > out.txt`: what was printed before and after stays, in order, and
    out.txt is the shell's file still (renaming over it would leave later prints in a lost inode).
    /dev/stdout itself is named by links made here (a link to /proc/self/fd/1, as /dev/stdout is,
    and one to the folder, as /dev/fd is): a regression must not replace the machine's /dev/stdout."""
    out = tmp_path / "out.txt"
    (tmp_path / "stdout").symlink_to("/proc/self/fd/1")
    (tmp_path / "fd").symlink_to("/proc/self/fd")
    names = [str(tmp_path / "stdout"), str(tmp_path / "fd" / "1"), "/proc/self/fd/1"]
    program = ("import importlib.util, sys\n"  # the module alone: importing the package would import torch (2 s)
               f"spec = importlib.util.spec_from_file_location('output_files', {str(ROOT / 'collectives' / 'output_files.py')!r})\n"
               "output_files = importlib.util.module_from_spec(spec); spec.loader.exec_module(output_files)\n"
               "print('before')\n"
               "for name in sys.argv[1:]:\n"
               "    output_files.write_output(name, 'to ' + name + '\\n'); print('after')\n")
    with open(out, "w") as f:
        subprocess.run([sys.executable, "-c", program, *names], stdout=f, check=True, cwd=ROOT, timeout=60)
    assert out.read_text() == "before\n" + "".join(f"to {name}\nafter\n" for name in names)
    assert (tmp_path / "stdout").is_symlink() and (tmp_path / "fd").is_symlink()


def test_own_descriptor_reads_every_name_of_this_process_s_descriptors():
    assert [output_files.own_descriptor(p) for p in ("/dev/stdout", "/dev/stderr", "/dev/fd/7", "/proc/self/fd/5",
                                                     f"/proc/{os.getpid()}/fd/3", "/proc/1/fd/1", "/tmp/x")] \
        == [1, 2, 7, 5, 3, None, None]


# -- check_outputs: looks, never blocks, never truncates, leaves nothing -----------------------------

def test_the_check_does_not_wait_for_a_fifo_s_reader(tmp_path):
    """Opening a FIFO to write waits for a reader: the check must not open it."""
    fifo = tmp_path / "results.fifo"
    os.mkfifo(fifo)
    done = threading.Event()
    thread = threading.Thread(target=lambda: (check_outputs(cli.ArgumentParser(), {"--json": str(fifo)}), done.set()),
                              daemon=True)
    thread.start()
    if not done.wait(10):
        got = []
        read_fifo(fifo, got)  # let the stuck check go
        pytest.fail("check_outputs waited for the FIFO's reader")


def test_the_check_of_a_dangling_link_keeps_the_link_and_leaves_no_target(tmp_path):
    link = tmp_path / "summary.json"
    link.symlink_to(tmp_path / "runs-summary.json")
    check_outputs(cli.ArgumentParser(), {"--json": str(link)})
    assert link.is_symlink() and sorted(p.name for p in tmp_path.iterdir()) == ["summary.json"]


def test_the_check_of_a_link_into_a_missing_folder_names_it(tmp_path, capsys):
    link = tmp_path / "summary.json"
    link.symlink_to(tmp_path / "gone" / "summary.json")
    with pytest.raises(SystemExit) as info:
        check_outputs(cli.ArgumentParser(prog="p"), {"--json": str(link)})
    assert info.value.code == 2 and f"the folder {tmp_path / 'gone'} does not exist" in capsys.readouterr().err


# -- a program, end to end ------------------------------------------------------------------------

@pytest.fixture
def result_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("result") / "run.json"
    path.write_text(json.dumps(SMALL_RESULT))
    return str(path)


def test_a_program_writes_into_a_null_device_and_exits_0(tmp_path, capsys, result_file):
    null = device(tmp_path / "null", 3)
    assert plot.main([result_file, "-o", str(null)]) == 0
    assert stat.S_ISCHR(os.lstat(null).st_mode) and sorted(p.name for p in tmp_path.iterdir()) == ["null"]


def test_a_program_on_a_full_device_exits_1_with_one_line(tmp_path, capsys, result_file):
    full = device(tmp_path / "full", 7)
    assert plot.main([result_file, "-o", str(full)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"python -m benchmarks.plot: could not write -o {full} (No space left on device)"], err
    assert stat.S_ISCHR(os.lstat(full).st_mode) and sorted(p.name for p in tmp_path.iterdir()) == ["full"]


def test_a_program_writes_through_a_link_and_into_a_fifo(tmp_path, result_file):
    target = tmp_path / "runs" / "busbw.png"
    target.parent.mkdir()
    link = tmp_path / "busbw.png"
    link.symlink_to(target)
    assert plot.main([result_file, "-o", str(link)]) == 0
    assert link.is_symlink() and target.read_bytes()[:4] == b"\x89PNG"
    fifo = tmp_path / "busbw.fifo"
    os.mkfifo(fifo)
    got = []
    thread = read_fifo(fifo, got)
    assert plot.main([result_file, "-o", str(fifo)]) == 0
    thread.join(10)
    assert got and got[0][:4] == b"\x89PNG" and stat.S_ISFIFO(os.lstat(fifo).st_mode)


# -- every writer goes through write_output --------------------------------------------------------

# The project's own state (the cluster's configuration, the bridge build's stamp), not a user's output path.
OWN_STATE = {"collectives/cluster/slurm.py", "collectives/cluster/hosts.py", "collectives/cluster/wire.py",
             "collectives/shm/native.py", "collectives/output_files.py"}


def _writes(path: Path):
    """(line, what) of each open(..., "w"/"wb"/"a"/"x"), savefig or torch.save to a path in a module."""
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Call):
            continue
        name = ast.unparse(node.func)
        if name == "open":
            modes = [a for a in node.args[1:2]] + [k.value for k in node.keywords if k.arg == "mode"]
            if any(isinstance(m, ast.Constant) and isinstance(m.value, str) and set(m.value) & set("wax")
                   for m in modes):
                yield node.lineno, ast.unparse(node)
        elif name.endswith(".savefig") and not any(isinstance(a, ast.Name) and a.id == "buffer" for a in node.args):
            yield node.lineno, ast.unparse(node)
        elif name in ("torch.save", "np.save", "numpy.save") and not (len(node.args) > 1 and ast.unparse(node.args[1]) == "f"):
            yield node.lineno, ast.unparse(node)

def test_every_output_is_written_by_write_output():
    found = [f"{p.relative_to(ROOT)}:{line}: {what}"
             for pkg in ("collectives", "ddp_from_scratch", "benchmarks") for p in sorted((ROOT / pkg).rglob("*.py"))
             if str(p.relative_to(ROOT)) not in OWN_STATE for line, what in _writes(p)]
    assert found == [], "write these through collectives.output_files.write_output:\n" + "\n".join(found)


def test_the_scan_finds_a_plain_open_for_writing(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("def save(p, fig, t):\n    with open(p, 'w') as f:\n        f.write('x')\n    fig.savefig(p)\n"
                      "    torch.save(t, p)\n    open(p, mode='ab')\n    open(p)\n")
    assert sorted(line for line, _ in _writes(module)) == [2, 4, 5, 6]
