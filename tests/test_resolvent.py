"""Resolvent noise (Σ_i J_iᵀv_i/ι_i, v_i ≈ (K_i+ε_iI)⁻¹z_i on a Lanczos run's Krylov space) against dense float64
blocks."""

from __future__ import annotations

import importlib

import pytest
import torch
from torch import nn

from flguard import Guard
from flguard.defenses.base import DefenseContext
from flguard.defenses.resolvent import (FILTER_STEPS, NORM_STEPS, chosen_resolvent, krylov_resolvent, own_solution, resolvent,
                                        run_steps)
from flguard.guard.config import GuardConfig
from flguard.risk.clipped import ClippedJacobian
from flguard.risk.lanczos import lanczos
from flguard.risk.operator import JacobianOperator
from flguard.risk.regularised import RegularisedK
from guard_settings import unclipped
from risk_reference import dense_jacobians


def _krylov_basis(matrix: torch.Tensor, start: torch.Tensor, steps: int) -> torch.Tensor:
    """An orthonormal basis (QR) of span{z, Az, …, A^(steps−1)z}."""
    columns = [start]
    for _ in range(steps - 1):
        columns.append(matrix @ columns[-1])
    return torch.linalg.qr(torch.stack(columns, dim=1))[0]


def _galerkin(matrix: torch.Tensor, rhs: torch.Tensor, basis: torch.Tensor) -> torch.Tensor:
    """The Galerkin solution of matrix·x = rhs on span(basis): CG's iterate, when the basis is rhs's Krylov space."""
    return basis @ torch.linalg.solve(basis.T @ matrix @ basis, basis.T @ rhs)


def _problem(batch: int = 3, seed: int = 0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Tanh(), nn.Flatten(), nn.Linear(4 * 3 * 3, 5)).double()
    x, y = torch.randn(batch, 3, 5, 5, dtype=torch.float64), torch.arange(batch) % 5
    return model, x, y


MODULE = importlib.import_module("flguard.defenses.resolvent")  # the package binds the name to the function


@pytest.mark.parametrize("choose", ["kernel", "norm", False])
@pytest.mark.parametrize("clipped", [False, True])
@pytest.mark.parametrize("run", ["own", "guard"])
def test_the_direction_is_the_krylov_filtered_noise_scaled_to_unit_own_i2f(clipped, run, choose, monkeypatch):
    """Σ_i J_iᵀv_i/ι_i with v_i the Galerkin solution of (K_i+ε_iI)v = z_i on the k_i-dimensional Krylov space of
    K_i from z_i (CG's iterate) and ι_i the norm of the Galerkin solution of (K_i+ε_iI)w = K_iv_i on the whole
    run's Krylov space — written out from the dense float64 blocks (the clipped operator's blocks s_iJ_iP_i with
    median clipping). ``choose``: k_i the k of 1 … m with the largest ι_i(k) over ‖K_iv_i(k)‖ (``FILTER_CHOICE``
    "kernel", the default) or ‖J_iᵀv_i(k)‖ ("norm"), from the dense blocks; else k_i = FILTER_STEPS (the fixed
    filter). ``own``: the defense's own run of ``run_steps()`` steps, z from the guard's stream; ``guard``: a longer λmax run handed over as the guard does
    (``DefenseContext.spectrum``), z its start."""
    monkeypatch.setattr(MODULE, "CHOOSE_FILTER", bool(choose))
    if choose:
        monkeypatch.setattr(MODULE, "FILTER_CHOICE", choose)
    model, x, y = _problem()
    op = JacobianOperator(model, x, y)
    jac, _ = dense_jacobians(model, x, y)  # [B, dx, dθ]
    if clipped:
        per = op.per_sample_gradients()
        norms = per.norm(dim=1)
        clip = float(norms.median())
        op = ClippedJacobian(op, clip)
        unit = per / norms.unsqueeze(1)
        scale = torch.where(norms > clip, clip / norms, torch.ones_like(norms))
        projection = torch.eye(op.dtheta, dtype=torch.float64) - torch.where(
            (norms > clip).view(-1, 1, 1), unit.unsqueeze(2) * unit.unsqueeze(1), torch.zeros(1, dtype=torch.float64))
        jac = scale.view(-1, 1, 1) * jac @ projection
    kernel = jac @ jac.transpose(1, 2)
    eps = 1e-2 * torch.linalg.eigvalsh(kernel)[:, -1]
    spectrum, steps = None, run_steps()
    if run == "guard":
        steps = run_steps() + 4
        spectrum = RegularisedK(op).lanczos(rtol=0.0, min_iter=steps, max_iter=steps, seed=11)
        start = spectrum.basis[:, 0]
    else:
        start = torch.randn(3, op.dx, generator=torch.Generator().manual_seed(4), dtype=torch.float64)  # the stream's first draw
        start = start / start.norm(dim=1, keepdim=True)  # the run's first vector
    ctx = DefenseContext(op, torch.zeros(op.dtheta, dtype=torch.float64), eps, eps / 1e-2,
                         torch.Generator().manual_seed(4), GuardConfig(defense="resolvent"), spectrum=spectrum)
    got = resolvent(ctx)
    expected = torch.zeros(op.dtheta, dtype=torch.float64)
    own, lengths = [], []
    for i in range(3):
        shifted = kernel[i] + eps[i] * torch.eye(op.dx, dtype=torch.float64)
        whole = _krylov_basis(kernel[i], start[i], steps)
        parts = []  # (ι_i(k) / its noise's weight, k, v_i(k), ι_i(k))
        for k in (range(1, steps + 1) if choose else [FILTER_STEPS]):
            v = _galerkin(shifted, start[i], _krylov_basis(kernel[i], start[i], k))
            iota = _galerkin(shifted, kernel[i] @ v, whole).norm()
            weight = (jac[i].T @ v).norm() if MODULE.FILTER_CHOICE == "norm" else (kernel[i] @ v).norm()
            parts.append((float(iota / weight), k, v, iota))
        ratios = sorted(part[0] for part in parts)
        assert len(ratios) == 1 or ratios[-1] > 1.001 * ratios[-2]  # a clear choice, so rounding cannot flip it
        _, k, v, iota = max(parts, key=lambda part: part[0])
        own.append(iota)
        lengths.append(float(k))
        expected += jac[i].T @ v / iota
    assert got.info["lanczos_steps"] == steps
    assert got.info["filter_steps"].tolist() == lengths
    torch.testing.assert_close(got.info["own_i2f"], torch.stack(own), rtol=1e-6, atol=0)
    torch.testing.assert_close(got.vector, expected, rtol=1e-6, atol=1e-9 * float(expected.abs().max()))


@pytest.mark.parametrize("by", ["norm", "kernel"])
def test_each_sample_filters_on_the_prefix_that_buys_the_most_own_i2f_per_unit_of_its_noise(by):
    """``chosen_resolvent`` on explicit float64 blocks with three spectra — a few large eigenvalues over many far
    below ε (a trained model's shape), log-uniform over three decades (an initialisation's), one outlier over a
    flat bulk: for every k of the 6-step run the dense reference computes v_i(k) (Galerkin on the k-dimensional
    Krylov space from z_i), ι_i(k) (Galerkin on the whole run's space) and, with the dense K_i, the noise's weight
    ‖J_iᵀv_i(k)‖ = (v_iᵀK_iv_i)^½ (``norm``) or ‖K_iv_i(k)‖ (``kernel``, where k = m its part beyond the run counts);
    each sample's k_i is the argmax of ι_i(k) over that weight, and the samples choose differently."""
    torch.manual_seed(0)
    n, m = 40, 6
    spectra = [torch.cat([torch.tensor([1000.0, 400.0, 150.0]), torch.logspace(-3, 0.5, n - 3)]),
               torch.logspace(0, 3, n), torch.cat([torch.tensor([1000.0]), torch.logspace(-1, 1.5, n - 1)])]
    blocks = []
    for values in spectra:
        rotation = torch.linalg.qr(torch.randn(n, n, dtype=torch.float64))[0]
        blocks.append(rotation @ torch.diag(values.double()) @ rotation.T)
    kernel = torch.stack(blocks)
    start = torch.randn(3, n, dtype=torch.float64)
    run = lanczos(lambda u: torch.einsum("bij,bj->bi", kernel, u), 3, n, like=start, rtol=0.0, min_iter=m, max_iter=m,
                  start=start)
    eps = 1e-2 * torch.linalg.eigvalsh(kernel)[:, -1]
    filtered, own, lengths = chosen_resolvent(run, eps, by)
    for i in range(3):
        shifted = kernel[i] + eps[i] * torch.eye(n, dtype=torch.float64)
        whole = _krylov_basis(kernel[i], start[i], m)
        parts = []
        for k in range(1, m + 1):
            v = _galerkin(shifted, start[i] / start[i].norm(), _krylov_basis(kernel[i], start[i], k))
            iota = _galerkin(shifted, kernel[i] @ v, whole).norm()
            weight = (v @ kernel[i] @ v).sqrt() if by == "norm" else (kernel[i] @ v).norm()
            parts.append((float(iota / weight), k, v, iota))
        ratios = sorted(part[0] for part in parts)
        assert ratios[-1] > 1.001 * ratios[-2]
        _, k, v, iota = max(parts, key=lambda part: part[0])
        assert float(lengths[i]) == k
        torch.testing.assert_close(filtered[i], v, rtol=1e-6, atol=1e-9 * float(v.abs().max()))
        torch.testing.assert_close(own[i], iota, rtol=1e-6, atol=0)
    assert lengths.tolist() == ([4.0, 6.0, 2.0] if by == "norm" else [4.0, 6.0, 3.0])  # the samples choose apart


def test_own_solution_is_the_galerkin_solve_of_each_samples_own_part():
    """``own_solution``: w_i, the Galerkin solution of (K_i+ε_iI)w = K_iv_i on the run's whole Krylov space, written
    out from the dense float64 blocks; its norm is ``krylov_resolvent``'s ι_i."""
    model, x, y = _problem()
    op = JacobianOperator(model, x, y)
    jac, _ = dense_jacobians(model, x, y)
    kernel = jac @ jac.transpose(1, 2)
    eps = 1e-2 * torch.linalg.eigvalsh(kernel)[:, -1]
    steps = FILTER_STEPS + NORM_STEPS + 2
    run = RegularisedK(op).lanczos(rtol=0.0, min_iter=steps, max_iter=steps, seed=5)
    got = own_solution(run, eps, FILTER_STEPS)
    _, own = krylov_resolvent(run, eps, FILTER_STEPS)
    for i in range(3):
        start = run.basis[i, 0]
        shifted = kernel[i] + eps[i] * torch.eye(op.dx, dtype=torch.float64)
        v = _galerkin(shifted, start, _krylov_basis(kernel[i], start, FILTER_STEPS))
        expected = _galerkin(shifted, kernel[i] @ v, _krylov_basis(kernel[i], start, steps))
        torch.testing.assert_close(got[i], expected, rtol=1e-6, atol=1e-9 * float(expected.abs().max()))
    torch.testing.assert_close(got.norm(dim=1), own, rtol=1e-10, atol=0)


def test_the_guard_hands_its_lambda_max_run_over_and_the_direction_costs_one_transposed_product():
    """In the guard the filter comes from the λmax run (at least ``run_steps()`` steps): the resolvent
    step spends the run, one summed Jᵀ product and the floor's solve — no run or solve of its own."""
    model, x, y = _problem(4)
    g = torch.cat([t.reshape(-1) for t in torch.autograd.grad(
        nn.functional.cross_entropy(model(x), y), list(model.parameters()))])
    calls = []
    original = resolvent.__globals__["RegularisedK"].lanczos

    def counted(self, **kwargs):
        calls.append(kwargs)
        return original(self, **kwargs)

    resolvent.__globals__["RegularisedK"].lanczos = counted
    try:
        out = Guard(unclipped(defense="resolvent", min_rmse=0.05, seed=0)).protect(model, x, y, g)
    finally:
        resolvent.__globals__["RegularisedK"].lanczos = original
    assert out.report.met, out.report.reason
    assert len(calls) == 1 and calls[0]["min_iter"] == run_steps()  # the guard's run only
    assert calls[0]["start"] is not None and calls[0]["start"].shape == x.flatten(1).shape  # z from the guard's stream
    assert out.report.details["lanczos_steps"] >= run_steps()


def test_resolvent_draws_from_the_guard_stream():
    model, x, y = _problem(2)
    op = JacobianOperator(model, x, y)
    eps = torch.full((2,), 1e-3, dtype=torch.float64)

    def draw(seed: int) -> torch.Tensor:
        return resolvent(DefenseContext(op, torch.zeros(op.dtheta, dtype=torch.float64), eps, eps,
                                        torch.Generator().manual_seed(seed), GuardConfig(defense="resolvent"))).vector
    torch.testing.assert_close(draw(5), draw(5))
    assert not torch.allclose(draw(5), draw(6))


def test_a_sample_whose_jacobian_is_zero_gets_no_noise_of_its_own_and_an_all_zero_batch_fails():
    """ι_i = 0 (K_i = 0) would divide by zero: that sample's part is dropped (the verification decides about it);
    with every K_i zero there is no direction at all, and the defense says so instead of sending zeros."""
    model, x, y = _problem(2)
    op = JacobianOperator(model, x, y)
    eps = torch.full((2,), 1e-3, dtype=torch.float64)

    class OneDead:  # sample 1's block is zero: its products are zeroed
        def __getattr__(self, name):
            return getattr(op, name)

        def kmv(self, u):
            out = op.kmv(u)
            out[1] = 0
            return out

        def jt_sum(self, u):
            assert bool((u[1] == 0).all())  # no part of its own
            return op.jt_sum(u)

    ctx = DefenseContext(OneDead(), torch.zeros(op.dtheta, dtype=torch.float64), eps, eps,
                         torch.Generator().manual_seed(1), GuardConfig(defense="resolvent"))
    out = resolvent(ctx)
    assert bool(out.vector.any()) and float(out.info["own_i2f"][1]) == 0.0

    class AllDead(OneDead):
        def kmv(self, u):
            return torch.zeros_like(u)

    with pytest.raises(RuntimeError, match="no sample's Jacobian"):
        resolvent(DefenseContext(AllDead(), torch.zeros(op.dtheta, dtype=torch.float64), eps, eps,
                                 torch.Generator().manual_seed(1), GuardConfig(defense="resolvent")))


def test_resolvent_needs_less_noise_than_the_gaussian_and_than_unscaled_rowspace_noise():
    """Where dθ ≫ dx the Gaussian wastes most of its norm in J's null space; row-space noise, summed without
    a per-sample scale, lets the samples with the largest blocks take it. The resolvent's per-sample scale
    (each part at unit I²F on its own sample) gives the least protected sample its share: on this batch,
    whose samples' input scales differ by 10×, it meets the same verified floor with less noise than both."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 4)).double()  # dθ = 1,348, dx = 16
    x = torch.randn(4, 1, 4, 4, dtype=torch.float64) * torch.tensor([0.3, 1.0, 3.0, 1.0], dtype=torch.float64).view(-1, 1, 1, 1)
    y = torch.tensor([0, 1, 2, 3])
    g = torch.cat([t.reshape(-1) for t in torch.autograd.grad(
        nn.functional.cross_entropy(model(x), y), list(model.parameters()))])
    noise = {}
    for defense in ("gaussian", "rowspace", "resolvent"):
        norms = []
        for seed in range(3):
            out = Guard(unclipped(defense=defense, min_rmse=0.05, seed=seed)).protect(model, x, y, g)
            assert out.report.met, out.report.reason
            norms.append(out.report.noise_norm)
        noise[defense] = sum(norms) / len(norms)
    assert noise["resolvent"] < 0.25 * noise["gaussian"], noise
    assert noise["resolvent"] < 0.5 * noise["rowspace"], noise
