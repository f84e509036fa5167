"""benchmarks/shm.py: the floor it measures DDP against really moves nothing, and the report
names every DDP variant with its ratio to Gloo.

    pytest tests/benchmarks/test_shm_benchmark.py
"""

import argparse

import pytest
import torch
import torch.distributed as dist

from benchmarks import shm as bench
from benchmarks.studies import shm_paths as paths_bench
from collectives.testing import run_on_ranks


def _free_group(env):
    group = bench.free_all_reduce_group()
    summed = torch.full((3,), float(env.rank + 1))
    dist.all_reduce(summed, group=group)
    sent = torch.full((2,), float(env.rank + 1))
    dist.broadcast(sent, src=0, group=group)
    return summed.tolist(), sent.tolist()


def test_the_free_group_moves_nothing_in_all_reduce_and_the_rest_still_works():
    for rank, (summed, sent) in enumerate(run_on_ranks(_free_group, 2)):
        assert summed == [float(rank + 1)] * 3, f"rank {rank}: all_reduce changed the tensor: {summed}"
        assert sent == [1.0, 1.0], f"rank {rank}: broadcast from rank 0 did not arrive: {sent}"


def test_the_report_gives_each_ddp_variant_its_ratio_to_gloo():
    times = {"torch DDP on gloo": [1.0, 2.0, 1.0], "torch DDP on shm": [0.9, 1.8, 0.9],
             bench.FREE: [0.8, 1.6, 0.8], "torch DDP, no_sync": [0.7, 1.4, 0.7]}
    text = bench.report({"world_size": 2, "ddp": times})
    lines = {line.split("  ")[0]: line for line in text.splitlines()}
    assert "0.900 (0.900-0.900)" in lines["torch DDP on shm"], text
    assert "0.800 (0.800-0.800)" in lines[bench.FREE], text
    assert "0.700 (0.700-0.700)" in lines["torch DDP, no_sync"], text


def test_the_report_gives_each_ddp_variant_its_distance_above_the_floor_round_by_round():
    # shm is 0.1 of Gloo's step above the floor in every round, though the rounds' medians mix
    times = {"torch DDP on gloo": [1.0, 2.0, 1.0, 4.0], "torch DDP on shm": [0.9, 1.8, 0.9, 3.6],
             bench.FREE: [0.8, 1.6, 0.8, 3.2]}
    text = bench.report({"world_size": 2, "ddp": times})
    lines = {line.split("  ")[0]: line for line in text.splitlines()}
    assert lines["torch DDP on shm"].rstrip().endswith("0.100 (0.100-0.100)"), text
    assert lines[bench.FREE].rstrip().endswith("0.000 (0.000-0.000)"), text
    assert "above the floor" in text


def _bandwidth_result(roofline, path="pieces"):
    rows = [{"size": 8, "gloo_s": 200e-6, "shm_s": 20e-6, "check": True, "shm_path": "small"},
            {"size": 1 << 20, "gloo_s": 0.010, "shm_s": 0.002, "check": True, "shm_path": path}]
    return {"world_size": 2, "bandwidth": rows, "copy_gbps": 20.0, "roofline_gbps": roofline,
            "latency": {"gloo": [2e-4, 1e-4], "shm": [2e-5, 1e-5]}, "strategies": {"futex": [2e-5, 1e-5]}}


def test_the_report_holds_shm_against_the_roofline_by_the_path_it_took():
    for path, per_byte in (("pieces", 4), ("cma", 2)):  # bytes moved per byte per rank on 2 ranks
        text = bench.report(_bandwidth_result(40.0, path))
        rows = {line.split()[0]: line.split() for line in text.splitlines() if line[:1].isdigit()}
        moved = 2 * per_byte * (1 << 20)  # 2 ranks, 1 MiB, in 2 ms
        assert rows["1048576"][6:] == [f"{moved / 0.002 / 1e9:.1f}", f"{0.010 / (moved / 40e9):.2f}x", path, "ok"], text
        assert rows["8"][6:] == ["small", "ok"], text  # every rank adds every slot: no model, no cells
        assert "roofline: 40.0 GB/s" in text, text
    assert "roofline" not in bench.report(_bandwidth_result(None)), "a result without one has no roofline columns"


def test_the_paths_report_compares_each_variant_with_the_roofline():
    result = {"world_size": 4, "variants": [("whole", 0), ("pieces", 1 << 20), ("cma", 1 << 20)], "roofline_gbps": 40.0,
              "rows": [{"size": 4 << 20, "gloo_s": 0.008, "shm_s": [0.004, 0.002, 0.001],
                        "paths": ["whole", "pieces", "cma"], "check": True}]}
    text = paths_bench.report(result)
    lines = {name: [c.strip() for c in line.split("  ") if c.strip()] for line in text.splitlines()
             for name in ("whole slice", "pieces, 1024 KiB", "cma, 1024 KiB") if name in line}
    for name, t, per_byte in (("whole slice", 0.004, 5.75), ("pieces, 1024 KiB", 0.002, 4.5), ("cma, 1024 KiB", 0.001, 2)):
        moved = 4 * per_byte * (4 << 20)  # 4 ranks
        cells = lines[name]
        assert cells[-6:] == [f"{(4 << 20) / t / 1e9 * 1.5:.2f}", f"{moved / t / 1e9:.1f}", f"{moved / t / 1e9 / 40:.0%}",
                              f"{0.008 / t:.2f}x", f"{0.008 / (moved / 40e9):.2f}x", "ok"], (name, cells, text)


def test_a_variant_is_a_path_and_a_piece_size():
    assert paths_bench.parse_variant("whole") == ("whole", 0)
    assert paths_bench.parse_variant("pieces=256K") == ("pieces", 256 << 10)
    assert paths_bench.parse_variant("cma=1M") == ("cma", 1 << 20)
    for bad in ("cma", "pieces=0", "whole=1M", "ring=1M"):
        with pytest.raises(argparse.ArgumentTypeError, match="whole, pieces=SIZE or cma=SIZE"):
            paths_bench.parse_variant(bad)


def test_the_paths_benchmark_runs_end_to_end(capsys, monkeypatch):
    monkeypatch.setenv("COLLECTIVES_SHM_CMA", "1")  # wherever the calls work
    monkeypatch.setenv("COLLECTIVES_SHM_CMA_MIN_KB", "256")
    assert paths_bench.main(["--world-size", "2", "--variants", "whole", "pieces=8K", "cma=8K", "-b", "128K",
                             "-e", "2M", "--iters", "2"]) == 0
    out = capsys.readouterr().out
    assert out.count("whole slice") == 3 and out.count("pieces, 8 KiB") == 3 and "WRONG" not in out, out
    # cma from 256 KiB (COLLECTIVES_SHM_CMA_MIN_KB); below it that group's calls go through the segment
    assert out.count("cma, 8 KiB (took pieces)") == 1 and out.count("cma, 8 KiB ") == 3, out
