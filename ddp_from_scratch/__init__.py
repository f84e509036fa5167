"""A hand-built DistributedDataParallel, taught in steps (naive -> flat -> bucketed), verified
against torch's DDP on ResNet-50 / CIFAR-10, bit for bit.

    from ddp_from_scratch import DistributedDataParallel     # step 3: drop-in for torch's DDP
    model = DistributedDataParallel(net)                      # inside a process group

The files, bottom up (each imports only files above it in this list; tests/import_graph.py checks):
  timeline.py what happened when in one backward: the recorder every wrapper fills in
  resnet.py   torchvision's ResNet-50 (same architecture, parameter names, initialisation)
  models.py   the models by name (ResNet-50, a small CNN, one with unused heads) and batches
  cifar10.py  the standard CIFAR-10 files, deterministic training transform, synthetic stand-in
  unused.py   which parameters a forward's output reaches (find_unused_parameters)
  bucket.py   step 3's buckets: torch's layouts (first iteration, rebuilt), flat buffers, the
              printout; and runs_of_at_most, the other way to cut parameters into runs of bytes
  memory.py   what a rank holds during a step (parameters, gradients, optimizer state), sampled
  parity.py   how two trainings are compared: the same bits, StepCheck, the summary
  base.py     what the wrappers share: shape check, broadcasts, gradient-ready hooks, no_sync
  naive.py    step 1: one all_reduce per parameter after backward (NaiveDataParallel)
  flat.py     step 2: one all_reduce of all gradients, flattened, after backward (FlatDataParallel)
  ddp.py      step 3: buckets all-reduced while backward runs, rebuilt from the ready order,
              find_unused_parameters, gradient_as_bucket_view, fp16/bf16 compression
  sharding.py what the sharded stages share: ShardLayout (FSDP2's dim-0 shards, chunk_cat's
              reduce-scatter layout), ShardedOptimizer, the all-gather after the step
  zero1.py    step 4, ZeRO-1: DDP's buckets, the optimizer on this rank's rows (bucketed DDP + sharding)
  zero2.py    step 5, ZeRO-2: a reduce_scatter per unit instead of the all_reduce, gradients
              sharded too (base + sharding); with bucket_cap_mb, units reduce-scattered during backward
  fsdp.py     step 6, ZeRO-3/FSDP: ZeRO-2 by module, units gathered before forward and backward, freed after
  wrap.py     the one registry of stages by name (STAGES) and wrap(model, name)
  trace.py    the bucket timeline as a Chrome trace and a PNG (python -m ddp_from_scratch.trace)
  sharded_parity.py  the sharded stages side by side with torch's fully_shard and DDP
  compare.py  side-by-side parity with torch's DDP (python -m ddp_from_scratch.compare)
  train.py    the training program (python -m ddp_from_scratch.train), checkpoint and --resume

Words: a *bucket* is the gradients all-reduced together (DDP, ZeRO-1); a *unit* the parameters
reduce-scattered together (ZeRO-2: the whole model or a bucket_cap_mb run; FSDP: a module's
parameters, also gathered together); a *shard* one rank's rows of a parameter; the *bucket
layout* (bucket.py) says which parameters share a bucket, the *shard layout* (sharding.py)
where each rank's rows sit in a flat buffer, and *chunks* (collectives/chunks.py) are the
per-rank pieces of one buffer in the collective algorithms.
"""

from .ddp import DistributedDataParallel
from .flat import FlatDataParallel
from .fsdp import FullyShardedDataParallel
from .naive import NaiveDataParallel
from .sharding import ShardLayout
from .zero1 import ZeroOneDataParallel
from .zero2 import ZeroTwoDataParallel

__all__ = ["DistributedDataParallel", "FlatDataParallel", "FullyShardedDataParallel", "NaiveDataParallel",
           "ShardLayout", "ZeroOneDataParallel", "ZeroTwoDataParallel"]
