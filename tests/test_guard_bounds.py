"""The guard with ``input_bounds``: the floor holds for the box-clipped first-order reconstruction.

Recomputed independently with dense float64 Jacobians: Δx = (K + εI)⁻¹Jδ by ``torch.linalg.solve``,
then clip(x + Δx) − x, whose RMSE must be ≥ τ for every sample; the same seed without bounds
sends less noise; a box that leaves no room for the error withholds the update.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from flguard import Guard, GuardConfig
from flguard.config import ConfigError
from risk_reference import dense_jacobians, assert_reported_rmse
from guard_settings import unclipped

TAU = 0.3
BOX = (-1.0, 1.5)


def _problem(batch: int, seed: int = 0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Conv2d(1, 3, 3), nn.Sigmoid(), nn.Flatten(), nn.Linear(3 * 4 * 4, 3)).double()
    x = torch.rand(batch, 1, 6, 6, dtype=torch.float64) * 2.5 - 1.0  # inside the box
    x[:, :, :2] = -1.0  # a "background" on the lower bound, as in MNIST
    y = torch.randint(0, 3, (batch,))
    jac, g = dense_jacobians(model, x, y)
    return model, x, y, jac, g


def _dense_clipped_rmse(jac, x, delta, eps, box):
    kernel = jac @ jac.transpose(1, 2)
    eye = torch.eye(jac.shape[1], dtype=jac.dtype)
    shift = torch.linalg.solve(kernel + eps.view(-1, 1, 1) * eye, (jac @ delta).unsqueeze(-1)).squeeze(-1)
    flat = x.flatten(1)
    clipped = torch.clamp(flat + shift, *box) - flat
    return clipped.norm(dim=1) / jac.shape[1] ** 0.5, shift.norm(dim=1) / jac.shape[1] ** 0.5


@pytest.mark.parametrize("defense", ["gaussian", "eigen"])
@pytest.mark.parametrize("batch", [1, 3])
def test_box_aware_floor_holds_under_dense_recomputation(defense, batch):
    model, x, y, jac, g = _problem(batch)
    boxed = Guard(unclipped(defense=defense, min_rmse=TAU, seed=3, input_bounds=BOX)).protect(model, x, y, g)
    assert boxed.report.met and boxed.gradient is not None
    clipped, unboxed = _dense_clipped_rmse(jac, x, boxed.gradient - g, boxed.report.eps, BOX)
    assert torch.all(clipped >= TAU), clipped
    assert_reported_rmse(boxed.report, clipped, rtol=2e-3)
    assert float(clipped.min()) <= TAU * 1.01  # just enough for the tightest sample
    assert torch.all(unboxed >= clipped)
    plain = Guard(unclipped(defense=defense, min_rmse=TAU, seed=3)).protect(model, x, y, g)
    assert plain.report.met and boxed.report.noise_norm > plain.report.noise_norm  # the box costs noise


def test_per_channel_bounds_and_unreachable_floors():
    model, x, y, _, g = _problem(2)
    per_channel = Guard(unclipped(defense="gaussian", min_rmse=TAU, seed=0, input_bounds=((-1.0,), (1.5,))))
    scalar = Guard(unclipped(defense="gaussian", min_rmse=TAU, seed=0, input_bounds=BOX))
    torch.testing.assert_close(per_channel.protect(model, x, y, g).gradient, scalar.protect(model, x, y, g).gradient)
    wrong = Guard(unclipped(defense="gaussian", min_rmse=TAU, input_bounds=((-1.0, -1.0), (1.5, 1.5))))
    out = wrong.protect(model, x, y, g)
    assert out.gradient is None and "channel" in out.report.reason
    # The clipped error of a pixel can never exceed its distance to the box: an RMSE floor above the
    # box's diameter is unreachable at any noise, so the update stays on the client.
    far = Guard(unclipped(defense="eigen", min_rmse=3.0, input_bounds=BOX, max_rel_noise=1e6)).protect(model, x, y, g)
    assert far.gradient is None and not far.report.met and "input_bounds" in far.report.reason
    with pytest.raises(ConfigError, match="input_bounds"):
        unclipped(input_bounds=(1.0, -1.0))


@pytest.mark.parametrize("bounds", [None, BOX])
def test_gaussian_floor_keeps_an_isotropic_part_that_meets_its_share_alone(bounds):
    model, x, y, jac, g = _problem(2)
    cfg = dict(defense="eigen", min_rmse=TAU, seed=5, input_bounds=bounds)
    floored = Guard(unclipped(gaussian_floor=0.5, **cfg)).protect(model, x, y, g)
    assert floored.report.met
    assert floored.report.details["rmse_gaussian_part"] >= 0.5 * TAU
    if bounds is None:
        lam_max = torch.linalg.eigvalsh(jac @ jac.transpose(1, 2))[:, -1]
        dense = _dense_clipped_rmse(jac, x, floored.gradient - g, 1e-2 * lam_max, (-1e9, 1e9))[0]
    else:
        dense = _dense_clipped_rmse(jac, x, floored.gradient - g, floored.report.eps, BOX)[0]
    assert torch.all(dense >= TAU), dense
    assert_reported_rmse(floored.report, dense, rtol=2e-3)
    pure = Guard(unclipped(**cfg)).protect(model, x, y, g)
    gauss = Guard(unclipped(**{**cfg, "defense": "gaussian"})).protect(model, x, y, g)
    assert pure.report.noise_norm < floored.report.noise_norm < 1.5 * gauss.report.noise_norm


def test_batch_bounds_are_the_data_range_per_channel():
    model, x, y, jac, g = _problem(3)
    box = (float(x.min()), float(x.max()))
    batch = Guard(unclipped(defense="gaussian", min_rmse=TAU, seed=1, input_bounds="batch")).protect(model, x, y, g)
    fixed = Guard(unclipped(defense="gaussian", min_rmse=TAU, seed=1, input_bounds=box)).protect(model, x, y, g)
    torch.testing.assert_close(batch.gradient, fixed.gradient)
    clipped = _dense_clipped_rmse(jac, x, batch.gradient - g, batch.report.eps, box)[0]
    assert batch.report.met and torch.all(clipped >= TAU)


def test_box_scale_is_not_judged_only_at_the_budget_limit():
    """The clipped error saturates at the box while the CG slack grows with the scale, so the
    verified bound can fail at the budget's limit yet hold at a far smaller scale (this withheld
    every update of a trained CNN before): the scale found must be the small one, and verified."""
    from flguard.guard.floor import box_scale

    x = torch.zeros(1, 4, dtype=torch.float64)
    shift = torch.ones(1, 4, dtype=torch.float64)  # unit RMSE per unit scale; box half-width 1
    low, high = torch.full_like(x, -1.0), torch.full_like(x, 1.0)
    scale, rmse, reachable = box_scale(x, shift, low, high, 0.5, 1e-3, 0.1, 1e6)
    assert reachable and 0.5 < scale < 0.51
    assert float(rmse.min()) - 1e-3 * scale >= 0.5 * (1 + 1e-3)  # the rigorous bound holds at the scale returned
    assert not box_scale(x, shift, low, high, 1.5, 1e-3, 0.1, 1e6)[2]  # beyond the box: unreachable
