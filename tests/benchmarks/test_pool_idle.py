"""The pool-idle study reads the threads of pytest's descendants after the tests: a pool of two
ranks holds one Gloo thread each (the world's group), which wakes while the ranks wait.

    pytest tests/benchmarks/test_pool_idle.py -q
"""

import os
import subprocess
import sys

import pytest

SESSION = """
import torch.distributed as dist
from collectives.testing import run_on_ranks

def _world_size(env):
    return dist.get_world_size()

def test_on_two_pooled_ranks():
    assert run_on_ranks(_world_size, 2) == [2, 2]
"""


@pytest.mark.slow  # a fresh interpreter, and a pool of its own
def test_after_the_tests_each_pooled_rank_holds_one_waking_gloo_thread(tmp_path):
    (tmp_path / "test_session.py").write_text(SESSION)
    out = subprocess.run([sys.executable, "-m", "benchmarks.studies.pool_idle", "--seconds", "1", "--", "-q",
                          "-p", "no:cacheprovider", str(tmp_path / "test_session.py")],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path,
                         env={**os.environ, "COLLECTIVES_BACKEND": "gloo"})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    table = out.stdout.split("after its last test (exit 0):")[1].splitlines()
    rows = {line.split()[-1]: line.split() for line in table[2:] if line.strip()}
    threads, _, woke, _ = rows["gloo_tcp_loop"]
    assert threads == "2", out.stdout[-2000:]  # the ranks are the fork server's children: pytest's grandchildren
    assert int(woke) >= 50, out.stdout[-2000:]  # about 100 a second each
