"""Our DDPs and sharded steps on CUDA tensors, bitwise against torch's: NCCL at world size 1, and
Gloo with CUDA tensors for 2 ranks on one GPU (one GPU cannot host two NCCL ranks). Skipped with a
reason without a GPU; `bash benchmarks/gpu_checks.sh tests` runs it on a machine with a GPU.

    pytest tests/ddp/test_gpu_ddp.py -q -rs
"""

from functools import partial

import pytest
import torch

import collectives as C
from ddp_from_scratch.compare import train_side_by_side
from ddp_from_scratch.compare.sharded import train_sharded_side_by_side
from ddp_from_scratch.wrap import SHARDED, WRAPPERS
from ddp_from_scratch.steps.zero2 import ZeroTwoDataParallel

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")

STEPS = 2


CASES = [(impl, "torch") for impl in WRAPPERS] + [
    (impl, against) for impl in SHARDED if impl != "zero2-bucketed" for against in ("torch", "torch-fsdp")] + [
    ("zero2-bucketed", "torch")]


def _body(env, impl, against):
    torch.cuda.reset_peak_memory_stats()
    if impl in WRAPPERS:
        report = train_side_by_side(env, impl, STEPS, device="cuda:0")
    elif impl == "zero2-bucketed":  # a bucket per parameter of the small CNN
        ctor = partial(ZeroTwoDataParallel, bucket_cap_mb=1e-9, broadcast_buffers=True)
        report = train_sharded_side_by_side(env, ctor, STEPS, against=against, device="cuda:0")
    else:
        report = train_sharded_side_by_side(env, impl, STEPS, against=against, device="cuda:0")
    # the models really were on the GPU: a device argument ignored would train on the CPU
    return [s.bitwise for s in report], torch.cuda.max_memory_allocated() > 0


# one spawn per case (a crash in one must not hide the others); the GPU machine starts ranks fast
@needs_gpu
@pytest.mark.parametrize("impl, against", CASES)
def test_ours_bitwise_torch_on_cuda_gloo_two_ranks_one_gpu(impl, against):
    assert C.run(_body, world_size=2, backend="gloo", args=(impl, against)) == [([True] * STEPS, True)] * 2


@needs_gpu
@pytest.mark.parametrize("impl, against", CASES)
def test_ours_bitwise_torch_on_nccl_world_size_1(impl, against):
    assert C.run(_body, world_size=1, backend="nccl", args=(impl, against)) == [([True] * STEPS, True)]
