"""The suites' tensors are CPU tensors: their ranks use Gloo unless a test names a backend.

Without this, a world of one on a machine with a GPU would pick NCCL (collectives.launcher.env.pick_backend)
and every CPU tensor would be refused there. Set COLLECTIVES_BACKEND (or, for the harness alone,
COLLECTIVES_TEST_BACKEND=shm) to run the suites on another backend.

The `slow` mark (pyproject.toml) names the tests that a quick run, `pytest -m "not slow"`, leaves
out: the test hosts' tests (tests/multinode, marked in its conftest.py) and the cases that each
take seconds.
"""

import os
import threading

os.environ.setdefault("COLLECTIVES_BACKEND", "gloo")

HOSTS_TESTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "multinode") + os.sep
_build = {}


def _load_bridge():
    from collectives.shm import native

    try:
        native.load()
    except Exception as exc:  # noqa: BLE001 - the first test that needs it says so again, with the reason
        _build["error"] = exc


def pytest_sessionstart(session):
    """Start building the shm backend's C++ bridge (about 20 s of one core on a fresh machine, then
    cached) while the first tests run: the test hosts' tests, which go first, never need it. Under
    pytest-xdist the controller builds and the workers wait for it (torch's build lock) before
    their first test that is not a test hosts' one."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return
    _build["thread"] = threading.Thread(target=_load_bridge, name="shm-bridge-build", daemon=True)
    _build["thread"].start()


def pytest_runtest_setup(item):
    """Before a test that may use the shm backend: the bridge is built, so that ranks starting shm
    groups never wait for it inside a test's timeout."""
    if str(item.path).startswith(HOSTS_TESTS) or _build.get("ready"):
        return
    if "thread" in _build:
        _build["thread"].join()
    else:
        _load_bridge()
    _build["ready"] = True


def pytest_sessionfinish(session):
    """Never leave a build half done (torch's build lock would then stay behind in the cache)."""
    if "thread" in _build:
        _build["thread"].join()

