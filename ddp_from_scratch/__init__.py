"""A hand-built DistributedDataParallel, taught in steps (naive -> flat -> bucketed), verified
against torch's DDP on ResNet-50 / CIFAR-10 (issue 3).

Written so far: the model (`resnet.py`, torchvision's ResNet-50) and the data (`cifar10.py`, the
standard files with a deterministic training transform). The three wrappers, the parity proof,
the training program and its benchmark are still to come.
"""
