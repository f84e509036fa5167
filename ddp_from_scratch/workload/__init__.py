"""What the steps train: the models by name and their batches (models.py), torchvision's ResNet-50
(resnet.py), and the CIFAR-10 files or a synthetic stand-in (cifar10.py)."""
