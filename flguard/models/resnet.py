"""ResNets the guard can certify: GroupNorm instead of BatchNorm, CIFAR-sized stems.

* ``resnet18_gn``: torchvision's ResNet-18 (11.2 M parameters at 10 classes) with every BatchNorm
  a GroupNorm of 32 groups (as ``flguard.fix_model`` makes it) and the small-image stem (3×3
  stride-1 convolution, no max-pool) used for 32×32 inputs.
* ``resnet20_gn``: He et al.'s CIFAR ResNet-20 (three stages of three basic blocks, 16/32/64
  channels, ≈ 0.27 M parameters), GroupNorm throughout: the mid-size model of the cost table.
* ``resnet8_gn``: the same family with one block per stage and 4/8/16 channels (≈ 5 k parameters),
  small enough for dense float64 reference Jacobians in the tests, shaped like the real ones
  (GroupNorm, residual additions, a strided 1×1 shortcut, global average pooling).
"""

from __future__ import annotations

import math

import torch
from torch import nn

#: Channels per GroupNorm group at most (see ``flguard.guard.model_check.MAX_GROUPS``; kept equal).
GROUPS = 32


def group_norm(channels: int) -> nn.GroupNorm:
    """GroupNorm with gcd(channels, 32) groups: 32 for ResNet widths, one channel per group below."""
    return nn.GroupNorm(math.gcd(channels, GROUPS), channels)


class BasicBlock(nn.Module):
    """Two 3×3 convolutions with GroupNorm and a residual; a strided 1×1 projection when the shape changes."""

    def __init__(self, in_channels: int, channels: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, channels, 3, stride, 1, bias=False)
        self.norm1 = group_norm(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, 1, 1, bias=False)
        self.norm2 = group_norm(channels)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_channels != channels:
            self.shortcut = nn.Sequential(nn.Conv2d(in_channels, channels, 1, stride, bias=False), group_norm(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.norm1(self.conv1(x)))
        out = self.norm2(self.conv2(out))
        return torch.relu(out + self.shortcut(x))


class CifarResNet(nn.Module):
    """He et al.'s CIFAR ResNet (6n + 2 layers): stem, three stages of ``blocks`` basic blocks of
    ``width``, 2·``width``, 4·``width`` channels (the last two strided), global average pool, FC."""

    def __init__(self, in_channels: int, num_classes: int, blocks: int, width: int) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(in_channels, width, 3, 1, 1, bias=False), group_norm(width), nn.ReLU())
        layers, channels = [], width
        for stage in range(3):
            out = width * 2 ** stage
            for index in range(blocks):
                layers.append(BasicBlock(channels, out, 2 if stage > 0 and index == 0 else 1))
                channels = out
        self.layers = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(channels, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.pool(self.layers(self.stem(x))).flatten(1))


def _check_size(name: str, image_size: int, minimum: int) -> None:
    if image_size < minimum:
        raise ValueError(f"model {name!r}: image_size={image_size} is too small (need at least {minimum})")


def resnet20_gn(in_channels: int, num_classes: int, image_size: int) -> nn.Module:
    _check_size("resnet20_gn", image_size, 4)
    return CifarResNet(in_channels, num_classes, blocks=3, width=16)


def resnet8_gn(in_channels: int, num_classes: int, image_size: int) -> nn.Module:
    _check_size("resnet8_gn", image_size, 4)
    return CifarResNet(in_channels, num_classes, blocks=1, width=4)


def resnet18_gn(in_channels: int, num_classes: int, image_size: int) -> nn.Module:
    """torchvision's ResNet-18 with GroupNorm and the small-image stem."""
    from torchvision.models import resnet18

    _check_size("resnet18_gn", image_size, 8)
    model = resnet18(weights=None, num_classes=num_classes, norm_layer=group_norm)
    model.conv1 = nn.Conv2d(in_channels, 64, kernel_size=3, stride=1, padding=1, bias=False)
    model.maxpool = nn.Identity()
    return model
