"""The suites' tensors are CPU tensors: their ranks use Gloo unless a test names a backend.

Without this, a world of one on a machine with a GPU would pick NCCL (collectives.env.pick_backend)
and every CPU tensor would be refused there. Set COLLECTIVES_BACKEND (or, for the harness alone,
COLLECTIVES_TEST_BACKEND=shm) to run the suites on another backend.
"""

import os

os.environ.setdefault("COLLECTIVES_BACKEND", "gloo")


def pytest_sessionstart(session):
    """Build the shm backend's C++ bridge once, before any rank needs it (about 40 s on a fresh
    machine, then cached): ranks that create shm groups would otherwise each wait for it."""
    from collectives.shm import native

    native.load()
