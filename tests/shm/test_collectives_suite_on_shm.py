"""The wrappers' correctness suite run again with shm as the backend of every pool: the test
cases of tests/collectives (ops, properties, views, gap filling, groups, errors, the harness)
collected here a second time, each run on shm's pooled ranks (COLLECTIVES_TEST_BACKEND=shm for
this module). Under pytest-xdist they spread over the workers like any other module's.

    pytest tests/shm/test_collectives_suite_on_shm.py -q
    COLLECTIVES_TEST_BACKEND=shm pytest tests/collectives -q      # the same, one module at a time
"""

import importlib
import os

import pytest

MODULES = ("test_ops", "test_properties", "test_views", "test_gap_filling", "test_groups", "test_errors", "test_harness")

pytestmark = pytest.mark.slow  # the suite itself runs in the quick tier on the default backend


def _collect_here(modules):
    """Every test function of `modules`, bound here under its own name (pytest collects what a
    module's namespace holds); a name two of them share would hide one, so it is refused."""
    found = {}
    for name in modules:
        module = importlib.import_module(f"tests.collectives.{name}")
        for attr, value in vars(module).items():
            if attr.startswith("test") and callable(value):
                if attr in found:
                    raise RuntimeError(f"{attr} is in both {found[attr].__module__} and {module.__name__}: rename one")
                found[attr] = value
    return found


TESTS = _collect_here(MODULES)
globals().update(TESTS)


@pytest.fixture(autouse=True, scope="module")
def _on_shm():
    """Every pool a test here asks for without naming a backend is an shm pool (collectives.testing.get_pool)."""
    with pytest.MonkeyPatch.context() as patch:  # monkeypatch itself is per test; this lasts the module
        patch.setenv("COLLECTIVES_TEST_BACKEND", "shm")
        yield


def test_every_test_of_the_suite_is_collected_here():
    """A test added to one of the modules comes here by itself; one the loop above missed fails."""
    import re

    here = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "collectives")
    defined = {m.group(1) for name in MODULES
               for m in re.finditer(r"^def (test\w*)\(", open(os.path.join(here, f"{name}.py")).read(), re.M)}
    assert defined and defined <= set(TESTS), sorted(defined - set(TESTS))


def _backend(env):
    import torch.distributed as dist

    return dist.get_backend()


def test_the_pools_here_are_shm():
    from collectives.testing import run_on_ranks

    assert run_on_ranks(_backend, 2) == ["shm", "shm"]
