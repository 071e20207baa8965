"""``max_psnr``: the floor in pixel PSNR, converted to input units and the pixel box, checked densely.

The conversion is checked by arithmetic; the promise by a dense float64 recomputation
(``torch.linalg.solve`` on autograd Jacobians): every sample's clipped predicted error, mapped
back to pixels channel by channel, has PSNR ≤ max_psnr.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from flguard import Guard, GuardConfig
from flguard.config import ConfigError
from flguard.guard.config import DEFAULT_MAX_PSNR, DEFAULT_MIN_RMSE
from risk_reference import dense_jacobians

MEAN, STD = (0.5, 0.4), (0.2, 0.3)


def _problem(batch: int, seed: int = 0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Conv2d(2, 3, 3), nn.Tanh(), nn.Flatten(), nn.Linear(3 * 4 * 4, 3)).double()
    pixels = torch.rand(batch, 2, 6, 6, dtype=torch.float64)
    pixels[:, :, :2] = 0.0  # a black background on the box's lower face
    mean, std = torch.tensor(MEAN).view(1, 2, 1, 1), torch.tensor(STD).view(1, 2, 1, 1)
    x = ((pixels - mean) / std).double()
    y = torch.randint(0, 3, (batch,))
    jac, g = dense_jacobians(model, x, y)
    return model, x, y, jac, g, mean.double(), std.double()


def test_floor_and_box_conversion():
    cfg = GuardConfig(max_psnr=20.0, pixel_mean=MEAN, pixel_std=STD)
    assert cfg.min_rmse is None
    assert cfg.floor == pytest.approx(0.1 / 0.2)  # 10^(−20/20) over the smallest std
    low, high = cfg.bounds
    assert low == pytest.approx((-2.5, -0.4 / 0.3)) and high == pytest.approx((2.5, 0.6 / 0.3))
    scalar = GuardConfig(max_psnr=30.0, pixel_mean=0.1307, pixel_std=0.3081)
    assert scalar.floor == pytest.approx(10 ** -1.5 / 0.3081)
    assert scalar.bounds == pytest.approx((-0.1307 / 0.3081, 0.8693 / 0.3081))
    explicit = GuardConfig(max_psnr=30.0, pixel_mean=0.0, pixel_std=1.0, input_bounds="batch")
    assert explicit.bounds == "batch"
    assert GuardConfig().floor == GuardConfig().min_rmse == DEFAULT_MIN_RMSE == pytest.approx(10 ** (-15 / 20))
    # the default floor is 15 dB: with the normalisation given it is max_psnr, with its pixel box
    normalised = GuardConfig(pixel_mean=0.1307, pixel_std=0.3081)
    assert normalised.max_psnr == DEFAULT_MAX_PSNR == 15.0 and normalised.min_rmse is None
    assert normalised.floor == pytest.approx(10 ** (-15 / 20) / 0.3081)
    assert normalised.bounds == pytest.approx((-0.1307 / 0.3081, 0.8693 / 0.3081))
    assert GuardConfig().bounds is None and GuardConfig(min_rmse=0.2).floor == 0.2


@pytest.mark.parametrize("kwargs, words", [
    (dict(min_rmse=0.1, max_psnr=20.0, pixel_mean=0.0, pixel_std=1.0), ("min_rmse", "max_psnr")),
    (dict(max_psnr=20.0), ("pixel_mean", "pixel_std")),
    (dict(max_psnr=20.0, pixel_mean=0.0, pixel_std=0.0), ("pixel_std",)),
    (dict(max_psnr=20.0, pixel_mean=(0.0, 0.1, 0.2), pixel_std=(1.0, 1.0)), ("pixel_mean", "pixel_std")),
    (dict(max_psnr=math.inf, pixel_mean=0.0, pixel_std=1.0), ("max_psnr",)),
])
def test_configuration_errors_name_the_fields(kwargs, words):
    with pytest.raises(ConfigError) as error:
        GuardConfig(**kwargs)
    assert all(word in str(error.value) for word in words)


def test_assigning_max_psnr_replaces_the_default_floor():
    cfg = GuardConfig(pixel_mean=0.0, pixel_std=0.5)
    cfg.max_psnr = 20.0
    assert cfg.min_rmse is None and cfg.floor == pytest.approx(0.2)


@pytest.mark.parametrize("defense", ["gaussian", "eigen"])
def test_pixel_psnr_floor_holds_under_dense_recomputation(defense):
    psnr = 18.0
    model, x, y, jac, g, mean, std = _problem(3)
    out = Guard(GuardConfig(defense=defense, max_psnr=psnr, pixel_mean=MEAN, pixel_std=STD, seed=1,
                            max_rel_noise=1e4)).protect(model, x, y, g)
    assert out.report.met and out.gradient is not None
    delta = out.gradient - g
    kernel = jac @ jac.transpose(1, 2)
    eye = torch.eye(jac.shape[1], dtype=jac.dtype)
    eps = out.report.eps.view(-1, 1, 1)
    shift = torch.linalg.solve(kernel + eps * eye, (jac @ delta).unsqueeze(-1)).squeeze(-1).view_as(x)
    pixels = x * std + mean
    reconstruction = torch.clamp((x + shift) * std + mean, 0.0, 1.0)  # the attacker clips to the pixel box
    mse = (reconstruction - pixels).flatten(1).pow(2).mean(1)
    achieved = 10 * torch.log10(1.0 / mse)
    assert torch.all(achieved <= psnr), achieved
