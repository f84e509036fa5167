"""The shm backend's one piece of C++ (forward.cpp), built on first use and cached.

    from collectives.shm import native
    native.load()        # builds once (about 20 s on 2 cores), then imports in milliseconds

torch registers a group's backend for a device as a C++ `c10d::Backend`; that is how a group gets
its name, how DeviceMesh, DTensor and the functional collectives find it, and how torch's C++
callers (DDP's reducer, fully_shard) reach it. forward.cpp is a Backend that hands every call to
the Python object doing the work (process_group.ShmBackend). torch.utils.cpp_extension compiles it
against the installed torch, into torch's extension cache (TORCH_EXTENSIONS_DIR, by default
~/.cache/torch_extensions); a changed forward.cpp or torch is rebuilt. It needs a C++ compiler and
ninja; without them load() says which is missing and how to install it.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
import threading

_HERE = os.path.dirname(os.path.abspath(__file__))
SOURCE = os.path.join(_HERE, "forward.cpp")
# the native path's headers, which forward.cpp includes: torch's cache keys a build on its sources
# and flags only, so their digest goes into the flags and a changed header is rebuilt too
HEADERS = [os.path.join(_HERE, name) for name in ("native_wait.h", "native_paths.h", "native_recorder.h", "native_engine.h")]
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


def _headers_digest() -> str:
    digest = hashlib.sha1()
    for path in HEADERS:
        with open(path, "rb") as f:
            digest.update(f.read())
    return digest.hexdigest()[:16]


def load():
    """The compiled module (ForwardBackend), building it first if torch's cache has none for this
    source and this torch."""
    global _module
    with _lock:
        if _module is not None:
            return _module
        why = _missing()
        if why:
            raise BuildError(f"the shm backend needs its C++ bridge to torch built once, and cannot build it: {why}")
        from torch.utils import cpp_extension

        build_dir = cpp_extension._get_build_directory(NAME, verbose=False)
        if not os.path.exists(os.path.join(build_dir, NAME + ".so")):
            print(f"collectives.shm: building the backend's C++ bridge to torch once (about 20 s) in {build_dir}",
                  file=sys.stderr, flush=True)
        try:
            _module = cpp_extension.load(NAME, [SOURCE], extra_cflags=["-O3", f"-DSHM_HEADERS={_headers_digest()}"],
                                         verbose=False)
        except Exception as exc:  # noqa: BLE001 - a compiler's error, made into one that says what failed
            raise BuildError(f"building the shm backend's C++ bridge ({SOURCE}) failed in {build_dir}: {exc}") from exc
        return _module
