"""Per-sample clipping before the floor (``clip_per_sample``), checked against dense float64 references.

The reference is the autograd Jacobian of the clipped upload U(X) = (1/B) Σ_i clip_C(g_i(x_i)) itself
(``torch.autograd.functional.jacobian``), never the wrapper's formula: its products must match,
and the realised noise must meet the floor for every sample under I2F of U solved by
``torch.linalg.solve``.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.func import functional_call, grad

from risk_reference import per_sample_gradients, tiny_conv_problem

from flguard import Guard, GuardConfig
from flguard.risk import clipped
from flguard.risk.clipped import ClippedJacobian
from flguard.risk.operator import JacobianOperator

TAU = 0.2


def _problem(batch: int = 3, seed: int = 0):
    return tiny_conv_problem(batch, seed)


def _upload(model, y, clip, clipped=None):
    """x ↦ (1/B) Σ_i clip_C(g_i(x_i)). ``clipped`` (one bool per sample) fixes each sample's branch, as the guard
    decides it (clipped iff ‖g_i‖ > C, from the norms C was taken from): a clip level at the median is one sample's
    own norm, and ``clamp(C/‖g‖, max=1)`` would pick that sample's branch by the last bit of a norm recomputed
    here (PyTorch 2.11 and 2.14 picked differently)."""
    names = [n for n, _ in model.named_parameters()]
    params = {n: p.detach() for n, p in model.named_parameters()}

    def upload(x):
        out = 0
        for i in range(x.shape[0]):
            tree = grad(lambda p: nn.functional.cross_entropy(functional_call(model, p, x[i:i + 1]), y[i:i + 1]))(params)
            g = torch.cat([tree[n].reshape(-1) for n in names])
            if clipped is None:
                out = out + g * torch.clamp(clip / g.norm(), max=1.0)
            else:
                out = out + (g * (clip / g.norm()) if bool(clipped[i]) else g)
        return out / x.shape[0]
    return upload


def _dense(model, x, y, clip):
    """The clipped upload's dense Jacobian [B, dx, dθ] and value, each sample's branch as the guard decides it."""
    clipped = JacobianOperator(model, x, y).per_sample_gradients().norm(dim=1) > clip
    upload = _upload(model, y, clip, clipped)
    jac = torch.autograd.functional.jacobian(upload, x)  # [dθ, B, ...]
    return jac.reshape(jac.shape[0], x.shape[0], -1).permute(1, 2, 0), upload(x)  # [B, dx, dθ]


def _median_norm(model, x, y) -> float:
    return float(JacobianOperator(model, x, y).per_sample_gradients().norm(dim=1).median())


@pytest.mark.parametrize("products, dot_up_to", [("cached", clipped.DOT_PROJECTION_UP_TO), ("cached", 0),
                                                  ("direct", clipped.DOT_PROJECTION_UP_TO),
                                                  ("direct-1", clipped.DOT_PROJECTION_UP_TO)])
def test_clipped_products_match_the_dense_jacobian_of_the_clipped_upload(products, dot_up_to, monkeypatch):
    """Both product paths; on the direct one ``kmv`` is fused per sample (J_i P_i² J_iᵀu_i without the
    batch's [B, k, dθ]), and must equal J̄J̄ᵀ of the dense Jacobian all the same — vmapped, or one sample at a
    time with plain autograd ("direct-1", the projection then on one tensor per parameter). On the cached path the
    projection of one vector per sample takes dot products or, above ``DOT_PROJECTION_UP_TO`` floats, a GEMV."""
    monkeypatch.setattr(clipped, "DOT_PROJECTION_UP_TO", dot_up_to)
    model, x, y = _problem()
    clip = _median_norm(model, x, y)  # some samples clipped, some not
    op = ClippedJacobian(JacobianOperator(model, x, y, products=products.split("-")[0]), clip)
    if products == "direct-1":
        op.op.sample_chunk = 1
    assert op.op.direct == products.startswith("direct") and op.op.one_at_a_time == (products == "direct-1")
    assert (op.op._ghost_kmv() is not None) == (products == "direct-1")  # one at a time: the batched ghost graphs
    assert bool((op.factor < 1).any()) and bool((op.factor == 1).any())
    jac, upload = _dense(model, x, y, clip)
    torch.testing.assert_close(op.gradient, upload)
    v = torch.randn(3, 2, op.dtheta, dtype=torch.float64)
    u = torch.randn(3, 2, op.dx, dtype=torch.float64)
    torch.testing.assert_close(op.j(v), torch.einsum("bxp,bkp->bkx", jac, v))
    torch.testing.assert_close(op.jt(u), torch.einsum("bxp,bkx->bkp", jac, u))
    before = op.applications
    torch.testing.assert_close(op.kmv(u), torch.einsum("bxp,byp,bky->bkx", jac, jac, u))
    assert op.applications - before == 5  # two applications of k = 2 vectors, and the gradients' images J_ig_i once
    one_u, one_v = u[:, :1], v[:, :1]  # one vector per sample: the projection's batched dot products (k > 1: GEMMs)
    before = op.applications
    torch.testing.assert_close(op.kmv(one_u), torch.einsum("bxp,byp,bky->bkx", jac, jac, one_u))
    assert op.applications - before == 2  # the images are taken once per operator
    torch.testing.assert_close(op.jt(one_u), torch.einsum("bxp,bkx->bkp", jac, one_u))
    torch.testing.assert_close(op.j(one_v), torch.einsum("bxp,bkp->bkx", jac, one_v))
    rows = torch.tensor([0, 2])  # a restricted operator (the solvers' shrinking) reads its rows of the same J̄
    sub = op.restricted(rows)
    torch.testing.assert_close(sub.kmv(u[rows]), torch.einsum("bxp,byp,bky->bkx", jac[rows], jac[rows], u[rows]))
    torch.testing.assert_close(sub.j(v[rows]), torch.einsum("bxp,bkp->bkx", jac[rows], v[rows]))
    # restricted before any product: the copy takes the images of its own two samples, on itself (one application of
    # its own), and a copy restricted from it slices them (none); the whole batch's are never taken
    fresh = ClippedJacobian(JacobianOperator(model, x, y, products=products.split("-")[0]), clip)
    fresh.op.sample_chunk = op.op.sample_chunk
    sub = fresh.restricted(rows)
    torch.testing.assert_close(sub.kmv(u[rows]), torch.einsum("bxp,byp,bky->bkx", jac[rows], jac[rows], u[rows]))
    assert sub.applications == 5
    inner = sub.restricted(torch.tensor([1]))  # the batch's row 2
    torch.testing.assert_close(inner.kmv(u[2:3]), torch.einsum("bxp,byp,bky->bkx", jac[2:3], jac[2:3], u[2:3]))
    assert inner.applications == 4 and fresh._images["values"] is None
    plain = JacobianOperator(model, x, y, products=products.split("-")[0])  # no clipping: the mean gradient's
    plain.sample_chunk = op.op.sample_chunk
    jac_plain, _ = _dense(model, x, y, 1e30)
    torch.testing.assert_close(plain.kmv(u), torch.einsum("bxp,byp,bky->bkx", jac_plain, jac_plain, u))


@pytest.mark.parametrize("defense", ["gaussian", "eigen"])
def test_clipped_floor_holds_under_dense_recomputation(defense):
    model, x, y = _problem()
    clip = _median_norm(model, x, y)
    jac, upload = _dense(model, x, y, clip)
    g = _upload(model, y, 1e30)(x)  # the plain batch gradient the caller hands over
    out = Guard(GuardConfig(defense=defense, min_rmse=TAU, seed=2, clip_per_sample=clip,
                            max_rel_noise=1e4)).protect(model, x, y, g)
    assert out.report.met and out.gradient is not None
    delta = out.gradient - upload  # what is sent is the clipped update plus the noise
    torch.testing.assert_close(out.report.noise_norm, float(delta.norm()))
    kernel = jac @ jac.transpose(1, 2)
    eye = torch.eye(jac.shape[1], dtype=jac.dtype)
    shift = torch.linalg.solve(kernel + out.report.eps.view(-1, 1, 1) * eye, (jac @ delta).unsqueeze(-1))
    rmse = shift.squeeze(-1).norm(dim=1) / jac.shape[1] ** 0.5
    assert torch.all(rmse >= TAU), rmse


def test_clipping_budget_is_relative_to_c_and_a_foreign_gradient_fails_closed():
    model, x, y = _problem()
    g = _upload(model, y, 1e30)(x)
    clip = _median_norm(model, x, y)
    tight = Guard(GuardConfig(min_rmse=TAU, seed=2, clip_per_sample=clip, max_rel_noise=1e-6)).protect(model, x, y, g)
    assert tight.gradient is None and not tight.report.met and "budget" in tight.report.reason
    foreign = Guard(GuardConfig(min_rmse=TAU, seed=2, clip_per_sample=clip)).protect(model, x, y, 2 * g)
    assert foreign.gradient is None and "clip_per_sample" in foreign.report.reason


@pytest.mark.parametrize("setting,quantile,rank", [("median", 0.5, 2), ("quantile", 0.5, 2), ("quantile", 0.75, 3),
                                                   ("quantile", 0.9, 3), ("quantile", 1.0, 4)])
def test_the_clip_level_is_the_lower_quantile_of_the_batch_norms(setting, quantile, rank):
    """C is the ``rank``-th smallest per-sample norm (0-based: ⌊q·(B − 1)⌋ of B = 5): what is sent minus the
    dense clipped upload at that C is exactly the reported noise."""
    model, x, y = _problem(batch=5, seed=1)
    norms = JacobianOperator(model, x, y).per_sample_gradients().norm(dim=1)
    clip = float(norms.sort().values[rank])
    g = _upload(model, y, 1e30)(x)
    out = Guard(GuardConfig(min_rmse=TAU, seed=2, clip_per_sample=setting, clip_quantile=quantile,
                            max_rel_noise=1e4)).protect(model, x, y, g)
    assert out.report.met and out.gradient is not None
    torch.testing.assert_close(out.report.noise_norm, float((out.gradient - _upload(model, y, clip)(x)).norm()))


def test_a_clip_quantile_or_retention_outside_zero_to_one_is_refused_naming_the_field():
    for bad in (0.0, 1.5):
        with pytest.raises(ValueError, match="clip_quantile"):
            GuardConfig(clip_per_sample="quantile", clip_quantile=bad)
        with pytest.raises(ValueError, match="clip_retention"):
            GuardConfig(clip_per_sample="retention", clip_retention=bad)


def test_the_retention_clip_level_has_its_closed_form():
    """g_1 = 10·e₁ and three g_i = e₁: the lower median is 1, whose clipped sum 4e₁ keeps 4/13 of g = 13e₁
    along g; a retention above 4/13 takes the next norm up, 10, which clips nothing. A zero batch gradient
    keeps the median."""
    from flguard.guard.clipping import retained_clip_level

    gradients = torch.zeros(4, 3)
    gradients[:, 0] = torch.tensor([10.0, 1.0, 1.0, 1.0])
    assert retained_clip_level(gradients, 1.0, 0.25) == 1.0
    assert retained_clip_level(gradients, 1.0, 4 / 13 - 1e-6) == 1.0
    assert retained_clip_level(gradients, 1.0, 4 / 13 + 1e-6) == 10.0
    assert retained_clip_level(gradients, 1.0, 1.0) == 10.0
    cancelling = torch.tensor([[1.0, 0.0], [-1.0, 0.0], [0.0, 2.0], [0.0, -2.0]])
    assert retained_clip_level(cancelling, 1.0, 0.5) == 1.0


@pytest.mark.parametrize("retention", [0.05, 0.5, 0.9])
def test_the_retention_clip_level_on_a_groupnorm_resnet_matches_a_brute_force_search(retention, monkeypatch):
    """On a 3-channel GroupNorm ResNet (B = 8): C is the smallest per-sample norm from the lower median up whose
    explicitly clipped sum Σ_i g_i·min(1, C/‖g_i‖) — per-sample gradients by autograd, one sample at a time —
    has ⟨·, g⟩ ≥ retention·‖g‖²; what the guard sends minus the dense clipped upload at that C is exactly the
    reported noise. The inner products are taken in blocks of 997 parameters here (the guard's float64 blocks)."""
    from flguard.models import create
    from flguard.risk import sample_gradients

    monkeypatch.setattr(sample_gradients, "ALONG_COLUMNS", 997)
    torch.manual_seed(0)
    model = create("resnet8_gn", image_size=6).double()
    x, y = torch.randn(8, 3, 6, 6, dtype=torch.float64), torch.arange(8) % 10
    per = per_sample_gradients(model, x, y)
    norms, g = per.norm(dim=1), per.sum(dim=0)
    ordered = norms.sort().values
    expected = next(float(c) for c in ordered[3:]  # the lower median of 8 is the 4th smallest
                    if float((per * torch.clamp(c / norms, max=1.0)[:, None]).sum(0) @ g) >= retention * float(g @ g))
    out = Guard(GuardConfig(min_rmse=TAU, seed=2, clip_per_sample="retention", clip_retention=retention,
                            max_rel_noise=1e6, max_excluded=0.0)).protect(model, x, y, g / 8)
    assert out.report.met and out.gradient is not None
    torch.testing.assert_close(out.report.noise_norm, float((out.gradient - _upload(model, y, expected)(x)).norm()))
    assert out.report.details["clip"] == pytest.approx(expected, rel=1e-5)  # the report names C and its rank
    assert out.report.details["clip_share"] == float((norms <= expected * (1 + 1e-6)).double().mean())
    if retention == 0.9:  # the case must not collapse to the median: here it clips fewer samples
        assert expected > float(ordered[3])
