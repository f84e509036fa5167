"""The bridge (forward.cpp) is built once; later processes import the built file straight from
the stamp native.load() left, and only while the stamp still says the truth: the same sources,
flags, torch and Python, and the same built file.

    pytest tests/shm/test_bridge_build.py -q
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from collectives.shm import native


@pytest.mark.slow
def test_a_later_process_imports_the_built_bridge_without_torchs_build_tools():
    """The first load (this process) stamps the build; a new process loads the stamped file
    without importing torch.utils.cpp_extension (about 0.13 s a process, every rank's), and so
    without a compiler: a machine whose cache holds the build needs none."""
    module = native.load()
    assert native.stamped(native._key()) == os.path.abspath(module.__file__)
    code = ("import sys, torch; from collectives.shm import native; m = native.load(); "
            "print(m.__file__); print('torch.utils.cpp_extension' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                         env={**os.environ, "CXX": "no-such-compiler"})
    assert out.returncode == 0, out.stderr[-3000:]
    file, imported_build_tools = out.stdout.split()
    assert os.path.abspath(file) == os.path.abspath(module.__file__)
    assert imported_build_tools == "False", out.stdout


def test_a_stamp_names_its_file_only_while_that_file_is_unchanged(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "cache"))
    built = tmp_path / "bridge.so"
    built.write_bytes(b"x" * 100)
    native.write_stamp("k1", str(built))
    assert native.stamped("k1") == str(built)
    assert native.stamped("k2") is None  # another source, flags, torch or Python
    built.write_bytes(b"y" * 101)  # rebuilt since, by a process with other sources
    assert native.stamped("k1") is None
    native.write_stamp("k1", str(built))
    os.utime(built, ns=(1, 1))  # the same size, another time
    assert native.stamped("k1") is None
    native.write_stamp("k2", str(built))  # k1's stamp named this file: it goes
    assert native.stamped("k2") == str(built)
    assert sorted(os.listdir(tmp_path / "cache")) == [f"{native.NAME}-k2.stamp"]
    built.unlink()
    assert native.stamped("k2") is None
    (tmp_path / "cache" / f"{native.NAME}-k3.stamp").write_text("half a stamp {")
    assert native.stamped("k3") is None


def test_the_key_changes_with_every_file_the_build_reads(tmp_path, monkeypatch):
    """A changed header must not import the file built from the old one: the key covers every C++
    file of the folder, found here from the folder itself (not from native's own list), and a
    header added to the folder, or renamed, changes it too."""
    folder = tmp_path / "shm"
    shutil.copytree(os.path.dirname(native.SOURCE), folder, ignore=shutil.ignore_patterns("*.py", "__pycache__"))
    monkeypatch.setattr(native, "SOURCE", str(folder / "forward.cpp"))
    files = sorted(p for p in folder.iterdir() if p.suffix in (".h", ".cpp"))
    assert len(files) >= 6 and folder / "native_p2p.h" in files
    keys = [native._key()]
    for path in files:
        with open(path, "a") as f:
            f.write("\n// changed\n")
        keys.append(native._key())
    (folder / "native_new.h").write_text("// a header added\n")
    keys.append(native._key())
    (folder / "native_new.h").rename(folder / "native_newer.h")
    keys.append(native._key())
    assert len(set(keys)) == len(keys) == len(files) + 3


def test_without_a_stamp_or_a_compiler_the_error_says_what_to_install(monkeypatch):
    monkeypatch.setenv("CXX", "no-such-compiler")
    with pytest.raises(native.BuildError, match=r"no C\+\+ compiler \('no-such-compiler' is not on PATH\): install one"):
        native.load_through_torch()


def test_the_stamps_sit_at_the_root_of_torchs_extension_cache(tmp_path, monkeypatch):
    from torch.utils import cpp_extension

    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    assert native._stamp_dir() == cpp_extension.get_default_build_root()
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert native._stamp_dir() == str(tmp_path)
