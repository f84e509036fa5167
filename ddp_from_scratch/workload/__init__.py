"""What the steps train: the models by name and their batches (models.py), torchvision's ResNet-50
(resnet.py), the CIFAR-10 files or a synthetic stand-in (cifar10.py), and a small transformer on
synthetic tokens for the tensor-parallel steps (transformer.py)."""
