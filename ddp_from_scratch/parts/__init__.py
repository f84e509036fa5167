"""What the steps (ddp_from_scratch/steps/) are built from and proven with:

  base.py         what the wrappers share: shape check, broadcasts, gradient-ready hooks, no_sync
  bucket.py       step 3's buckets: torch's layouts (first iteration, rebuilt), flat buffers, the printout
  unused.py       which parameters a forward's output reaches (find_unused_parameters)
  timeline.py     what happened when in one backward: the recorder every wrapper fills in
  sharding.py     what the sharded steps share: ShardLayout, ShardedOptimizer, the all-gather after the step
  memory.py       what a rank holds during a step (parameters, gradients, optimizer state), sampled
  step_check.py   how two trainings are compared: the same bits, StepCheck, the summary
  torch_hooks.py  torch's DDP comm hooks as they run in the comparisons and training
  shards.py       a checkpoint in shards: a file a rank and a manifest naming the layout (train --ep)
"""
