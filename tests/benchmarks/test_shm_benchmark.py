"""benchmarks/shm.py: the floor it measures DDP against really moves nothing, and the report
names every DDP variant with its ratio to Gloo.

    pytest tests/benchmarks/test_shm_benchmark.py
"""

import torch
import torch.distributed as dist

from benchmarks import shm as bench
from benchmarks import shm_pieces as pieces_bench


def _free_group(env):
    group = bench.free_all_reduce_group()
    summed = torch.full((3,), float(env.rank + 1))
    dist.all_reduce(summed, group=group)
    sent = torch.full((2,), float(env.rank + 1))
    dist.broadcast(sent, src=0, group=group)
    return summed.tolist(), sent.tolist()


def test_the_free_group_moves_nothing_in_all_reduce_and_the_rest_still_works(dist_run):
    for rank, (summed, sent) in enumerate(dist_run(_free_group, 2)):
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


def _bandwidth_result(roofline):
    rows = [{"size": 8, "gloo_s": 200e-6, "shm_s": 20e-6, "check": True},
            {"size": 1 << 20, "gloo_s": 0.010, "shm_s": 0.002, "check": True}]
    return {"world_size": 2, "bandwidth": rows, "copy_gbps": 20.0, "roofline_gbps": roofline,
            "latency": {"gloo": [2e-4, 1e-4], "shm": [2e-5, 1e-5]}, "strategies": {"futex": [2e-5, 1e-5]}}


def test_the_report_holds_shm_against_the_roofline():
    text = bench.report(_bandwidth_result(40.0))
    rows = {line.split()[0]: line.split() for line in text.splitlines() if line[:1].isdigit()}
    # 1 MiB on 2 ranks in pieces: 4 bytes moved per byte per rank, 2 ranks: 8 MiB in 2 ms
    moved = 2 * 4 * (1 << 20)
    assert rows["1048576"][6] == f"{moved / 0.002 / 1e9:.1f}", text
    assert rows["1048576"][7] == f"{0.010 / (moved / 40e9):.2f}x", text  # Gloo's time over the floor
    assert rows["8"][6:] == ["ok"], text  # the small path has no step 3: no model, no cells
    assert "roofline: 40.0 GB/s" in text, text
    assert "roofline" not in bench.report(_bandwidth_result(None)), "a result without one has no roofline columns"


def test_the_pieces_report_compares_each_piece_size_with_the_roofline():
    result = {"world_size": 4, "pieces": [0, 1 << 20], "roofline_gbps": 40.0,
              "rows": [{"size": 4 << 20, "gloo_s": 0.008, "shm_s": {"0": 0.004, str(1 << 20): 0.002}, "check": True}]}
    text = pieces_bench.report(result)
    whole = next(line.split("  ") for line in text.splitlines() if "whole slice" in line)
    cells = [c.strip() for c in whole if c.strip()]
    moved = 4 * 5.75 * (4 << 20)  # 4 ranks, the whole slice: 5.75 bytes per byte per rank
    assert cells[3:9] == ["4000", f"{(4 << 20) / 0.004 / 1e9 * 1.5:.2f}", f"{moved / 0.004 / 1e9:.1f}",
                          f"{moved / 0.004 / 1e9 / 40:.0%}", "2.00x", f"{0.008 / (moved / 40e9):.2f}x"], text
    assert "1024 KiB pieces" in text and "4.00x" in text, text


def test_the_pieces_benchmark_runs_end_to_end(capsys):
    assert pieces_bench.main(["--world-size", "2", "--pieces", "0", "8K", "-b", "64K", "-e", "256K",
                              "--iters", "2"]) == 0
    out = capsys.readouterr().out
    assert out.count("whole slice") == 2 and out.count("8 KiB pieces") == 2 and "WRONG" not in out, out
