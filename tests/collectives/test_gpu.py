"""CUDA paths: NCCL at world size 1, and Gloo with CUDA tensors for 2 ranks on one GPU (one GPU
cannot host two NCCL ranks: "Duplicate GPU detected"). Skipped with a reason without a GPU.

    pytest tests/collectives/test_gpu.py -q -rs
"""

import pytest
import torch

import collectives as C

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")


def _nccl_body(env):
    assert env.backend == "nccl" and env.device.type == "cuda"
    out = {}
    t = torch.full((4,), 2.0, device=env.device)
    out["all_reduce"] = C.all_reduce(t, op="avg").tolist()
    out["band"] = C.all_reduce(torch.full((2,), 6, dtype=torch.int32, device=env.device), op="band").tolist()
    out["all_gather"] = C.all_gather(torch.arange(3.0, device=env.device)).tolist()
    out["reduce_scatter"] = C.reduce_scatter(torch.arange(2.0, device=env.device)).tolist()
    try:
        C.all_reduce(torch.ones(2))
    except C.CollectiveError as exc:
        out["cpu_error"] = str(exc)
    return out


@needs_gpu
def test_nccl_world_size_1():
    (out,) = C.run(_nccl_body, world_size=1, backend="nccl")
    assert out["all_reduce"] == [2.0] * 4 and out["band"] == [6, 6]
    assert out["all_gather"] == [0.0, 1.0, 2.0] and out["reduce_scatter"] == [0.0, 1.0]
    assert "needs CUDA tensors" in out["cpu_error"]


def _gloo_cuda_body(env):
    dev = torch.device("cuda", 0)
    r = env.rank
    out = {}
    out["all_reduce"] = C.all_reduce(torch.full((3,), r + 1.0, device=dev)).cpu().tolist()
    out["broadcast"] = C.broadcast(torch.full((2,), float(r), device=dev), src=1).cpu().tolist()
    g = C.all_gather(torch.full((r + 1,), float(r), device=dev))
    out["all_gather"] = (g.device.type, g.cpu().tolist())
    out["reduce_scatter"] = C.reduce_scatter(torch.arange(4.0, device=dev)).cpu().tolist()
    out["all_to_all"] = C.all_to_all(torch.arange(2.0, device=dev) + 10 * r).cpu().tolist()
    return out


@needs_gpu
def test_gloo_with_cuda_tensors_two_ranks_one_gpu():
    outs = C.run(_gloo_cuda_body, world_size=2, backend="gloo")
    for r, out in enumerate(outs):
        assert out["all_reduce"] == [3.0] * 3 and out["broadcast"] == [1.0, 1.0]
        assert out["all_gather"] == ("cuda", [0.0, 1.0, 1.0])
        assert out["reduce_scatter"] == [2 * (2 * r), 2 * (2 * r + 1)]
        assert out["all_to_all"] == [float(r), 10.0 + r]
