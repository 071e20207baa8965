"""Row-space noise (Σ J_iᵀz_i) and the summed transpose product behind it, against dense float64 Jacobians."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

from flguard import Guard
from flguard.defenses.rowspace import rowspace
from flguard.models import create
from flguard.risk.clipped import ClippedJacobian
from flguard.risk.operator import JacobianOperator
from guard_settings import unclipped
from risk_reference import dense_jacobians


def _resnet_batch(batch: int = 4):
    torch.manual_seed(0)
    model = create("resnet8_gn", image_size=6).double()
    x = torch.randn(batch, 3, 6, 6, dtype=torch.float64).to(memory_format=torch.channels_last)
    y = torch.arange(batch) % 10
    return model, x, y


@functools.cache
def _resnet_jacobians() -> torch.Tensor:
    """The dense blocks of ``_resnet_batch()`` (5,214 autograd calls: built once for the module)."""
    return dense_jacobians(*_resnet_batch())[0]


@pytest.mark.parametrize("products,chunk", [("cached", None), ("cached", 0), ("direct", 2), ("direct", 1)])
def test_jt_sum_is_the_sum_of_the_dense_transposed_blocks(products, chunk, monkeypatch):
    """Σ_i J_iᵀu_i from reverse-over-reverse passes equals the dense blocks' Σ_i J_i[dx, dθ]ᵀu_i on a
    channels-last GroupNorm ResNet, and the per-sample ``jt`` rows summed; one application charged. On
    the direct path the passes run two samples at a time, or one at a time with plain autograd (as a
    ResNet-18's on the CPU); on the cached path, once a product has built Jᵀ's pullback, through it — and the
    K product, whose Jᵀ rows reach J's pullback per parameter (or, chunk 0: above ``TREE_ROWS_UP_TO``, as one
    [B, dθ]), is the dense J_iJ_iᵀu_i, as are J's rows and the per-sample gradients behind them."""
    from flguard.risk import operator, sizing

    model, x, y = _resnet_batch()
    if products == "direct":
        monkeypatch.setattr(sizing, "DIRECT_CHUNK_FLOATS", chunk * sum(p.numel() for p in model.parameters()))
    if chunk == 0:
        monkeypatch.setattr(operator, "TREE_ROWS_UP_TO", 0)
    op = JacobianOperator(model, x, y, products=products)
    if products == "direct":
        assert op.direct and op.sample_chunk == chunk and op.one_at_a_time == (chunk == 1)
    u = torch.randn(4, op.dx, dtype=torch.float64)
    jac = _resnet_jacobians()
    expected = torch.einsum("bap,ba->p", jac, u)
    torch.testing.assert_close(op.jt_sum(u), expected, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(op.jt(u.unsqueeze(1)).sum((0, 1)), expected, rtol=1e-9, atol=1e-12)
    assert op.applications == 2
    if products == "cached":
        assert op._cached_transpose is not None
        torch.testing.assert_close(op.jt_sum(u), expected, rtol=1e-9, atol=1e-12)
        kernel = torch.einsum("bap,bcp,bc->ba", jac, jac, u)
        torch.testing.assert_close(op.kmv(u.unsqueeze(1))[:, 0], kernel, rtol=1e-9, atol=1e-12)
        assert op.applications == 5 and op._tree_pullback == (chunk is None)
        v = torch.randn(4, 2, op.dtheta, dtype=torch.float64)
        torch.testing.assert_close(op.j(v), torch.einsum("bap,bkp->bka", jac, v), rtol=1e-9, atol=1e-12)
        by_sample = torch.stack([torch.cat([g.reshape(-1) for g in torch.autograd.grad(
            nn.functional.cross_entropy(model(x[i:i + 1]), y[i:i + 1]), list(model.parameters()))]) for i in range(4)])
        torch.testing.assert_close(op.per_sample_gradients(), by_sample, rtol=1e-10, atol=1e-12)
    with pytest.raises(ValueError, match="shape"):
        op.jt_sum(u.unsqueeze(1))


def test_clipped_jt_sum_projects_each_clipped_sample():
    """With median clipping, Σ_i J̄_iᵀu_i = Σ_i s_iP_iJ_iᵀu_i: the clipped operator's per-sample rows
    summed, and (written out from the dense blocks) s_i(I − ĝ_iĝ_iᵀ)J_iᵀu_i; also for a restricted copy."""
    model, x, y = _resnet_batch()
    op = JacobianOperator(model, x, y)
    norms = op.per_sample_gradients().norm(dim=1)
    clipped = ClippedJacobian(op, float(norms.median()))
    assert 0 < int((norms > clipped.clip).sum()) < 4
    u = torch.randn(4, op.dx, dtype=torch.float64)
    jac = _resnet_jacobians()
    g = op.per_sample_gradients()
    dense = []
    for i in range(4):
        w = jac[i].T @ u[i]
        if norms[i] > clipped.clip:
            unit = g[i] / norms[i]
            w = (clipped.clip / norms[i]) * (w - unit * (unit @ w))
        dense.append(w)
    torch.testing.assert_close(clipped.jt_sum(u), torch.stack(dense).sum(0), rtol=1e-9, atol=1e-12)
    index = torch.tensor([3, 0])
    torch.testing.assert_close(clipped.restricted(index).jt_sum(u[index]), dense[3] + dense[0], rtol=1e-9, atol=1e-12)


def test_rowspace_draws_from_the_guard_stream():
    model, x, y = _resnet_batch(2)
    op = JacobianOperator(model, x, y)
    first = rowspace(op, torch.Generator().manual_seed(5), 1e-2).vector
    again = rowspace(op, torch.Generator().manual_seed(5), 1e-2).vector
    other = rowspace(op, torch.Generator().manual_seed(6), 1e-2).vector
    torch.testing.assert_close(first, again)
    assert not torch.allclose(first, other)
    assert first.shape == (op.dtheta,)


def test_rowspace_needs_less_noise_than_the_gaussian_where_parameters_outnumber_inputs():
    """Where dθ ≫ dx (almost all of parameter space is J's null space) isotropic noise wastes most of
    its norm; row-space noise does not. Both meet the same floor under the guard's verification."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 4)).double()  # dθ = 1,348, dx = 16
    x, y = torch.randn(3, 1, 4, 4, dtype=torch.float64), torch.tensor([0, 1, 2])
    g = torch.cat([t.reshape(-1) for t in torch.autograd.grad(
        nn.functional.cross_entropy(model(x), y), list(model.parameters()))])
    noise = {}
    for defense in ("gaussian", "rowspace"):
        out = Guard(unclipped(defense=defense, min_rmse=0.05, seed=1)).protect(model, x, y, g)
        assert out.report.met, out.report.reason
        noise[defense] = out.report.noise_norm
    assert noise["rowspace"] < 0.25 * noise["gaussian"], noise


def test_the_scale_grid_reaches_the_budget_despite_a_sample_that_moves_1e20_times_more():
    """A fitted sample with λmax near 0 has an enormous I²F shift; the grid of scales at which samples are
    left out must still cover the scales just below the budget, where the others certify."""
    from flguard.guard.floor import MAX_SCALES, SCALE_STEP, scale_grid

    shift = torch.tensor([[1e20, 0.0], [1.0, 0.0], [0.5, 0.0]], dtype=torch.float64)
    grid = scale_grid(shift, 1.0, 10.0)
    assert grid[-1] == 10.0 and len(grid) <= MAX_SCALES + 1
    assert min(grid) >= 10.0 * SCALE_STEP ** -(MAX_SCALES - 1) * (1 - 1e-12)
    near = [c for c in grid if 2.0 <= c <= 10.0]  # the scales where samples 1 and 2 reach the target linearly
    assert len(near) >= 8


def test_the_rowspace_direction_is_the_gain_filtered_input_noise_mapped_to_parameters(monkeypatch):
    """With the filter's solves run to convergence, the direction is Σ_i J_iᵀ(K_i+ε_iI)⁻ᵖz_i written out
    from the dense float64 blocks, ε_i = 1e-2·λmax(K_i) from ``eigvalsh`` and z from the same stream."""
    from flguard.defenses import rowspace as module

    monkeypatch.setattr(module, "FILTER_ITER", 200)
    monkeypatch.setattr(module, "FILTER_RTOL", 1e-10)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 2, 3), nn.Tanh(), nn.Flatten(), nn.Linear(2 * 3 * 3, 3)).double()
    x, y = torch.randn(2, 3, 5, 5, dtype=torch.float64), torch.tensor([0, 2])
    op = JacobianOperator(model, x, y)
    jac, _ = dense_jacobians(model, x, y)
    kernel = jac @ jac.transpose(1, 2)
    eps = 1e-2 * torch.linalg.eigvalsh(kernel)[:, -1]
    z = torch.randn(2, op.dx, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    w = z.unsqueeze(-1)
    shifted = kernel + eps.view(-1, 1, 1) * torch.eye(op.dx, dtype=torch.float64)
    for _ in range(module.FILTER_POWER):
        w = torch.linalg.solve(shifted, w)
    expected = torch.einsum("bap,ba->p", jac, w.squeeze(-1))
    got = rowspace(op, torch.Generator().manual_seed(4), 1e-2).vector
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-8 * float(expected.abs().max()))
