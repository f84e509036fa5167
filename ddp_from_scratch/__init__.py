"""A hand-built DistributedDataParallel, taught in steps (naive -> flat -> bucketed), verified
against torch's DDP on ResNet-50 / CIFAR-10, bit for bit.

    from ddp_from_scratch import DistributedDataParallel     # step 3: drop-in for torch's DDP
    model = DistributedDataParallel(net)                      # inside a process group

The folders: steps/ (the teaching path, one step a file: naive, flat, ddp, powersgd, zero1, zero2,
fsdp), parts/ (what they are built from and proven with), workload/ (the models and data), then
the other axes of parallelism (tensor_parallel/, pipeline_parallel/, expert_parallel/,
context_parallel/), and the programs:
  compare/   side-by-side parity with torch's DDP, the sharded steps, TP and PP (python -m ddp_from_scratch.compare)
  train/     the training program, a run a file (python -m ddp_from_scratch.train); train/args.py its command line
  trace.py   the bucket timeline as a Chrome trace and a PNG (python -m ddp_from_scratch.trace)
  wrap.py    the one registry of stages by name (STAGES) and wrap(model, name)
Each imports only what is below it (tests/import_graph.py checks the layers).

Words: a *bucket* is the gradients all-reduced together (DDP, ZeRO-1); a *unit* the parameters
reduce-scattered together (ZeRO-2: the whole model or a bucket_cap_mb run; FSDP: a module's
parameters, also gathered together); a *shard* one rank's rows of a parameter; the *bucket
layout* (bucket.py) says which parameters share a bucket, the *shard layout* (sharding.py)
where each rank's rows sit in a flat buffer, and *chunks* (collectives/chunks.py) are the
per-rank pieces of one buffer in the collective algorithms.
"""

from .steps.ddp import DistributedDataParallel
from .steps.flat import FlatDataParallel
from .steps.fsdp import FullyShardedDataParallel
from .steps.naive import NaiveDataParallel
from .parts.sharding import ShardLayout
from .steps.zero1 import ZeroOneDataParallel
from .steps.zero2 import ZeroTwoDataParallel

__all__ = ["DistributedDataParallel", "FlatDataParallel", "FullyShardedDataParallel", "NaiveDataParallel",
           "ShardLayout", "ZeroOneDataParallel", "ZeroTwoDataParallel"]
