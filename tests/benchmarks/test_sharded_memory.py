"""The memory part of benchmarks/sharded.py on the small CNN: what each stage is measured to hold
must follow from what it keeps (a sampler that missed the gathered units, the buckets or the
optimizer state would break these), and the table must say it.

    pytest tests/benchmarks/test_sharded_memory.py -q
"""

from benchmarks.sharded import STAGES, memory, memory_table
from collectives.testing import run_on_ranks


def test_each_stage_holds_what_it_keeps():
    per_rank = run_on_ranks(memory, 2, args=(STAGES, 2, 12, "small"), timeout=300)
    for held in per_rank:
        psi = held["param_bytes"]
        ddp, view = held["ddp"], held["ddp, gradient_as_bucket_view"]
        assert ddp["params"] == psi and ddp["optimizer"] == psi  # momentum: one tensor per parameter
        assert ddp["grads"] == 2 * psi and view["grads"] == psi  # .grad and the buckets, or views of them
        for stage in ("zero1", "zero2", "fsdp", "torch fully_shard"):
            # this rank's rows of every parameter's momentum: half, give or take the padding of odd rows
            assert psi / 2 - 64 <= held[stage]["optimizer"] <= psi / 2 + 64, (stage, held[stage])
        # ZeRO-1's after-step all_gather lands in a buffer of one gather group (the whole small model)
        assert held["zero1"]["comm"] <= psi + psi / 2 + 64, held["zero1"]
        assert held["fsdp"]["total"] < held["zero2"]["total"] < ddp["total"]
        assert held["fsdp"]["params"] < psi  # shards plus one unit whole, never the whole model
        assert held["fsdp"]["samples"] > 20  # module boundaries, gradients and collectives were sampled
    rows, headers = memory_table(per_rank, 2)
    assert [r[0] for r in rows] == STAGES and headers[6] == "vs DDP" and rows[0][6] == "1.000"
