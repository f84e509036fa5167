"""A hand-built DistributedDataParallel, taught in steps (naive -> flat -> bucketed), verified
against torch's DDP on ResNet-50 / CIFAR-10 (issue 3).

Written so far:
  resnet.py   torchvision's ResNet-50 (same architecture, parameter names, initialisation)
  cifar10.py  the standard CIFAR-10 files, deterministic training transform, synthetic stand-in
  base.py     what the wrappers share: shape check, broadcasts, gradient-ready hooks
  naive.py    step 1: one all_reduce per parameter after backward
  flat.py     step 2: one all_reduce of all gradients, flattened, after backward
  bucket.py   step 3's buckets: assignment by size, flat buffers, the layout printout
  ddp.py      step 3: buckets all-reduced while backward runs, rebuilt from the ready order,
              no_sync, fp16/bf16 compression, unused parameters named at the end of backward
  trace.py    the bucket timeline as a Chrome trace and a PNG
  compare.py  side-by-side parity with torch's DDP (python -m ddp_from_scratch.compare)
  train.py    the training program (python -m ddp_from_scratch.train), checkpoint and --resume
Still to come: find_unused_parameters=True, gradient_as_bucket_view, torch's exact bucket layout
(needed for bitwise equality beyond 2 ranks), and closing the 1.07x step-time gap to torch's DDP
(benchmarks/ddp_step_time.py).
"""
