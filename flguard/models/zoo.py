"""Architectures: Flower's quickstart CNN, PyTorch's MNIST example with dropout, an LSTM over image rows, the I2F
LeNet, Chen & Campbell's CNN variants, an MLP, a linear model, ResNet-18 (BatchNorm, for the attack studies) and the
GroupNorm ResNets the guard certifies (``flguard.models.resnet``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from flguard.models.init import initialize
from flguard.models.resnet import resnet8_gn, resnet18_gn, resnet20_gn


@dataclass(frozen=True)
class ConvSpec:
    """One convolution: kernel width, output channels, stride, padding (seed 002 Table 1 order)."""

    kernel: int
    channels: int
    stride: int
    padding: int

    def output_size(self, size: int) -> int:
        return (size + 2 * self.padding - self.kernel) // self.stride + 1


# Chen & Campbell, Table 1: tanh after every bias-free convolution, no pooling, FC with bias.
CNN_VARIANTS: dict[str, tuple[ConvSpec, ...]] = {
    "cnn2_v1": (ConvSpec(3, 6, 1, 0),),
    "cnn2_v2": (ConvSpec(4, 6, 2, 0),),
    "cnn3_v1": (ConvSpec(3, 6, 1, 0), ConvSpec(4, 3, 2, 0)),
    "cnn3_v2": (ConvSpec(4, 6, 2, 0), ConvSpec(3, 3, 2, 0)),
    "cnn3_v3": (ConvSpec(3, 6, 1, 0), ConvSpec(3, 9, 1, 0)),
    "cnn3_v4": (ConvSpec(3, 1, 1, 0), ConvSpec(3, 6, 1, 0)),
    "cnn4_v1": (ConvSpec(3, 6, 1, 0), ConvSpec(4, 5, 2, 0), ConvSpec(4, 3, 1, 0)),
    "cnn4_v2": (ConvSpec(5, 16, 1, 0), ConvSpec(5, 6, 2, 0), ConvSpec(5, 32, 1, 2)),
}

# The I2F LeNet (seed 003 Table 1; Sun et al. 2020): four 5x5 convolutions of 12 channels with
# sigmoid, padding 2, strides 2, 2, 1, 1, then one FC layer.
LENET_CONVS = (ConvSpec(5, 12, 2, 2), ConvSpec(5, 12, 2, 2), ConvSpec(5, 12, 1, 2), ConvSpec(5, 12, 1, 2))


def _conv_stack(
    name: str, specs: tuple[ConvSpec, ...], in_channels: int, image_size: int,
    activation: Callable[[], nn.Module], bias: bool,
) -> tuple[list[nn.Module], int]:
    """Build conv+activation layers and return them with the flattened output width."""
    layers: list[nn.Module] = []
    size, channels = image_size, in_channels
    for index, spec in enumerate(specs, start=1):
        out = spec.output_size(size)
        if out < 1:
            raise ValueError(
                f"model {name!r}: image_size={image_size} is too small; layer {index} "
                f"(kernel {spec.kernel}, stride {spec.stride}, padding {spec.padding}) would get a "
                f"{size}x{size} input and produce {out}x{out}"
            )
        layers += [nn.Conv2d(channels, spec.channels, spec.kernel, spec.stride, spec.padding, bias=bias),
                   activation()]
        size, channels = out, spec.channels
    return layers, channels * size * size


def conv_net(name: str, specs: tuple[ConvSpec, ...], in_channels: int, num_classes: int,
             image_size: int, activation: Callable[[], nn.Module], conv_bias: bool) -> nn.Sequential:
    """A sequential conv net: convolutions with an activation each, flatten, one FC layer."""
    layers, width = _conv_stack(name, specs, in_channels, image_size, activation, conv_bias)
    return nn.Sequential(*layers, nn.Flatten(), nn.Linear(width, num_classes))


def _lenet(in_channels: int, num_classes: int, image_size: int) -> nn.Module:
    return conv_net("lenet", LENET_CONVS, in_channels, num_classes, image_size, nn.Sigmoid, True)


def _cnn(name: str) -> Callable[[int, int, int], nn.Module]:
    def build(in_channels: int, num_classes: int, image_size: int) -> nn.Module:
        return conv_net(name, CNN_VARIANTS[name], in_channels, num_classes, image_size, nn.Tanh, False)
    return build


class QuickstartCNN(nn.Module):
    """Flower's quickstart-pytorch CNN shape, generic in channels, image size and classes:
    conv 5×5 ×6 → ReLU → max-pool 2 → conv 5×5 ×16 → ReLU → max-pool 2 → FC 120 → ReLU → FC 84 →
    ReLU → FC classes. A model that learns (≈ 98% on MNIST), the main task's; ReLU and max-pool
    are piecewise linear, so its per-sample Jacobian ∇ₓ∇_θ L exists almost everywhere."""

    def __init__(self, in_channels: int, num_classes: int, image_size: int) -> None:
        super().__init__()
        size = (image_size - 4) // 2
        size = (size - 4) // 2
        if size < 1:
            raise ValueError(f"model 'cnn': image_size={image_size} is too small (need at least 16: two 5×5 "
                             f"convolutions, each followed by a 2×2 max-pool)")
        self.conv1 = nn.Conv2d(in_channels, 6, 5)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.pool = nn.MaxPool2d(2, 2)
        self.fc1 = nn.Linear(16 * size * size, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(torch.relu(self.conv1(x)))
        x = self.pool(torch.relu(self.conv2(x)))
        x = x.flatten(1)
        x = torch.relu(self.fc1(x))
        x = torch.relu(self.fc2(x))
        return self.fc3(x)


class DropoutCNN(nn.Module):
    """PyTorch's MNIST example network (``pytorch/examples``, mnist/main.py), generic in channels, image size and
    classes: conv 3×3 ×32 → ReLU → conv 3×3 ×64 → ReLU → max-pool 2 → Dropout(0.25) → FC 128 → ReLU →
    Dropout(0.5) → FC classes (logits; the example returns their log-softmax). 1.2 M parameters on 28×28 inputs,
    nearly all in the first FC layer: the dropout model practitioners start from, guarded with its masks replayed
    (``flguard.risk.dropout_draws``)."""

    def __init__(self, in_channels: int, num_classes: int, image_size: int) -> None:
        super().__init__()
        size = (image_size - 4) // 2
        if size < 1:
            raise ValueError(f"model 'dropout_cnn': image_size={image_size} is too small (need at least 6: two 3×3 "
                             "convolutions and a 2×2 max-pool)")
        self.conv1 = nn.Conv2d(in_channels, 32, 3)
        self.conv2 = nn.Conv2d(32, 64, 3)
        self.dropout1 = nn.Dropout(0.25)
        self.dropout2 = nn.Dropout(0.5)
        self.fc1 = nn.Linear(64 * size * size, 128)
        self.fc2 = nn.Linear(128, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.conv2(torch.relu(self.conv1(x))))
        x = self.dropout1(nn.functional.max_pool2d(x, 2)).flatten(1)
        return self.fc2(self.dropout2(torch.relu(self.fc1(x))))


class RowLSTM(nn.Module):
    """An LSTM reading the image row by row (a sequence of ``image_size`` rows of ``in_channels × image_size``
    features), its last step's state through two linear layers — PyTorch's ``examples/mnist_rnn`` without its
    BatchNorm and dropouts: the time-series models practitioners train, on the data that ships offline."""

    def __init__(self, in_channels: int, num_classes: int, image_size: int, hidden: int = 64) -> None:
        super().__init__()
        self.rnn = nn.LSTM(in_channels * image_size, hidden, batch_first=True)
        self.fc1 = nn.Linear(hidden, 32)
        self.fc2 = nn.Linear(32, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.permute(0, 2, 1, 3).flatten(2)  # (N, H, C·W)
        return self.fc2(torch.relu(self.fc1(self.rnn(rows)[0][:, -1])))


class RowConv1d(nn.Module):
    """A 1-D convolutional network reading the image row by row as a time series (``image_size`` steps of
    ``in_channels × image_size`` channels): three convolutions over time with GroupNorm, the second strided, then the
    mean over time to a linear head — the shape of the sensor and ECG classifiers practitioners train, on the data
    that ships offline."""

    def __init__(self, in_channels: int, num_classes: int, image_size: int, width: int = 32) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv1d(in_channels * image_size, width, 5, padding=2), nn.GroupNorm(4, width), nn.ReLU(),
            nn.Conv1d(width, 2 * width, 5, stride=2, padding=2), nn.GroupNorm(8, 2 * width), nn.ReLU(),
            nn.Conv1d(2 * width, 2 * width, 3, padding=1), nn.ReLU())
        self.head = nn.Linear(2 * width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        steps = x.permute(0, 1, 3, 2).flatten(1, 2)  # (N, C·W, H): each row a time step
        return self.head(self.features(steps).mean(2))


def _mlp(in_channels: int, num_classes: int, image_size: int, hidden: int = 256) -> nn.Module:
    """Two-layer perceptron with a sigmoid hidden layer (smooth, like the I2F LeNet)."""
    return nn.Sequential(nn.Flatten(), nn.Linear(in_channels * image_size**2, hidden), nn.Sigmoid(),
                         nn.Linear(hidden, num_classes))


def _linear(in_channels: int, num_classes: int, image_size: int) -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(in_channels * image_size**2, num_classes))


def _resnet18(in_channels: int, num_classes: int, image_size: int) -> nn.Module:
    """torchvision's ResNet18 with the usual small-image stem (3x3 stride-1 conv, no max-pool).

    Its BatchNorm layers couple the samples of a batch: the guard refuses it (``flguard.check_model``).
    It stays for the attack studies (run in eval mode); to guard a ResNet-18 use ``resnet18_gn``, the
    same network with GroupNorm (what ``flguard.fix_model`` makes of this one)."""
    from torchvision.models import resnet18

    if image_size < 8:
        raise ValueError(f"model 'resnet18': image_size={image_size} is too small (need at least 8)")
    model = resnet18(weights=None, num_classes=num_classes)
    model.conv1 = nn.Conv2d(in_channels, 64, kernel_size=3, stride=1, padding=1, bias=False)
    model.maxpool = nn.Identity()
    return model


_BUILDERS: dict[str, Callable[[int, int, int], nn.Module]] = {
    "cnn": QuickstartCNN,
    "dropout_cnn": DropoutCNN,
    "lstm_rows": RowLSTM,
    "conv1d_rows": RowConv1d,
    "lenet": _lenet,
    **{name: _cnn(name) for name in CNN_VARIANTS},
    "mlp": _mlp,
    "linear": _linear,
    "resnet18": _resnet18,
    "resnet18_gn": resnet18_gn,
    "resnet20_gn": resnet20_gn,
    "resnet8_gn": resnet8_gn,
}
MODEL_NAMES = tuple(_BUILDERS)


def create(name: str, *, in_channels: int = 3, num_classes: int = 10, image_size: int = 32,
           init: str = "default") -> nn.Module:
    """Build model ``name`` for ``in_channels`` x ``image_size`` x ``image_size`` inputs.

    Raises ``ValueError`` naming the argument when the name, init or geometry is not usable.
    """
    if name not in _BUILDERS:
        raise ValueError(f"model name={name!r} is unknown; choose one of {', '.join(MODEL_NAMES)}")
    for field, value in (("in_channels", in_channels), ("num_classes", num_classes), ("image_size", image_size)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"model {name!r}: {field}={value!r} must be a positive integer")
    if num_classes < 2:
        raise ValueError(f"model {name!r}: num_classes={num_classes} must be at least 2")
    model = _BUILDERS[name](in_channels, num_classes, image_size)
    return initialize(model, init)


def conv_specs(name: str) -> tuple[ConvSpec, ...]:
    """The convolution specs of a sequential conv model (``lenet`` or a CNN variant)."""
    if name == "lenet":
        return LENET_CONVS
    if name in CNN_VARIANTS:
        return CNN_VARIANTS[name]
    raise ValueError(f"model {name!r} is not a sequential conv net with a spec table")


def num_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)
