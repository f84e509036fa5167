"""Make a rank forked from the fork server start as a spawned rank would: run by path, first thing
in the rank, before multiprocessing imports the launcher's main module or this package.

    runpy.run_path(".../collectives/launcher/as_spawned.py", {"environ": {...}, "std_fds": [DupFd, DupFd]})

A spawned rank is a fresh interpreter exec'd by the launcher as the launcher is at that moment:
its environment, its stdout and stderr. A fork of the fork server (start_methods.rank_context) has the
server's instead, from when the server started: a variable set since (monkeypatch.setenv,
os.environ[...] = ... before collectives.run) would be missing where a module reads it at import,
and output would go where the launcher's output went back then (pytest captures per test).
The launcher puts `Start(environ)` first in multiprocessing's preparation data, which the rank
unpickles before anything else; unpickling runs this file with the launcher's environment and
its stdout and stderr as descriptors, and this file puts them in place. No random state or cached
temporary folder is shared by the forks: the server imports torch, and for a program whose ranks
train torch._dynamo too (start_methods.preload), which imports numpy; numpy's global random
state is drawn again from the OS here and tempfile's folder looked up again on first use, as in a
fresh interpreter (Python's own random module reseeds itself in a fork).
tests/collectives/test_launch.py checks both, in a suite whose server has the preload.

Stdlib only, so that running it imports nothing that reads the environment too early.
"""

import os
import sys

if os.environ != environ:  # noqa: F821 - given by the caller (runpy's init_globals)
    os.environ.clear()
    os.environ.update(environ)  # noqa: F821
for _target, _fd in zip((1, 2), (fd.detach() for fd in std_fds)):  # noqa: F821
    if _fd != _target:
        os.dup2(_fd, _target)
        os.close(_fd)
if "numpy" in sys.modules:
    sys.modules["numpy"].random.seed()  # no seed: from the OS, as a fresh interpreter's
if "tempfile" in sys.modules:
    sys.modules["tempfile"].tempdir = None
