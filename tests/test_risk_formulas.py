"""The formulas written once in risk/ (closed_forms, RegularisedK, hutchinson) against dense references.

Every reference is built independently: J_i column by column with autograd (``risk_reference``),
K_i + εI as a dense matrix, I2F by ``torch.linalg.solve``.
"""

from __future__ import annotations

import torch
from torch import nn

from flguard.risk import JacobianOperator, RegularisedK
from flguard.risk.closed_forms import (from_rmse, i2f_lower_bound, regularised_gain, sigma_for_i2f_lb, to_rmse,
                                       unit_noise_i2f_lb)
from flguard.risk.clipped import ClippedJacobian
from flguard.risk.trace import hutchinson
from risk_reference import dense_jacobians


def _tiny(batch: int = 3, seed: int = 0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3)).double()
    x = torch.randn(batch, 5, dtype=torch.float64)
    y = torch.arange(batch) % 3
    jac, g = dense_jacobians(model, x, y)  # [B, dx=5, dθ=39]
    return model, x, y, jac, g


def _dense_k(jac: torch.Tensor, eps: torch.Tensor) -> torch.Tensor:
    eye = torch.eye(jac.shape[1], dtype=jac.dtype)
    return jac @ jac.transpose(1, 2) + eps.view(-1, 1, 1) * eye


def test_regularised_k_applies_dense_k_plus_eps():
    model, x, y, jac, _ = _tiny()
    eps = torch.tensor([0.3, 1e-3, 2.0], dtype=torch.float64)
    k = RegularisedK(JacobianOperator(model, x, y), eps)
    assert k.shape == (3, 5, 5) and k.dtype == torch.float64 and k.device == x.device
    dense = _dense_k(jac, eps)
    u = torch.randn(3, 5, dtype=torch.float64)
    torch.testing.assert_close(k @ u, torch.einsum("bij,bj->bi", dense, u))
    torch.testing.assert_close(k.matvec(u), k(u))
    many = torch.randn(3, 4, 5, dtype=torch.float64)  # k vectors per sample
    torch.testing.assert_close(k @ many, torch.einsum("bij,bkj->bki", dense, many))
    # without ε it is K itself, and a scalar ε applies to every sample
    plain = torch.einsum("bij,bj->bi", jac @ jac.transpose(1, 2), u)
    torch.testing.assert_close(k.with_eps(None) @ u, plain)
    torch.testing.assert_close(k.with_eps(0.5) @ u, plain + 0.5 * u)


def test_regularised_k_solvers_match_dense_eigh_and_solve():
    model, x, y, jac, _ = _tiny()
    k = RegularisedK(JacobianOperator(model, x, y))
    lam = torch.linalg.eigvalsh(jac @ jac.transpose(1, 2))
    spectrum = k.lanczos(rtol=1e-8, ends="both")
    torch.testing.assert_close(spectrum.lambda_max, lam[:, -1], rtol=1e-6, atol=0)
    eps = 1e-2 * lam[:, -1]
    rhs = torch.randn(3, 5, dtype=torch.float64)
    solved = k.with_eps(eps).solve(rhs, rtol=1e-10)
    reference = torch.linalg.solve(_dense_k(jac, eps), rhs.unsqueeze(-1)).squeeze(-1)
    assert bool(solved.converged.all())
    torch.testing.assert_close(solved.solution, reference, rtol=1e-8, atol=1e-12)


def test_regularised_k_of_the_clipped_upload():
    model, x, y, _, _ = _tiny()
    op = JacobianOperator(model, x, y)
    clipped = ClippedJacobian(op, clip=1e-3)  # every sample clipped
    # J̄_i = J_i s_i(I − ĝĝᵀ): build it densely from the plain operator's columns
    eye = torch.eye(op.dtheta, dtype=torch.float64)
    jbar = torch.stack([clipped.j(eye.unsqueeze(0).expand(3, -1, -1))[i].T for i in range(3)])  # [B, dx, dθ]
    u = torch.randn(3, 5, dtype=torch.float64)
    torch.testing.assert_close(RegularisedK(clipped, 0.1) @ u,
                               torch.einsum("bij,bj->bi", _dense_k(jbar, torch.full((3,), 0.1)), u))


def test_rmse_and_lower_bound():
    assert to_rmse(3.0, 9) == 1.0 and from_rmse(1.0, 9) == 3.0
    norms = torch.tensor([2.0, 8.0])
    torch.testing.assert_close(from_rmse(to_rmse(norms, 784), 784), norms)
    torch.testing.assert_close(to_rmse(norms, 4), torch.tensor([1.0, 4.0]))
    _, _, _, jac, _ = _tiny()
    delta = torch.randn(jac.shape[2], dtype=torch.float64)
    lam_max = torch.linalg.eigvalsh(jac @ jac.transpose(1, 2))[:, -1]
    bound = i2f_lower_bound((jac @ delta).norm(dim=1), lam_max)
    # ε = 0 (K_i is 5×5 of full rank here): the bound is below the unregularised I2F (I2F Eq. 5)
    exact = torch.linalg.solve(_dense_k(jac, torch.zeros(3, dtype=torch.float64)),
                               (jac @ delta).unsqueeze(-1)).squeeze(-1).norm(dim=1)
    assert bool((bound <= exact * (1 + 1e-9)).all())


def test_regularised_gain_is_i2f_along_a_singular_direction():
    """δ = a·v_j (right singular vector of J_i) moves the regularised recovery by |a|·√λ_j/(λ_j+ε)."""
    _, _, _, jac, _ = _tiny()
    eps = torch.tensor([1e-3, 0.05, 0.5], dtype=torch.float64)
    u, s, vh = torch.linalg.svd(jac, full_matrices=False)  # s² = eigenvalues of K_i
    for j in range(s.shape[1]):
        delta = 2.5 * vh[:, j, :]  # [B, dθ], one direction per sample
        shift = torch.linalg.solve(_dense_k(jac, eps), torch.einsum("bdp,bp->bd", jac, delta).unsqueeze(-1))
        torch.testing.assert_close(shift.squeeze(-1).norm(dim=1), 2.5 * regularised_gain(s[:, j] ** 2, eps))
    # a null direction (λ = ε = 0) has gain 0, and round-off negatives count as 0
    assert regularised_gain(torch.tensor([0.0, -1e-18]), 0.0).tolist() == [0.0, 0.0]


def test_unit_noise_and_sigma_for_tau_against_the_gaussian_expectation():
    _, _, _, jac, _ = _tiny()
    kernel = jac @ jac.transpose(1, 2)
    lam_max = torch.linalg.eigvalsh(kernel)[:, -1]
    fro2 = kernel.diagonal(dim1=1, dim2=2).sum(-1)
    unit = unit_noise_i2f_lb(fro2, lam_max)
    torch.testing.assert_close(unit, torch.linalg.matrix_norm(jac) / lam_max)
    tau, dx = 0.05, jac.shape[1]
    sigma = sigma_for_i2f_lb(tau, unit, dx)
    # E‖Jδ‖² = σ²‖J‖²_F for δ ~ N(0, σ²I): Monte Carlo over 20,000 draws lands on τ within 3%
    draws = sigma.view(1, -1, 1) * torch.randn(20_000, 1, jac.shape[2], dtype=torch.float64,
                                                  generator=torch.Generator().manual_seed(0))
    mean_sq = torch.einsum("bdp,nbp->nbd", jac, draws).pow(2).sum(-1).mean(0)
    torch.testing.assert_close(to_rmse(mean_sq.sqrt() / lam_max, dx), torch.full((3,), tau, dtype=torch.float64),
                               rtol=3e-2, atol=0)


def test_plain_hutchinson_is_the_rademacher_estimator_and_near_the_trace():
    _, _, _, jac, _ = _tiny(batch=2)
    jt = lambda u: torch.einsum("bkd,bdp->bkp", u, jac)  # noqa: E731
    estimate, used, stderr = hutchinson(jt, 2, 5, like=jac, rtol=0.0, probes=4000, max_probes=4000,
                                        generator=torch.Generator().manual_seed(3))
    assert used == 4000
    generator = torch.Generator().manual_seed(3)
    z = torch.randint(0, 2, (2, 4000, 5), generator=generator).to(torch.float64).mul_(2).sub_(1)
    assert torch.equal(estimate, jt(z).pow(2).sum(-1).mean(-1))  # the same draws, bit for bit
    truth = jac.pow(2).sum(dim=(1, 2))
    assert bool(((estimate - truth).abs() <= 4 * stderr).all())
