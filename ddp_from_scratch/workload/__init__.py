"""What the steps train: the models by name and their batches (models.py), torchvision's ResNet-50
(resnet.py), the CIFAR-10 files or a synthetic stand-in (cifar10.py), and a small transformer on
synthetic tokens or text as bytes for the transformer runs (transformer.py, text.py)."""
