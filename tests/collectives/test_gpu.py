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


def _algorithms_on_cuda_body(env):
    import collectives.algorithms as A
    from benchmarks.parts import limits

    dev = torch.device("cuda", 0)
    r, n = env.rank, env.world_size
    out = {}
    for name in A.ALGORITHMS["all_reduce"]:
        t = torch.arange(7.0, device=dev) + 100 * r
        out[name] = A.all_reduce(t, op="sum", algorithm=name).cpu().tolist()
    g = A.all_gather(torch.full((3,), float(r), device=dev), algorithm="ring")
    out["all_gather"] = (g.device.type, g.cpu().tolist())
    found = limits.measure(dev, n, nbytes=1 << 20)
    out["p2p_gbps"] = found["p2p_gbps"]
    return out


@needs_gpu
def test_from_scratch_algorithms_with_cuda_tensors_on_gloo_stage_through_host():
    # Gloo's send/recv refuse CUDA tensors ("writev: Bad address"): DistComm and the
    # point-to-point limit stage them through host memory, as Gloo's collectives do.
    outs = C.run(_algorithms_on_cuda_body, world_size=2, backend="gloo")
    want = (torch.arange(7.0) * 2 + 100).tolist()
    for out in outs:
        for name in ("ring", "recursive_doubling", "rabenseifner", "binomial", "double_binary_tree"):
            assert out[name] == want, (name, out[name])
        assert out["all_gather"] == ("cuda", [0.0] * 3 + [1.0] * 3)
        assert out["p2p_gbps"] > 0
