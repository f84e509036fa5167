"""A pytest harness for multi-process code: test bodies run on N ranks kept alive across tests.

Spawning ranks costs ~3 s (importing torch); this harness spawns a pool of ranks once per
(world_size, backend) and sends each test body to it, so a multi-rank test case costs
milliseconds. After a rank dies or hangs, or when the ranks are no longer in step on the world's
group, the pool is torn down and the next test gets a fresh one, so one bad test cannot poison
the next; a test that failed with every rank answering (an assert, an exception) keeps the
ranks (on Gloo and NCCL, whose sequence numbers tell; shm's pool is rebuilt), so hypothesis can
shrink a failing example on them quickly.

    from collectives.testing import distributed

    @distributed(world_size=3)
    def test_sum(env):                       # runs on ranks 0, 1, 2; env is the rank's DistEnv
        t = torch.tensor([env.rank + 1.0])
        collectives.all_reduce(t)
        assert t.item() == 6

    @pytest.mark.parametrize("n", [1, 5])
    @distributed(world_size=2, timeout=30)
    def test_param(env, n): ...               # pytest parameters reach every rank

A failing rank's traceback appears in the pytest failure, named by rank, with the harness's own
frames left out; the ranks import test modules with pytest's assertion rewriting, so a failed
`assert a == b` on a rank shows the values, as it would in pytest's own process. A hang past
`timeout` shows every rank's Python stack. The test module must be importable by the ranks (a normal test
file is). Two ways, one rule: `@distributed` when the test's own body runs on the ranks (its
asserts, there); `run_on_ranks` when the test process checks what a module-level function
returned on each rank (results in rank order, compared across ranks or with one-rank runs):

    def test_x():
        assert run_on_ranks(my_fn, 2, args=(3,)) == [..., ...]

The `dist_run` fixture is run_on_ranks under its old name, kept for code written against it.
"""

from __future__ import annotations

import ast
import atexit
import fnmatch
import functools
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import inspect
import marshal
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import pytest

from .launcher.call_checks import check_call
from .launcher.pool import RankPool
from .launcher.start_methods import TRAINING, preload
from .output_files import write_output

DEFAULT_TIMEOUT_S = 60.0
TEST_FILES = ("test_*.py", "*_test.py", "conftest.py")  # pytest's default python_files, and conftest
# What test modules import besides torch: a rank imports the test module to find its test, and a
# suite starts many ranks (a pool whose test failed starts afresh), so the fork server imports
# these once for them all. What they read of the environment at import (hypothesis: CI, its own
# HYPOTHESIS_* variables) is then the server's; no rank uses it, as hypothesis draws its examples
# in the pytest process.
TEST_IMPORTS = ("pytest", "hypothesis")
_pools: Dict[Tuple[int, Optional[str]], RankPool] = {}


# On a pool's rank: the module whose groups are kept, and what kept_groups made for it
_kept: Dict[str, Any] = {"module": None, "made": {}, "groups": []}


def kept_groups(key, make: Callable[[], Any]):
    """In a test body on pooled ranks: what `make()` returns (a group, or groups in a dict or
    list), made by the first of this module's tests to ask for `key` and handed to its later
    tests on the same ranks; the groups it made live until a test of another module runs on these
    ranks. Every other group a test makes is destroyed when it returns. Every rank must ask for the
    same keys in the same order, as new_group asks.

        groups = kept_groups(("native", queued), lambda: {p: new_group_with({...}) for p in PATHS})
    """
    import torch.distributed as dist

    if key not in _kept["made"]:
        before = set(dist.distributed_c10d._world.pg_map)
        _kept["made"][key] = make()
        _kept["groups"] += [g for g in dist.distributed_c10d._world.pg_map if g not in before]
    return _kept["made"][key]


# On a pool's rank: the groups the last body made, destroyed as the next body starts, and when
_left: Dict[str, Any] = {"groups": [], "destroyed_at": None}


class _LeavesNoGroups:
    """A test body whose rank destroys every process group the body before it made (a test's
    subgroups, a DeviceMesh's, a pipeline's stages') as it starts, but those made through
    kept_groups, which go when a body of another module comes. Each Gloo group keeps a thread that
    wakes a hundred times a second: a pool's ranks kept every group of every test before them, 30
    or more each late in a suite, and their wake-ups took a fifth of a core. A body that raises
    keeps its groups: a peer may still be inside a collective on them.

    As the next body starts, not as this one returns: a pool submits a body only once every rank
    has returned the one before, so no peer is still inside the groups' set-up then. A rank that
    destroyed its groups on returning closed its Gloo connections while a slower peer could still
    be reading their handshake ("connectFullMesh ... Connection closed by peer", 4 ranks on 2 busy
    cores)."""

    def __init__(self, fn: Callable):
        self.fn = fn
        self.module = getattr(fn, "module", None) or getattr(fn, "__module__", None)

    def __call__(self, env, *args):
        import torch.distributed as dist

        world = dist.distributed_c10d._world
        left, _left["groups"] = [g for g in _left["groups"] if g in world.pg_map], []
        if left:
            _destroy(left)
            _left["destroyed_at"] = time.monotonic()
            del left  # the last references: the groups go now, not after the body
        if self.module != _kept["module"]:
            _destroy([g for g in _kept["groups"] if g in world.pg_map])
            _kept.update(module=self.module, made={}, groups=[])
        before = set(world.pg_map)
        result = self.fn(env, *args)
        kept = set(_kept["groups"])
        _left["groups"] = [g for g in world.pg_map if g not in before and g is not world.default_pg and g not in kept]
        return result


def _destroy(groups) -> None:
    import torch.distributed as dist

    for group in groups:
        dist.destroy_process_group(group)
    if groups and "torch.distributed.tensor" in sys.modules:
        # DTensor keeps its plans by mesh, and an equal mesh of a later test would find the
        # destroyed group's name in them
        import torch.distributed.tensor.debug as dtensor_debug

        dtensor_debug._clear_sharding_prop_cache()


class _TestPool(RankPool):
    """The harness's pools: a call leaves the ranks with the groups they had before it."""

    def submit(self, fn: Callable, args: Sequence[Any] = (), timeout: float = 60.0, name: Optional[str] = None):
        __tracebackhide__ = True
        check_call(fn, args, timeout)
        return super().submit(_LeavesNoGroups(fn), args, timeout, name or getattr(fn, "__qualname__", repr(fn)))


class _AssertRewritingLoader(importlib.machinery.SourceFileLoader):
    """Compiles a test module with pytest's assertion rewriting, never from Python's own .pyc
    (which holds the plain asserts).

    The rewritten code is read from, and written to, pytest's own cache beside it
    (`__pycache__/<name>.cpython-311-pytest-<version>.pyc`, checked against the source's mtime and
    size as pytest checks it): the pytest process that collected the module has usually written
    it already. Every rank of every pool imports the test modules it runs, so parsing and
    rewriting them each time cost a tenth of the quick tier's CPU on 2 cores."""

    def get_code(self, fullname):
        cached = _rewritten_from_cache(self.path)
        if cached is not None:
            return cached
        stat = os.stat(self.path)  # before the read, as pytest does: a file edited meanwhile is not cached as new
        source = self.get_data(self.path)
        from _pytest.assertion.rewrite import rewrite_asserts

        tree = ast.parse(source, filename=self.path)
        rewrite_asserts(tree, source, self.path)
        code = compile(tree, self.path, "exec", dont_inherit=True)
        _cache_rewritten(self.path, stat, code)
        return code


def _pytest_pyc(path: str):
    """pytest's cache file for the rewritten test module at `path`, or None where this pytest
    keeps it elsewhere (its private layout: then every import rewrites, as before)."""
    try:
        from _pytest.assertion.rewrite import PYC_TAIL, get_cache_dir
    except ImportError:
        return None
    source = Path(path)
    return get_cache_dir(source) / (source.name[:-3] + PYC_TAIL)


def _pyc_header(stat: os.stat_result) -> bytes:
    """A timestamp .pyc's header (PEP 552), as pytest writes its own: the magic number, no flags,
    and the source's mtime and size, by which a reader tells a stale file."""
    return (importlib.util.MAGIC_NUMBER + bytes(4) + (int(stat.st_mtime) & 0xFFFFFFFF).to_bytes(4, "little")
            + (stat.st_size & 0xFFFFFFFF).to_bytes(4, "little"))


def _rewritten_from_cache(path: str):
    pyc = _pytest_pyc(path)
    if pyc is None:
        return None
    try:
        stat = os.stat(path)
        with open(pyc, "rb") as f:
            data = f.read()
    except OSError:
        return None
    if data[:16] != _pyc_header(stat):
        return None
    try:
        return marshal.loads(data[16:])
    except (EOFError, ValueError, TypeError):
        return None


def _cache_rewritten(path: str, stat: os.stat_result, code) -> None:
    """Write the cache as pytest does, whole or not at all (write_output: a file of this process's
    own, renamed over the cache), so a rank that reads it never sees half a file."""
    pyc = _pytest_pyc(path)
    if pyc is None or sys.dont_write_bytecode:
        return
    try:
        os.makedirs(pyc.parent, exist_ok=True)
        write_output(str(pyc), _pyc_header(stat) + marshal.dumps(code))
    except OSError:  # a read-only tree (OutputError is one): the next import rewrites again
        pass


class _AssertRewritingFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or not spec.origin or not any(fnmatch.fnmatch(os.path.basename(spec.origin), p) for p in TEST_FILES):
            return None
        spec.loader = _AssertRewritingLoader(name, spec.origin)
        return spec


def install_assert_rewriting() -> None:
    """In a rank: import test modules as pytest does, so a failed assert shows its values."""
    sys.meta_path.insert(0, _AssertRewritingFinder())


def get_pool(world_size: int, backend: Optional[str] = None) -> RankPool:
    """The shared pool for (world_size, backend); started on first use, closed at exit.

    backend None: COLLECTIVES_TEST_BACKEND if set (run a suite on another backend:
    `COLLECTIVES_TEST_BACKEND=shm pytest tests/collectives`), else the default choice.
    """
    backend = backend or os.environ.get("COLLECTIVES_TEST_BACKEND") or None
    key = (world_size, backend)
    if key not in _pools:
        # tests that train (an optimizer, torch's DDP) then find torch._dynamo imported in every rank,
        # and every rank finds what test modules import, which it imports to find the test
        preload(*TRAINING, *(m for m in TEST_IMPORTS if m in sys.modules))
        _pools[key] = _TestPool(world_size, backend=backend, setup=install_assert_rewriting)
    return _pools[key]


@atexit.register
def close_pools() -> None:
    for pool in _pools.values():
        pool.close()
    _pools.clear()


def run_on_ranks(
    fn: Callable, world_size: int = 2, args: Sequence[Any] = (), *, backend: Optional[str] = None,
    timeout: float = DEFAULT_TIMEOUT_S,
) -> List[Any]:
    """Run module-level `fn(env, *args)` on the shared pool's ranks; results in rank order."""
    __tracebackhide__ = True
    return get_pool(world_size, backend).submit(fn, args=args, timeout=timeout)


class _TestBody:
    """A picklable reference to a decorated test's body: the ranks import the module and unwrap it."""

    def __init__(self, module: str, qualname: str):
        self.module, self.qualname = module, qualname

    def __call__(self, env, kwargs: Dict[str, Any]):
        obj: Any = importlib.import_module(self.module)
        for part in self.qualname.split("."):
            obj = getattr(obj, part)
        return _body_of(obj)(env, **kwargs)


def _body_of(obj: Any) -> Callable:
    """The @distributed body under whatever decorates the test above it (hypothesis's @given
    wraps it in a function of its own, which the ranks must not run: the test process draws)."""
    for _ in range(32):
        if hasattr(obj, "_collectives_body"):
            return obj._collectives_body
        inner = getattr(getattr(obj, "hypothesis", None), "inner_test", None) or getattr(obj, "__wrapped__", None)
        if inner is None:
            break
        obj = inner
    return obj


def distributed(world_size: int = 2, *, backend: Optional[str] = None, timeout: float = DEFAULT_TIMEOUT_S):
    """Decorate `def test_x(env, ...)` to run its body on `world_size` pooled ranks.

    Args:
        world_size: ranks to run the body on.
        backend: "gloo", "nccl", "shm" or None (NCCL only with one GPU per rank, else Gloo).
        timeout: seconds before every rank's stack is dumped and the test fails.
    """

    def decorate(fn: Callable) -> Callable:
        params = list(inspect.signature(fn).parameters.values())
        if not params:
            raise TypeError(f"{fn.__qualname__}: a @distributed test takes the rank's env as its first argument")

        signature = inspect.Signature(params[1:])

        @functools.wraps(fn)
        def test(*args, **kwargs):
            __tracebackhide__ = True  # pytest shows the ranks' report, not this wrapper
            # by name, however the caller passed them (pytest by keyword; hypothesis's @given by position)
            kwargs = dict(signature.bind(*args, **kwargs).arguments)
            get_pool(world_size, backend).submit(
                _TestBody(fn.__module__, fn.__qualname__), args=(kwargs,), timeout=timeout,
                name=f"{fn.__qualname__}({', '.join(f'{k}={v!r}' for k, v in kwargs.items())}) on {world_size} ranks"
                if kwargs else f"{fn.__qualname__} on {world_size} ranks",
            )

        # pytest must see the test's own parameters, without `env` (which each rank supplies).
        test.__signature__ = signature
        test._collectives_body = fn
        return test

    return decorate


@pytest.fixture
def dist_run() -> Callable[..., List[Any]]:
    """run_on_ranks under its old name (a fixture), with a FutureWarning that names it."""
    import warnings

    warnings.warn("the dist_run fixture is collectives.testing.run_on_ranks: import and call that",
                  FutureWarning, stacklevel=2)
    return run_on_ranks
