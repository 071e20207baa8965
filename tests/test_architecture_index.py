"""c(M) of seed 002 (Chen & Campbell) Table 1, the sparse conv system, and unsupported models."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from flguard.models import zoo
from flguard.risk.architecture import architecture_index, conv_system, layer_stages, numerical_rank


# Seed 002 Table 1 (3×32×32 inputs): rank deficiency per conv layer and c(M) as printed.
TABLE1 = {
    "cnn2_v1": ([0], 0),
    "cnn2_v2": ([-1470], -1470),
    "cnn3_v1": ([0, -4533], -2266),
    "cnn3_v2": ([-1470, -1050], -1995),
    "cnn3_v3": ([0, 0], 0),
    "cnn3_v4": ([-2146, 0], -2146),
    "cnn4_v1": ([0, -3965, -386], -2772),
    "cnn4_v2": ([0, -9316, 0], -6211),
}




@pytest.mark.parametrize("name", list(TABLE1))
def test_table1_rank_deficiency_and_c(name):
    model = zoo.create(name, init="uniform")
    index = architecture_index(model, (3, 32, 32), seed=0)
    expected_rd, expected_c = TABLE1[name]
    assert index.rank_deficiency == expected_rd
    assert index.generic_rank_deficiency == expected_rd
    assert abs(index.c - expected_c) < 1.0
    assert all(layer.gap > 1e3 for layer in index.layers)  # the numerical rank decision is clear
    assert index.n[0] == 3072 and len(index.fc_inputs) == 1


@pytest.mark.parametrize("name", ["cnn2_v1", "cnn3_v3"])
def test_faces_geometry_keeps_c_zero(name):
    index = architecture_index(zoo.create(name, in_channels=1, image_size=25, init="uniform"), (1, 25, 25))
    assert index.c == 0 and index.rank_deficiency == [0] * len(index.layers)


def test_conv_system_matches_autograd():
    """u x = [conv(x) − 0; ∂L/∂W] for a strided, padded, dilated conv and an arbitrary δ."""
    torch.manual_seed(1)
    conv = nn.Conv2d(2, 3, 3, stride=2, padding=1, dilation=2, bias=False).double()
    x = torch.randn(1, 2, 9, 8, dtype=torch.float64)
    z = conv(x)
    delta = torch.randn_like(z)
    dweight, = torch.autograd.grad((z * delta).sum(), conv.weight)
    u = conv_system(conv, (2, 9, 8), conv.weight.detach(), delta[0])
    got = torch.sparse.mm(u, x.reshape(-1, 1)).squeeze(1)
    want = torch.cat([z.detach().reshape(-1), dweight.reshape(-1)])
    torch.testing.assert_close(got, want)


def test_numerical_rank_matches_svd_on_small_systems():
    for name in ["cnn2_v2", "cnn3_v4", "cnn4_v1"]:
        model = zoo.create(name, image_size=14, init="uniform").double()
        stages = layer_stages(model, (3, 14, 14))
        stage = stages[0]
        delta = torch.randn(stage.out_shape, dtype=torch.float64)
        u = conv_system(stage.module, stage.in_shape, stage.module.weight.detach(), delta)
        rank, _ = numerical_rank(u)
        assert rank == int(torch.linalg.matrix_rank(u.to_dense()))


def test_c_weights_layers_by_position():
    index = architecture_index(zoo.create("cnn3_v2", init="uniform"), (3, 32, 32))
    assert index.c == pytest.approx(-1470 + 0.5 * -1050)
    assert not math.isnan(index.generic_c)


@pytest.mark.parametrize("model, reason", [
    (nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 2)), "not invertible"),
    (nn.Sequential(nn.Conv2d(1, 4, 3), nn.Tanh(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(36, 2)), "pooling"),
    (nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.Tanh(), nn.Flatten(), nn.Linear(144, 2)), "normalisation"),
    (zoo.create("resnet18", in_channels=1, image_size=8), "nn.Sequential"),
    (nn.Sequential(nn.Conv2d(1, 4, 3), nn.Tanh(), nn.Conv2d(4, 2, 3), nn.Tanh()), "fully-connected"),
])
def test_unsupported_models_raise(model, reason):
    with pytest.raises(ValueError, match=reason):
        architecture_index(model, (1, 8, 8))
