"""Leaving out the samples the budget cannot protect (``max_excluded``), against dense float64 references.

The guard may send a step without its hardest samples instead of withholding it. Checked with
autograd Jacobians and ``torch.linalg.solve``, never the guard's own numbers: the update sent is
exactly the kept samples' (clipped) gradients plus the noise, every kept sample's I²F for that
noise meets τ, every left-out sample is one the budget could not protect, and without
``max_excluded`` (or beyond it) the same step is withheld.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from flguard import Guard, GuardConfig
from flguard.risk.operator import JacobianOperator

from risk_reference import dense_jacobians, tiny_conv_problem
from guard_settings import unclipped

TAU = 0.2


def _problem(batch: int = 4, seed: int = 0):
    return tiny_conv_problem(batch, seed)


def _per_sample(model, x, y) -> torch.Tensor:
    return JacobianOperator(model, x, y).per_sample_gradients() / x.shape[0]  # mean loss: (1/B) g_i


def _shift(jac: torch.Tensor, delta: torch.Tensor, eps: torch.Tensor) -> torch.Tensor:
    kernel = jac @ jac.transpose(1, 2)
    eye = torch.eye(jac.shape[1], dtype=jac.dtype)
    return torch.linalg.solve(kernel + eps.view(-1, 1, 1) * eye, (jac @ delta).unsqueeze(-1)).squeeze(-1)


def _needs(model, x, y, defense: str, seed: int):
    """Per-sample RMSE at a large scale with everything kept: the realised direction and each sample's need."""
    jac, g = dense_jacobians(model, x, y)
    out = Guard(unclipped(defense=defense, min_rmse=TAU, seed=seed, max_rel_noise=1e6)).protect(model, x, y, g)
    assert out.report.met
    delta = out.gradient - g
    rmse = _shift(jac, delta, out.report.eps).norm(dim=1) / x[0].numel() ** 0.5
    need = float(delta.norm()) * TAU / rmse  # noise norm at which each sample's I²F RMSE is τ (linear in the scale)
    return jac, g, need


@pytest.mark.parametrize("defense", ["gaussian", "eigen"])
def test_the_hardest_sample_is_left_out_and_the_rest_meet_the_floor(defense):
    model, x, y = _problem()
    jac, g, need = _needs(model, x, y, defense, seed=3)
    order = need.argsort()
    budget = float((need[order[-1]] + need[order[-2]]) / 2)  # enough for all but the hardest sample
    cfg = dict(defense=defense, min_rmse=TAU, seed=3, max_rel_noise=budget / float(g.norm()))

    withheld = Guard(unclipped(**cfg)).protect(model, x, y, g)
    assert not withheld.report.met and withheld.gradient is None

    out = Guard(unclipped(**cfg, max_excluded=0.25)).protect(model, x, y, g)
    assert out.report.met and out.gradient is not None
    hardest = int(order[-1])
    kept = [i for i in range(len(x)) if i != hardest]
    assert out.report.details["excluded"] == 1
    assert torch.isinf(out.report.rmse_after[hardest])
    delta = out.gradient - _per_sample(model, x, y)[kept].sum(0)  # sent = kept gradients + noise, exactly
    torch.testing.assert_close(float(delta.norm()), out.report.noise_norm)
    assert float(delta.norm()) <= budget * (1 + 1e-9)
    rmse = _shift(jac[kept], delta, out.report.eps[kept]).norm(dim=1) / x[0].numel() ** 0.5
    assert bool((rmse >= TAU).all()), rmse
    # the left-out sample could not have met τ within the budget along this noise's direction
    left = _shift(jac[[hardest]], delta / delta.norm() * budget, out.report.eps[[hardest]])
    assert float(left.norm()) / x[0].numel() ** 0.5 < TAU


def test_beyond_max_excluded_the_step_is_withheld():
    model, x, y = _problem()
    _, g, need = _needs(model, x, y, "gaussian", seed=5)
    order = need.argsort()
    budget = float((need[order[-2]] + need[order[-3]]) / 2)  # the two hardest cannot be protected
    cfg = dict(defense="gaussian", min_rmse=TAU, seed=5, max_rel_noise=budget / float(g.norm()))
    assert Guard(unclipped(**cfg, max_excluded=0.25)).protect(model, x, y, g).gradient is None
    out = Guard(unclipped(**cfg, max_excluded=0.5)).protect(model, x, y, g)
    assert out.report.met and out.report.details["excluded"] == 2
    assert torch.isinf(out.report.rmse_after[order[-2:]]).all()


def test_a_gradient_that_is_not_the_batch_loss_cannot_shed_samples():
    model, x, y = _problem()
    _, g, need = _needs(model, x, y, "gaussian", seed=7)
    budget = float(need.sort().values[-2:].mean())
    cfg = unclipped(defense="gaussian", min_rmse=TAU, seed=7, max_rel_noise=budget / float(g.norm()), max_excluded=0.5)
    out = Guard(cfg).protect(model, x, y, g + 0.1 * g.norm() * torch.randn_like(g) / g.numel() ** 0.5)
    assert out.gradient is None and "not the batch loss's gradient" in out.report.reason


def test_max_excluded_is_validated():
    with pytest.raises(ValueError, match="max_excluded"):
        unclipped(defense="gaussian", max_excluded=1.5)
    with pytest.raises(ValueError, match="max_excluded"):
        unclipped(defense="fixed-gaussian", max_excluded=0.1)


def test_with_the_box_the_kept_samples_meet_the_clipped_floor():
    """With ``input_bounds`` the promise is about the box-clipped error: checked with dense solves."""
    model, x, y = _problem()
    x = x.clamp(-1.0, 1.0)  # many pixels on the box's faces: clipping removes much of their error
    jac, g = dense_jacobians(model, x, y)
    base = dict(defense="gaussian", min_rmse=TAU, seed=11, input_bounds=(-1.0, 1.0))
    full = Guard(unclipped(**base, max_rel_noise=1e6)).protect(model, x, y, g)
    assert full.report.met
    cfg = dict(base, max_rel_noise=0.8 * full.report.noise_norm / float(g.norm()))  # short of the hardest
    assert Guard(unclipped(**cfg)).protect(model, x, y, g).gradient is None
    out = Guard(unclipped(**cfg, max_excluded=0.5)).protect(model, x, y, g)
    assert out.report.met and out.report.details["excluded"] >= 1
    kept = torch.isfinite(out.report.rmse_after)
    delta = out.gradient - _per_sample(model, x, y)[kept].sum(0)
    torch.testing.assert_close(float(delta.norm()), out.report.noise_norm)
    shift = _shift(jac[kept], delta, out.report.eps[kept])
    clipped = (torch.clamp(x[kept] + shift.view_as(x[kept]), -1.0, 1.0) - x[kept]).flatten(1)
    assert bool((clipped.norm(dim=1) / x[0].numel() ** 0.5 >= TAU).all())


def test_a_sample_the_noise_cannot_move_is_left_out_instead_of_failing_the_step():
    """A dead-ReLU sample: J_j = 0, so no noise moves its I²F (the saturated-LFW failure). Without
    ``max_excluded`` the step fails closed; with it that sample alone is left out."""
    torch.manual_seed(1)
    model = nn.Sequential(nn.Flatten(), nn.Linear(16, 6), nn.ReLU(), nn.Linear(6, 3)).double()
    with torch.no_grad():
        model[1].weight.abs_()
        model[1].bias.zero_()
    x = torch.randn(4, 1, 4, 4, dtype=torch.float64)
    x[2] = -5.0  # every first-layer unit is off for this sample: its block J_2 is exactly zero
    y = torch.tensor([0, 1, 2, 1])
    jac, g = dense_jacobians(model, x, y)
    assert float(jac[2].abs().max()) == 0.0 and float(jac[[0, 1, 3]].abs().amax(dim=(1, 2)).min()) > 0
    cfg = dict(defense="gaussian", min_rmse=TAU, seed=4, max_rel_noise=1e6)
    failed = Guard(unclipped(**cfg)).protect(model, x, y, g)
    assert failed.gradient is None and "no measurable effect" in failed.report.reason
    out = Guard(unclipped(**cfg, max_excluded=0.25)).protect(model, x, y, g)
    assert out.report.met and out.report.details["excluded"] == 1 and torch.isinf(out.report.rmse_after[2])
    kept = [0, 1, 3]
    delta = out.gradient - _per_sample(model, x, y)[kept].sum(0)
    torch.testing.assert_close(float(delta.norm()), out.report.noise_norm)
    rmse = _shift(jac[kept], delta, out.report.eps[kept]).norm(dim=1) / x[0].numel() ** 0.5
    assert bool((rmse >= TAU).all()), rmse


@pytest.mark.parametrize("defense", ["auto", "eigen"])
def test_a_negligible_sample_that_cannot_be_certified_is_left_out_without_counting(defense):
    """A well-fitted sample (p = 1 − 4e-24) has a float32 Jacobian too small for a solve to certify:
    the guard withholds the step without exclusion; with ``max_excluded`` even below one sample's
    share it is left out for free (its clipped gradient is < 1% of C) and the others are guarded —
    with eigen too, whose weak directions have no measurable effect on that sample and withheld the step."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(16, 3))
    x, y = torch.randn(4, 1, 4, 4), torch.tensor([0, 1, 2, 1])
    with torch.no_grad():
        # (at p = 1 − 2e-12, ×150, the residual's ball certifies it: its certified I²F is ~1e11·τ)
        x[0] = 300 * (model[1].weight[0] - model[1].weight[1:].mean(0)).view(1, 4, 4)
    g = torch.cat([t.reshape(-1) for t in torch.autograd.grad(nn.functional.cross_entropy(model(x), y),
                                                             list(model.parameters()))])
    cfg = dict(defense=defense, min_rmse=0.5, clip_per_sample="median", max_rel_noise=1e6, rtol=1e-2, seed=0)
    assert Guard(unclipped(**cfg)).protect(model, x, y, g).gradient is None
    out = Guard(unclipped(**cfg, max_excluded=0.2)).protect(model, x, y, g)  # floor(0.2·4) = 0 samples
    assert out.report.met and out.gradient is not None
    assert out.report.details["excluded"] == out.report.details["excluded_negligible"] == 1
    assert torch.isinf(out.report.rmse_after[0]) and bool((out.report.rmse_after[1:] >= 0.5).all())


def test_the_box_certificate_keeps_a_saturated_sample_certified_where_the_lipschitz_one_had_a_window():
    """Box [−1, 1], x = 0, Δx̃ = 1 in every pixel, rtol 0.09, τ = 0.75. Clip's 1-Lipschitz bound
    min(c, 1) − 0.09·4c/4 reaches τ(1 + rtol) = 0.8175 only for c in [0.898, 2.03]: a window that a
    doubling search could step over and that closes at larger noise. Every pixel is saturated past
    c = 1 and un-saturating one costs a perturbation beyond its overshoot c − 1, so the certified
    bound (``flguard.guard.box_bound``) stays above τ from c ≈ 0.9 on; the exclusion's grid finds it."""
    from flguard.guard.floor import scale_grid
    from flguard.guard.exclusion import reachable_at

    x, shift = torch.zeros(1, 1, 4, 4), torch.ones(1, 16)
    bounds, tau, rtol = (torch.tensor(-1.0), torch.tensor(1.0)), 0.75, 0.09
    lipschitz = lambda c: min(c, 1.0) - rtol * c  # noqa: E731  (RMSE of 16 pixels: ‖·‖/4)
    assert lipschitz(0.885) < tau * (1 + rtol) <= lipschitz(1.0) and lipschitz(2.5) < tau * (1 + rtol)
    assert not bool(reachable_at(x, shift, bounds, 0.85, tau, rtol)[0])
    for c in (0.95, 1.0, 2.5, 10.0, 100.0):
        assert bool(reachable_at(x, shift, bounds, c, tau, rtol)[0]), c
    inside = [c for c in scale_grid(shift, tau * (1 + rtol), 10.0) if bool(reachable_at(x, shift, bounds, c, tau, rtol)[0])]
    assert inside and min(inside) < 1.0 and max(inside) == 10.0


@pytest.mark.parametrize("defense", ["gaussian", "rowspace", "resolvent", "eigen"])
def test_negligible_samples_are_left_out_unsolved_and_the_rest_meet_the_floor(monkeypatch, defense):
    """The negligible samples (here the share is raised so that the two smallest gradients count) are
    left out unsolved — skipped by the one-run solve, or eigen run on the other samples alone — free of
    ``max_excluded`` (0: none else may go): the update sent is the other samples' gradients plus the
    noise, each of them meets τ under dense float64 I²F, in fewer products than solving every sample (the shrinking
    products rebuilt at half the rows: on this tiny model a product's fixed cost, ``GhostKmv.overhead_rows``, would
    otherwise have the one-run solve carry the skipped rows as zeros, counted as products)."""
    import flguard.guard.exclusion as exclusion
    import flguard.guard.perturb as perturb
    from flguard.risk.ghost_products import GhostKmv

    monkeypatch.setattr(GhostKmv, "overhead_rows", property(lambda self: 0.0))

    model, x, y = _problem(batch=6, seed=1)
    jac, g = dense_jacobians(model, x, y)
    norms = _per_sample(model, x, y).norm(dim=1)
    order = norms.argsort()
    monkeypatch.setattr(exclusion, "NEGLIGIBLE_SHARE", float((norms[order[1]] + norms[order[2]]) / 2 / norms.max()))
    cfg = unclipped(defense=defense, min_rmse=TAU, seed=3, max_rel_noise=1e6, max_excluded=0.01)
    monkeypatch.setattr(perturb, "SKIP_NEGLIGIBLE", False)
    solved_all = Guard(cfg).protect(model, x, y, g)
    monkeypatch.setattr(perturb, "SKIP_NEGLIGIBLE", True)
    out = Guard(cfg).protect(model, x, y, g)
    assert out.report.met and out.gradient is not None
    left = order[:2].tolist()
    kept = [i for i in range(len(x)) if i not in left]
    assert out.report.details["excluded"] == out.report.details["excluded_negligible"] == 2
    assert bool(torch.isinf(out.report.rmse_after[left]).all())
    delta = out.gradient - _per_sample(model, x, y)[kept].sum(0)  # sent = kept gradients + noise, exactly
    torch.testing.assert_close(float(delta.norm()), out.report.noise_norm)
    rmse = _shift(jac[kept], delta, out.report.eps[kept]).norm(dim=1) / x[0].numel() ** 0.5
    assert bool((rmse >= TAU).all()), rmse
    assert out.report.matvecs < solved_all.report.matvecs, (out.report.matvecs, solved_all.report.matvecs)
