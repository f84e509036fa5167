"""The shm backend's one piece of C++ (forward.cpp), built on first use and cached.

    from collectives.shm import native
    native.load()        # builds once per machine and torch, then loads the built file from its stamp

torch registers a group's backend for a device as a C++ `c10d::Backend`; that is how a group gets
its name, how DeviceMesh, DTensor and the functional collectives find it, and how torch's C++
callers (DDP's reducer, fully_shard) reach it. forward.cpp is a Backend that hands every call to
the Python object doing the work (process_group.ShmBackend). torch.utils.cpp_extension compiles it
against the installed torch, into torch's extension cache (TORCH_EXTENSIONS_DIR, by default
~/.cache/torch_extensions); a changed forward.cpp or torch is rebuilt. It needs a C++ compiler and
ninja; without them load() says which is missing and how to install it.

Once built, a process imports the module straight from the file a stamp names (a file beside
torch's cache, one per build: the digest of the sources, the flags, this torch and this Python,
and the built file's size and time). Going through torch.utils.cpp_extension instead costs about
0.13 s a process (importing it, writing the ninja file, running ninja to find nothing to do),
paid by every rank of every shm group; a stamp that does not match (a changed source, another
torch, a file rebuilt since) sends load() that way, which rebuilds what changed.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import sys
import threading

_HERE = os.path.dirname(os.path.abspath(__file__))
SOURCE = os.path.join(_HERE, "forward.cpp")

NAME = "collectives_shm_forward"
_lock = threading.Lock()
_module = None


class BuildError(RuntimeError):
    """The bridge could not be built: what is missing and how to get it."""


def _missing() -> str:
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        return (f"no C++ compiler ({compiler!r} is not on PATH): install one (Debian/Ubuntu: "
                "apt-get install g++) or point CXX at one")
    if shutil.which("ninja") is None:  # the pip package (a dependency) puts it on PATH
        return "no ninja on PATH: python -m pip install ninja"
    return ""


def headers() -> list:
    """Every other C++ file beside forward.cpp (the native path's headers, which it includes), by
    name. torch's cache keys a build on its sources and flags only, so their digest goes into the
    flags and a changed header is rebuilt too; a list written by hand once left one out, and an
    edit to it alone loaded the old build."""
    folder = os.path.dirname(SOURCE)
    return sorted(os.path.join(folder, name) for name in os.listdir(folder)
                  if name.endswith((".h", ".hpp", ".cpp", ".cc")) and os.path.join(folder, name) != SOURCE)


def _headers_digest() -> str:
    digest = hashlib.sha1()
    for path in headers():
        digest.update(os.path.basename(path).encode() + b"\0")
        with open(path, "rb") as f:
            digest.update(f.read())
    return digest.hexdigest()[:16]


def _flags() -> list:
    return ["-O3", f"-DSHM_HEADERS={_headers_digest()}"]


def _key() -> str:
    """What the built file depends on: forward.cpp, the flags (which carry the headers' digest),
    torch and Python."""
    import torch

    digest = hashlib.sha1()
    with open(SOURCE, "rb") as f:
        digest.update(f.read())
    digest.update(repr((_flags(), torch.__version__, sys.version, sys.abiflags)).encode())
    return digest.hexdigest()[:20]


def _stamp_dir() -> str:
    """Where the stamps live: the root of torch's extension cache, found as torch finds it
    (TORCH_EXTENSIONS_DIR, else cpp_extension.get_default_build_root's folder, read without
    importing cpp_extension)."""
    import torch._appdirs

    return os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.realpath(
        torch._appdirs.user_cache_dir(appname="torch_extensions"))


def _stamp_path(key: str) -> str:
    return os.path.join(_stamp_dir(), f"{NAME}-{key}.stamp")


def _file_id(path: str) -> list:
    st = os.stat(path)
    return [st.st_size, st.st_mtime_ns]


def stamped(key: str):
    """The built file a stamp for `key` names, if it is still the file that was stamped; else None."""
    try:
        with open(_stamp_path(key)) as f:
            stamp = json.load(f)
        return stamp["file"] if _file_id(stamp["file"]) == stamp["id"] else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def write_stamp(key: str, built: str) -> None:
    """Stamp `built` as the module for `key` (written whole, then renamed: a reader never sees half
    of it), and remove the stamps of earlier keys that named the same file (it was rebuilt since)."""
    folder = _stamp_dir()
    try:
        os.makedirs(folder, exist_ok=True)
        for name in os.listdir(folder):
            if name.startswith(NAME + "-") and name.endswith(".stamp") and name != os.path.basename(_stamp_path(key)):
                try:
                    with open(os.path.join(folder, name)) as f:
                        if json.load(f).get("file") == built:
                            os.unlink(os.path.join(folder, name))
                except (OSError, ValueError, AttributeError):
                    pass
        tmp = f"{_stamp_path(key)}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump({"file": built, "id": _file_id(built)}, f)
        os.replace(tmp, _stamp_path(key))
    except OSError:  # a read-only cache: every process takes torch's way, as before
        pass


def _import(path: str):
    spec = importlib.util.spec_from_file_location(NAME, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load():
    """The compiled module (ForwardBackend), building it first if torch's cache has none for this
    source and this torch."""
    global _module
    with _lock:
        if _module is not None:
            return _module
        key = _key()
        built = stamped(key)
        if built is not None:
            _module = _import(built)
            return _module
        _module = load_through_torch()
        write_stamp(key, os.path.abspath(_module.__file__))
        return _module


def load_through_torch():
    """The module as torch.utils.cpp_extension loads it, building what changed (no stamp read or
    written: load() does that; benchmarks.studies.bridge_load times the two ways)."""
    why = _missing()
    if why:
        raise BuildError(f"the shm backend needs its C++ bridge to torch built once, and cannot build it: {why}")
    from torch.utils import cpp_extension

    build_dir = cpp_extension._get_build_directory(NAME, verbose=False)
    if not os.path.exists(os.path.join(build_dir, NAME + ".so")):
        print(f"collectives.shm: building the backend's C++ bridge to torch once (up to a minute) in {build_dir}",
              file=sys.stderr, flush=True)
    try:
        return cpp_extension.load(NAME, [SOURCE], extra_cflags=_flags(), verbose=False)
    except Exception as exc:  # noqa: BLE001 - a compiler's error, made into one that says what failed
        raise BuildError(f"building the shm backend's C++ bridge ({SOURCE}) failed in {build_dir}: {exc}") from exc
