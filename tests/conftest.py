"""The suites' tensors are CPU tensors: their ranks use Gloo unless a test names a backend.

Without this, a world of one on a machine with a GPU would pick NCCL (collectives.launcher.env.pick_backend)
and every CPU tensor would be refused there. Set COLLECTIVES_BACKEND (or, for the harness alone,
COLLECTIVES_TEST_BACKEND=shm) to run the suites on another backend.

The `slow` mark (pyproject.toml) names the tests that a quick run, `pytest -m "not slow"`, leaves
out: the test hosts' tests (tests/multinode, marked in its conftest.py) and the cases that each
take seconds on 2 cores: a program, or ranks, started as fresh interpreters (each imports torch,
about 3 s of CPU; a forked rank of the pools does not), ResNet-50, 8 ranks, and property tests
that train at every example. The quick run keeps a case of each behaviour: the fork server's
variant of a launcher test, the small models' parity.
"""

import os
import sys
import threading

import pytest

os.environ.setdefault("COLLECTIVES_BACKEND", "gloo")
# The suite starts hundreds of Python processes (workers, ranks, the programs under test). Where
# PYTHONDONTWRITEBYTECODE is set, each compiled the project's modules from source again: about
# 0.3 s of CPU for a process that imports the training and the backends. The suite keeps the
# compiled files, as Python does by default (in __pycache__, which git ignores).
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False

HERE = os.path.dirname(os.path.abspath(__file__))
HOSTS_TESTS = os.path.join(HERE, "multinode") + os.sep
# Modules that never start an shm group, so never need the shm bridge: under pytest-xdist they run
# right after the test hosts' tests, on the worker that would otherwise wait for the bridge's
# build, and they do not wait for it. They start few processes, or mostly wait (planted hangs'
# timeouts), which leaves a core to the build. The launcher's tests are not here: they start
# ranks and launchers by the dozen, and fresh interpreters beside the build cost more CPU than the
# wait they would save. A module named here that came to use shm would still pass: its ranks would
# wait for the build themselves (torch's build lock).
WITHOUT_BRIDGE = tuple(os.path.join(HERE, name) for name in (
    "algorithms/test_fit.py", "algorithms/test_simulated.py", "algorithms/test_topology.py",
    "algorithms/test_token_bucket.py", "algorithms/test_post_order.py",
    "collectives/test_plain_mode_table.py",
))
# More of them, whose ranks train on Gloo pools: they go first too when no test hosts' tests run
# (the quick run), where both workers otherwise waited 26-41 s for the build from a fresh clone,
# a core idle. In a run with the test hosts, one worker starts on those, and training beside them
# and the build slowed the hosts' tests more than the wait it saved (one run: 931.5 s against
# 791.3-858.5 s).
WITHOUT_BRIDGE_WHEN_NO_HOSTS = tuple(os.path.join(HERE, name) for name in (
    "algorithms/test_on_ranks.py", "ddp/test_zero.py", "ddp/test_parity.py", "ddp/test_transformer_runs.py",
    "ddp/test_transformer_checkpoint.py", "tensor_parallel/test_train_tp.py", "pipeline_parallel/test_train_pp.py",
    "context_parallel/test_train_cp.py", "expert_parallel/test_train_ep.py",
))
_build = {}


def _load_bridge():
    from collectives.shm import native

    try:
        native.load()
    except Exception as exc:  # noqa: BLE001 - the first test that needs it says so again, with the reason
        _build["error"] = exc


def pytest_sessionstart(session):
    """Start building the shm backend's C++ bridge (under a minute on a fresh machine, then
    cached) while the first tests run: the test hosts' tests, which go first, never need it. Under
    pytest-xdist the controller builds and the workers wait for it (torch's build lock) before
    their first test that is not a test hosts' one."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return
    _build["thread"] = threading.Thread(target=_load_bridge, name="shm-bridge-build", daemon=True)
    _build["thread"].start()


def pytest_configure(config):
    """Every process of the run (under pytest-xdist, each worker) has its fork server import what
    an optimizer or torch's DDP imports, before any test starts one: many tests' ranks train, and
    whichever test started the server first would otherwise decide for the whole run."""
    from collectives.launcher.start_methods import TRAINING, preload

    preload(*TRAINING)


@pytest.hookimpl(trylast=True)  # after `-m` has deselected what will not run
def pytest_collection_modifyitems(config, items):
    """The modules in WITHOUT_BRIDGE go first after the test hosts' tests (which
    tests/multinode/conftest.py puts first); with no test hosts' tests to run, those in
    WITHOUT_BRIDGE_WHEN_NO_HOSTS too."""
    hosts = [item for item in items if str(item.path).startswith(HOSTS_TESTS)]
    first = WITHOUT_BRIDGE if hosts else WITHOUT_BRIDGE + WITHOUT_BRIDGE_WHEN_NO_HOSTS
    early = [item for item in items if str(item.path) in first]
    placed = {id(item) for item in hosts + early}
    items[:] = hosts + early + [item for item in items if id(item) not in placed]


def pytest_runtest_setup(item):
    """Before a test that may use the shm backend: the bridge is built, so that ranks starting shm
    groups never wait for it inside a test's timeout."""
    path = str(item.path)
    if path.startswith(HOSTS_TESTS) or path in WITHOUT_BRIDGE + WITHOUT_BRIDGE_WHEN_NO_HOSTS or _build.get("ready"):
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


@pytest.fixture(scope="session")
def warm_python():
    """One warm interpreter per pytest process (tests/warm_python.py), started when a test first
    asks: `warm_python.run(["file.py"], cwd=folder)` is `python file.py` without importing torch again."""
    from .warm_python import WarmPython

    with WarmPython() as warm:
        yield warm
