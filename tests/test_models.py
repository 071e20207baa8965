"""Model zoo: shapes, the published FC widths, parameter counts and initialisations."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from flguard.models import MODEL_NAMES, create


# Chen & Campbell Table 1: (kernel, channels, stride, padding) per conv layer, FC input width.
TABLE_1 = {
    "cnn2_v1": ([(3, 6, 1, 0)], 5400),
    "cnn2_v2": ([(4, 6, 2, 0)], 1350),
    "cnn3_v1": ([(3, 6, 1, 0), (4, 3, 2, 0)], 588),
    "cnn3_v2": ([(4, 6, 2, 0), (3, 3, 2, 0)], 147),
    "cnn3_v3": ([(3, 6, 1, 0), (3, 9, 1, 0)], 7056),
    "cnn3_v4": ([(3, 1, 1, 0), (3, 6, 1, 0)], 4704),
    "cnn4_v1": ([(3, 6, 1, 0), (4, 5, 2, 0), (4, 3, 1, 0)], 363),
    "cnn4_v2": ([(5, 16, 1, 0), (5, 6, 2, 0), (5, 32, 1, 2)], 4608),
}


@pytest.mark.parametrize("name", MODEL_NAMES)
@pytest.mark.parametrize("geometry", [(1, 28), (1, 25), (3, 32)])
def test_every_model_runs_on_every_dataset_geometry(name, geometry):
    channels, size = geometry
    model = create(name, in_channels=channels, image_size=size, num_classes=7).eval()
    assert model(torch.rand(2, channels, size, size)).shape == (2, 7)


@pytest.mark.parametrize("name", sorted(TABLE_1))
def test_cnn_variants_match_table_1(name):
    layers, width = TABLE_1[name]
    model = create(name)
    convs = [m for m in model.modules() if isinstance(m, nn.Conv2d)]
    assert [(c.kernel_size[0], c.out_channels, c.stride[0], c.padding[0]) for c in convs] == layers
    assert all(c.bias is None for c in convs)
    assert sum(isinstance(m, nn.Tanh) for m in model.modules()) == len(layers)
    fc = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert len(fc) == 1 and fc[0].in_features == width and fc[0].bias is not None
    # parameters: conv weights k²·c_in·c_out (no bias) + FC width·10 + 10
    c_in, expected = 3, 0
    for kernel, channels, _, _ in layers:
        expected += kernel * kernel * c_in * channels
        c_in = channels
    expected += width * 10 + 10
    assert sum(p.numel() for p in model.parameters()) == expected


def test_lenet_is_the_i2f_lenet():
    model = create("lenet", in_channels=3, image_size=32)
    convs = [m for m in model.modules() if isinstance(m, nn.Conv2d)]
    assert [(c.in_channels, c.out_channels, c.kernel_size[0]) for c in convs] == [(3, 12, 5)] + [(12, 12, 5)] * 3
    assert sum(isinstance(m, nn.Sigmoid) for m in model.modules()) == 4
    fc = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert fc[0].in_features == 12 * 8 * 8  # strides 2, 2, 1, 1 with padding 2 on 32×32


def _weights(model):
    return torch.cat([m.weight.reshape(-1) for m in model.modules() if isinstance(m, (nn.Conv2d, nn.Linear))])


@pytest.mark.parametrize("channels,size,classes", [(3, 32, 10), (1, 28, 10), (1, 25, 2)])
def test_cnn_is_the_flower_quickstart_shape(channels, size, classes):
    """Parameter count from the quickstart's layer list, written out by hand: conv 5×5 ×6, pool,
    conv 5×5 ×16, pool, FC 120, 84, classes (CIFAR-10: the quickstart's own 62,006)."""
    side = ((size - 4) // 2 - 4) // 2
    expected = (channels * 6 * 25 + 6) + (6 * 16 * 25 + 16) + (16 * side * side * 120 + 120) \
        + (120 * 84 + 84) + (84 * classes + classes)
    model = create("cnn", in_channels=channels, image_size=size, num_classes=classes)
    assert sum(p.numel() for p in model.parameters()) == expected
    if (channels, size, classes) == (3, 32, 10):
        assert expected == 62006
    kinds = [type(m).__name__ for m in model.modules()][1:]
    assert kinds == ["Conv2d", "Conv2d", "MaxPool2d", "Linear", "Linear", "Linear"]
    with pytest.raises(ValueError, match="'cnn': image_size=12 is too small"):
        create("cnn", image_size=12)


def test_uniform_and_normal_inits():
    torch.manual_seed(0)
    model = create("cnn2_v1", init="uniform")
    values = torch.cat([p.reshape(-1) for p in model.parameters()])
    assert values.min() >= -0.5 and values.max() <= 0.5
    assert abs(values.var().item() - 1 / 12) < 0.003  # U(-0.5, 0.5) has variance 1/12
    normal = _weights(create("cnn2_v1", init="normal"))
    assert abs(normal.var().item() - 0.5) < 0.02


def test_kaiming_and_xavier_variances():
    torch.manual_seed(0)
    fc = [m for m in create("mlp", init="kaiming").modules() if isinstance(m, nn.Linear)][0]
    assert abs(fc.weight.var().item() - 2 / fc.in_features) < 0.05 * 2 / fc.in_features
    assert torch.all(fc.bias == 0)
    fc = [m for m in create("mlp", init="xavier").modules() if isinstance(m, nn.Linear)][0]
    expected = 2 / (fc.in_features + fc.out_features)
    assert abs(fc.weight.var().item() - expected) < 0.05 * expected


def test_clear_errors():
    with pytest.raises(ValueError, match="image_size=4 is too small"):
        create("cnn4_v2", image_size=4)
    with pytest.raises(ValueError, match="name='lenett' is unknown"):
        create("lenett")
    with pytest.raises(ValueError, match="init='he' is not supported"):
        create("lenet", init="he")
    with pytest.raises(ValueError, match="in_channels=0"):
        create("lenet", in_channels=0)


def test_default_init_leaves_pytorch_defaults():
    torch.manual_seed(0)
    a = create("linear", in_channels=1, image_size=8)
    torch.manual_seed(0)
    b = nn.Sequential(nn.Flatten(), nn.Linear(64, 10))
    assert torch.equal(a[1].weight, b[1].weight) and torch.equal(a[1].bias, b[1].bias)
