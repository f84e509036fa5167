"""A hand-built DistributedDataParallel, taught in steps (naive -> flat -> bucketed), verified
against torch's DDP on ResNet-50 / CIFAR-10, bit for bit.

    from ddp_from_scratch import DistributedDataParallel     # step 3: drop-in for torch's DDP
    model = DistributedDataParallel(net)                      # inside a process group

The files:
  resnet.py   torchvision's ResNet-50 (same architecture, parameter names, initialisation)
  cifar10.py  the standard CIFAR-10 files, deterministic training transform, synthetic stand-in
  base.py     what the wrappers share: shape check, broadcasts, gradient-ready hooks
  naive.py    step 1: one all_reduce per parameter after backward (NaiveDataParallel)
  flat.py     step 2: one all_reduce of all gradients, flattened, after backward (FlatDataParallel)
  bucket.py   step 3's buckets: torch's layouts (first iteration, rebuilt), flat buffers, the printout
  ddp.py      step 3: buckets all-reduced while backward runs, rebuilt from the ready order,
              no_sync, find_unused_parameters, gradient_as_bucket_view, fp16/bf16 compression
  shard.py    the sharded steps' layout: FSDP2's dim-0 shards, chunk_cat's reduce-scatter layout
  zero1.py    step 4, ZeRO-1: DDP's buckets, the optimizer on this rank's rows, all_gather after the step
  zero2.py    step 5, ZeRO-2: one reduce_scatter instead of the all_reduce, gradients sharded too;
              with bucket_cap_mb, a reduce_scatter per bucket while backward runs (DeepSpeed's way)
  fsdp.py     step 6, ZeRO-3/FSDP: units gathered before forward and backward, freed after
  memory.py   what a rank holds during a step (parameters, gradients, optimizer state), sampled
  trace.py    the bucket timeline as a Chrome trace and a PNG (python -m ddp_from_scratch.trace)
  compare.py  side-by-side parity with torch's DDP (python -m ddp_from_scratch.compare)
  sharded_parity.py  the sharded steps side by side with torch's fully_shard and DDP (compare --impl zero1 ...)
  train.py    the training program (python -m ddp_from_scratch.train), checkpoint and --resume
"""

from .ddp import DistributedDataParallel
from .flat import FlatDataParallel
from .fsdp import FullyShardedDataParallel
from .naive import NaiveDataParallel
from .shard import ShardLayout
from .zero1 import ZeroOneDataParallel
from .zero2 import ZeroTwoDataParallel

__all__ = ["DistributedDataParallel", "FlatDataParallel", "FullyShardedDataParallel", "NaiveDataParallel",
           "ShardLayout", "ZeroOneDataParallel", "ZeroTwoDataParallel"]
