"""benchmarks/shm.py: the floor it measures DDP against really moves nothing, and the report
names every DDP variant with its ratio to Gloo.

    pytest tests/benchmarks/test_shm_benchmark.py
"""

import torch
import torch.distributed as dist

from benchmarks import shm as bench


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
