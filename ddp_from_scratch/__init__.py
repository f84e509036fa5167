"""A hand-built DistributedDataParallel, taught in steps (naive -> flat -> bucketed), verified
against torch's DDP on ResNet-50 / CIFAR-10 (issue 3).

Written so far:
  resnet.py   torchvision's ResNet-50 (same architecture, parameter names, initialisation)
  cifar10.py  the standard CIFAR-10 files, deterministic training transform, synthetic stand-in
  base.py     what the wrappers share: shape check, broadcasts, gradient-ready hooks
  naive.py    step 1: one all_reduce per parameter after backward
  flat.py     step 2: one all_reduce of all gradients, flattened, after backward
Still to come: step 3 (buckets overlapped with backward, ddp.py), the compare program, the
training program and its benchmark.
""" 
