"""Closed forms for Gaussian perturbations δ ~ N(0, σ²I) of the shared gradient (I2F §3).

E[I²]    = σ² tr(Jᵀ(K+εI)⁻²J) = σ² Σ_j λ_j / (λ_j + ε)²
E[I_lb²] = σ² ‖J‖²_F / λmax²
so the σ that puts a target on the expectation is closed-form once λ or (‖J‖_F, λmax) are known.
"""

from __future__ import annotations

import torch


def expected_i2f_sq(eigenvalues: torch.Tensor, sigma: float | torch.Tensor, eps: float | torch.Tensor) -> torch.Tensor:
    """E[I²] for eigenvalues [..., n] of K, noise scale σ and Tikhonov ε (broadcast over [...])."""
    eps = torch.as_tensor(eps, dtype=eigenvalues.dtype, device=eigenvalues.device)
    sigma = torch.as_tensor(sigma, dtype=eigenvalues.dtype, device=eigenvalues.device)
    lam = eigenvalues.clamp_min(0)
    return sigma**2 * (lam / (lam + eps.unsqueeze(-1)) ** 2).sum(-1)


def expected_i2f_lb_sq(jacobian_fro2: torch.Tensor, lambda_max: torch.Tensor, sigma: float | torch.Tensor) -> torch.Tensor:
    """E[I_lb²] = σ² ‖J‖²_F / λmax²."""
    return torch.as_tensor(sigma) ** 2 * jacobian_fro2 / lambda_max**2


def sigma_for_i2f_lb(target_rmse: torch.Tensor, jacobian_fro2: torch.Tensor, lambda_max: torch.Tensor,
                     dx: int) -> torch.Tensor:
    """σ at which the expected lower-bound RMSE √E[I_lb²]/√dx equals ``target_rmse`` per sample."""
    return target_rmse * dx**0.5 * lambda_max / jacobian_fro2.sqrt()
