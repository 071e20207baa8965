"""The eigen defense against a dense reference: what it reads from ``DefenseContext`` and what it builds.

With B = 1 and a full Krylov space the Ritz pairs are exact eigenpairs of K, so each chosen
direction J_iᵀu_j/‖J_iᵀu_j‖ is a right singular vector and the mixture, normalised to unit
*estimated* I2F, has exact I2F 1 — checked with ``torch.linalg.solve`` on K + εI built from an
autograd Jacobian.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from flguard.defenses import DefenseContext
from flguard.defenses.eigen import eigen_direction
from flguard.risk import JacobianOperator, RegularisedK
from risk_reference import dense_jacobians


def _context(subspace_size: int, spectrum: bool = True) -> tuple[DefenseContext, torch.Tensor, torch.Tensor]:
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3)).double()
    x, y = torch.randn(1, 5, dtype=torch.float64), torch.tensor([2])
    jac, g = dense_jacobians(model, x, y)
    op = JacobianOperator(model, x, y)
    ritz = RegularisedK(op).lanczos(rtol=1e-10, ends="max", min_iter=5, return_vectors=True)
    eps = 1e-2 * ritz.lambda_max
    ctx = DefenseContext(op, g, eps, ritz.lambda_max, torch.Generator().manual_seed(0),
                         SimpleNamespace(subspace_size=subspace_size), spectrum=ritz if spectrum else None)
    return ctx, jac, eps


@pytest.mark.parametrize("subspace_size", [1, 3, 5])
def test_eigen_mixture_has_unit_exact_i2f(subspace_size):
    ctx, jac, eps = _context(subspace_size)
    direction = eigen_direction(ctx)
    kernel = jac[0] @ jac[0].T + eps[0] * torch.eye(5, dtype=torch.float64)
    i2f = torch.linalg.solve(kernel, jac[0] @ direction.vector).norm()
    torch.testing.assert_close(i2f, torch.tensor(1.0, dtype=torch.float64), rtol=1e-6, atol=0)
    assert direction.info["subspace"] == subspace_size
    # the chosen directions are those of largest regularised gain √λ/(λ+ε), written out here
    lam = torch.linalg.eigvalsh(jac[0] @ jac[0].T).clamp_min(0)
    gains = (lam.sqrt() / (lam + eps[0])).sort(descending=True).values
    torch.testing.assert_close(direction.info["best_gain"][0], gains[0], rtol=1e-6, atol=0)
    torch.testing.assert_close(direction.info["mean_gain"][0], gains[:subspace_size].mean(), rtol=1e-6, atol=0)


def test_eigen_without_ritz_vectors_says_what_it_needs():
    ctx, _, _ = _context(2, spectrum=False)
    with pytest.raises(ValueError, match="Ritz vectors"):
        eigen_direction(ctx)
