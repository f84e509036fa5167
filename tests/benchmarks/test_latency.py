"""Small-message latency, wrappers against raw torch.distributed, with pytest-benchmark.

    pytest tests/benchmarks/test_latency.py --benchmark-enable

One rank pool (2 ranks) serves every case. Each round sends the ranks a batch of calls; inside
the ranks every call is timed and the slowest rank's median per call goes into the report's
extra_info (`in_rank_us`), so the pipe to the ranks does not count. pytest-benchmark's own
columns time the whole batch of CALLS calls. In the normal test run (benchmarks disabled in
pyproject's addopts) each case runs once as a smoke test.
"""

import statistics
import time

import pytest
import torch
import torch.distributed as dist

import collectives
from collectives.testing import run_on_ranks

CALLS = 500


def _batch(env, variant, nbytes, calls):
    t = torch.ones(max(1, nbytes // 4))
    call = {"raw": lambda: dist.all_reduce(t), "wrapper": lambda: collectives.all_reduce(t)}[variant]
    times = torch.zeros(calls, dtype=torch.float64)
    for i in range(calls):
        t.fill_(env.rank + 1.0)  # outside the timed region
        start = time.perf_counter()
        call()
        times[i] = time.perf_counter() - start
    assert t[0].item() == env.world_size * (env.world_size + 1) / 2  # the sum really happened
    dist.all_reduce(times, op=dist.ReduceOp.MAX)  # the slowest rank, call by call
    return statistics.median(times.tolist()) * 1e6


@pytest.mark.parametrize("nbytes", [4, 1024])
@pytest.mark.parametrize("variant", ["raw", "wrapper"])
def test_all_reduce_latency(benchmark, variant, nbytes):
    in_rank = []
    benchmark.pedantic(lambda: in_rank.append(run_on_ranks(_batch, 2, args=(variant, nbytes, CALLS))[0]),
                       rounds=5, iterations=1, warmup_rounds=1)
    benchmark.extra_info["in_rank_us"] = statistics.median(in_rank)
    benchmark.extra_info["calls_per_round"] = CALLS
    assert 0 < statistics.median(in_rank) < 1e5
