"""Our ResNet-50 is torchvision's: parameter counts, state_dict keys and shapes, the v1.5 stride
placement, and (when torchvision can be imported) the same outputs from the same weights.

    pytest tests/ddp/test_resnet.py -q
"""

import pytest
import torch

from ddp_from_scratch.workload.resnet import resnet50


@pytest.mark.parametrize("num_classes, count", [(10, 23_528_522), (1000, 25_557_032)])
def test_parameter_count(num_classes, count):
    assert sum(p.numel() for p in resnet50(num_classes).parameters()) == count


def _expected_keys():
    """torchvision's resnet50 state_dict keys, written out from the architecture's definition."""
    def conv_bn(prefix, conv, bn):
        return [f"{prefix}{conv}.weight"] + [f"{prefix}{bn}.{k}" for k in
                                             ("weight", "bias", "running_mean", "running_var", "num_batches_tracked")]

    keys = conv_bn("", "conv1", "bn1")
    for layer, blocks in zip(range(1, 5), (3, 4, 6, 3)):
        for b in range(blocks):
            p = f"layer{layer}.{b}."
            for i in (1, 2, 3):
                keys += conv_bn(p, f"conv{i}", f"bn{i}")
            if b == 0:
                keys += conv_bn(p, "downsample.0", "downsample.1")
    return keys + ["fc.weight", "fc.bias"]


def test_state_dict_keys_and_shapes():
    sd = resnet50(10).state_dict()
    assert list(sd) == _expected_keys() and len(sd) == 320
    assert sd["fc.weight"].shape == (10, 2048)
    assert sd["layer4.2.conv3.weight"].shape == (2048, 512, 1, 1)
    assert sd["layer2.0.downsample.0.weight"].shape == (512, 256, 1, 1)
    assert sd["layer1.0.conv2.weight"].shape == (64, 64, 3, 3)


def test_stride_sits_on_the_3x3_convolution():  # ResNet v1.5, as torchvision
    m = resnet50(10)
    assert m.layer2[0].conv2.stride == (2, 2) and m.layer2[0].conv1.stride == (1, 1)
    assert m.layer3[0].downsample[0].stride == (2, 2)


def test_forward_shapes_and_batchnorm_init():
    m = resnet50(10).eval()
    assert m(torch.randn(2, 3, 32, 32)).shape == (2, 10)
    assert torch.equal(m.bn1.weight, torch.ones(64)) and torch.equal(m.layer1[0].bn3.bias, torch.zeros(256))


def test_matches_torchvision_when_available():
    try:
        import torchvision
    except Exception as exc:  # the CPU build of torch here cannot import torchvision
        pytest.skip(f"torchvision cannot be imported here: {type(exc).__name__}")
    ours, theirs = resnet50(10).eval(), torchvision.models.resnet50(weights=None, num_classes=10).eval()
    theirs.load_state_dict(ours.state_dict())
    x = torch.randn(2, 3, 64, 64)
    torch.testing.assert_close(ours(x), theirs(x))
