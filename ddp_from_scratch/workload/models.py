"""The models every program here trains, and the synthetic per-rank batch they train on.

    model = MODELS["resnet50"]()          # or "small", "branchy"
    x, y = batch(step, rank, batch_size=4, image=12)

`small` is two conv + BatchNorm layers and a classifier: enough to exercise buffers and buckets
in milliseconds. `branchy` adds a head used on rank 0 only and one used by no rank, for
find_unused_parameters. `resnet50` is torchvision's architecture (resnet.py).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from collectives import cli

from .resnet import resnet50


class SmallNet(nn.Module):
    """Two conv + BatchNorm layers and a classifier: enough to exercise buffers and buckets."""

    def __init__(self, num_classes: int = 10):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8)
        self.conv2, self.bn2 = nn.Conv2d(8, 16, 3, stride=2, bias=False), nn.BatchNorm2d(16)
        self.fc = nn.Linear(16, num_classes)

    def forward(self, x):
        x = F.relu(self.bn1(self.conv1(x)))
        x = F.relu(self.bn2(self.conv2(x)))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


class Branchy(SmallNet):
    """SmallNet with two more heads: `extra` is used on rank 0 only, `never` by no rank.

    For find_unused_parameters=True: rank 1 gets no local gradient for `extra` but must end with
    the average; `never`'s gradient must stay None everywhere.
    """

    def __init__(self, num_classes: int = 10):
        super().__init__(num_classes)
        self.extra, self.never = nn.Linear(16, num_classes), nn.Linear(16, num_classes)

    def forward(self, x):
        x = F.relu(self.bn1(self.conv1(x)))
        x = torch.flatten(F.adaptive_avg_pool2d(F.relu(self.bn2(self.conv2(x))), 1), 1)
        out = self.fc(x)
        return out + self.extra(x) if dist.get_rank() == 0 else out


MODELS = {"small": SmallNet, "resnet50": lambda: resnet50(num_classes=10), "branchy": Branchy}

# Bytes of every layer's output for one 32x32 image, as layer_output_bytes() counts them: a floor on
# what training holds per image until backward (ResNet-50's peak grew by 2.5 MiB per image from
# batch 64 to 256 here, the figure below). train and trace refuse a batch that cannot fit before
# any rank allocates it; tests/ddp/test_models.py recounts these. branchy: small's, a floor.
LAYER_OUTPUT_BYTES = {"small": 94_376, "resnet50": 2_623_528, "branchy": 94_376}


def check_batch_fits(parser, model: str, batch_size: int, ranks: int, image: int = 32) -> None:
    """--batch-size refused (a usage error) before any rank allocates it when the layer outputs
    alone of every rank on this machine exceed its available memory. Other image sizes scale the
    figure by area, less a tenth for the rounding of strided layers."""
    per_image = LAYER_OUTPUT_BYTES[model] * (1.0 if image == 32 else 0.9 * (image / 32) ** 2)
    cli.check_memory(parser, "--batch-size", int(ranks * batch_size * per_image),
                     f"{ranks} rank(s) x {batch_size} images x {per_image / 2**20:.2f} MiB of {model}'s layer outputs")


def check_batchnorm_fits(parser, model: str, batch_size: int, image: int = 32) -> None:
    """A usage error where training would give a BatchNorm one value per channel, which torch
    refuses mid-forward: ResNet-50's last stage is image / 32 pixels wide, so it needs
    batch_size x side^2 >= 2."""
    if model == "resnet50":
        side = max(1, -(-image // 32))
        if batch_size * side * side < 2:
            parser.error(f"--batch-size {batch_size} with {image}x{image} images: ResNet-50's last BatchNorm would see "
                         "one value per channel (torch refuses that in training); use --batch-size 2 or more")


def layer_output_bytes(model: nn.Module, image: int = 32) -> int:
    """The sum of every leaf module's output size, in bytes, for one image (eval mode, no grad)."""
    total = 0

    def count(module, inputs, output):
        nonlocal total
        if isinstance(output, torch.Tensor):
            total += output.numel() * output.element_size()

    hooks = [m.register_forward_hook(count) for m in model.modules() if not list(m.children())]
    was_training = model.training
    try:
        with torch.no_grad():
            model.eval()
            model(torch.zeros(1, 3, image, image))
    finally:
        model.train(was_training)
        for hook in hooks:
            hook.remove()
    return total


def batch(step: int, rank: int, batch_size: int, image: int = 32):
    """This rank's batch for this step: CIFAR-shaped, the same in every program."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(batch_size, 3, image, image, generator=g), torch.randint(0, 10, (batch_size,), generator=g)
