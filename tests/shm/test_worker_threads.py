"""A call queued for a group's worker thread runs as the thread that issued it would: with the
rank's intra-op thread count (torch.set_num_threads). A thread the backend makes starts with
OpenMP's default, every core; a Future's callback run there (torch's PowerSGD hook multiplies its
matrices in one) then split a product over 2 threads where the rank asked for 1, and left other
bits than the same product on the rank's own thread: ResNet-50's PowerSGD was no longer bit for
bit torch's hook (tests/ddp/test_powersgd.py has that run in the slow tier).

    pytest tests/shm/test_worker_threads.py -q
"""

from __future__ import annotations

import ctypes
import threading
import time

import pytest
import torch
import torch.distributed as dist

from collectives.shm import new_group_with

from . import PATHS
from collectives.testing import run_on_ranks


def _openmp_threads() -> int:
    """This thread's OpenMP thread count (omp_get_max_threads: per thread, unlike torch.get_num_threads)."""
    library = next(line.split()[-1] for line in open("/proc/self/maps") if "libgomp" in line)
    return ctypes.CDLL(library).omp_get_max_threads()


def _callback_threads(env, path):
    group = new_group_with({"COLLECTIVES_SHM_PATH": path})
    seen = []
    for threads in (1, 2, 1):
        torch.set_num_threads(threads)
        work = dist.all_reduce(torch.ones(1 << 18), group=group, async_op=True)  # 1 MiB: queued, not inline
        fut = work.get_future().then(lambda f: (seen.append((threads, _openmp_threads(),
                                                             threading.current_thread() is threading.main_thread())),
                                                f.value())[1])
        time.sleep(0.05)  # the worker takes it (a caller that waits at once runs it itself)
        fut.wait()
    torch.set_num_threads(1)
    return seen


@pytest.mark.parametrize("path", PATHS)
def test_a_queued_calls_callback_runs_with_the_issuers_thread_count(path):
    if not any("libgomp" in line for line in open("/proc/self/maps")):
        pytest.skip("this torch does not use GNU OpenMP")
    for rank, seen in enumerate(run_on_ranks(_callback_threads, 2, args=(path,), timeout=120)):
        assert [(asked, got) for asked, got, _ in seen] == [(1, 1), (2, 2), (1, 1)], (rank, path, seen)
        assert not all(on_main for _, _, on_main in seen), (rank, path, "every callback ran on the rank's own thread")
