"""The teaching path, one step a file, each proven against torch (python -m ddp_from_scratch.compare):

  naive.py     step 1: one all_reduce per parameter after backward (NaiveDataParallel)
  flat.py      step 2: one all_reduce of all gradients, flattened, after backward (FlatDataParallel)
  ddp.py       step 3: buckets all-reduced while backward runs, rebuilt from the ready order,
               find_unused_parameters, gradient_as_bucket_view, fp16/bf16 compression
  powersgd.py  step 3, compressed: PowerSGD's low-rank approximation of each bucket
  zero1.py     step 4, ZeRO-1: DDP's buckets, the optimizer on this rank's rows
  zero2.py     step 5, ZeRO-2: a reduce_scatter per unit instead of the all_reduce, gradients sharded too
  fsdp.py      step 6, ZeRO-3/FSDP: ZeRO-2 by module, units gathered before forward and backward

What they stand on is in ddp_from_scratch/parts/; the models and data they train in workload/.
"""
