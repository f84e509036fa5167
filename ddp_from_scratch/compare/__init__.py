"""The compare program: torch's DDP and ours (and the sharded steps, tensor and pipeline
parallelism) trained side by side and compared after every step (program.py says what it prints).

    python -m ddp_from_scratch.compare --world-sizes 2 4

Its parts:

    program.py   the DDP tables, the flags, main()
    options.py   the rows of the bucketed wrapper's options table
    sharded.py   the sharded steps against torch's fully_shard and DDP
    tp.py        tensor parallelism's table (ddp_from_scratch/tensor_parallel/parity.py)
    pp.py        pipeline parallelism's table (ddp_from_scratch/pipeline_parallel/parity.py)
"""

from .program import build_parser, layouts, main, train_side_by_side

__all__ = ["build_parser", "layouts", "main", "train_side_by_side"]
