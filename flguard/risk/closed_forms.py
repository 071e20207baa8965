"""The I2F formulas every layer uses, each written once (I2F §3, Eq. 4–5, Fig. 1).

- RMSE: a recovery-error norm I over the dx input coordinates is reported as I/√dx, an RMSE in
  model-input units (``to_rmse``; ``from_rmse`` is its inverse, for floors given as RMSEs).
- Lower bound: I_lb(δ) = ‖J_iδ‖/λmax(K_i) (``i2f_lower_bound``).
- Regularised gain: noise along the right singular vector of K_i's eigenvalue λ moves the
  regularised recovery by √λ/(λ+ε) per unit of noise (``regularised_gain``).
- Gaussian closed forms for δ ~ N(0, σ²I):
  E[I²] = σ² tr(Jᵀ(K+εI)⁻²J) = σ² Σ_j λ_j / (λ_j + ε)² and E[I_lb²] = σ² ‖J‖²_F / λmax², so
  √E[I_lb²] per unit σ is ‖J‖_F/λmax (``unit_noise_i2f_lb``) and the σ that puts a target RMSE
  on that expectation is closed-form (``sigma_for_i2f_lb``).

Plain arithmetic on tensors or floats, in the order the callers always used, so moving a caller
onto these helpers leaves its numbers bit-for-bit unchanged.
"""

from __future__ import annotations

from typing import TypeVar

import torch

Value = TypeVar("Value", float, torch.Tensor)


def to_rmse(norm: Value, dx: int) -> Value:
    """I/√dx: the norm of a recovery error over ``dx`` input coordinates as an RMSE (input units)."""
    return norm / dx ** 0.5


def from_rmse(rmse: Value, dx: int) -> Value:
    """RMSE·√dx: the error norm over ``dx`` input coordinates that has RMSE ``rmse``."""
    return rmse * dx ** 0.5


def i2f_lower_bound(jd_norm: torch.Tensor, lambda_max: torch.Tensor) -> torch.Tensor:
    """I_lb = ‖J_iδ‖/λmax(K_i) per sample (I2F Eq. 5): the recovery error δ causes at least."""
    return jd_norm / lambda_max


def regularised_gain(eigenvalues: torch.Tensor, eps: torch.Tensor | float) -> torch.Tensor:
    """√λ/(λ+ε): regularised I2F per unit of noise along the direction with eigenvalue λ of K.

    Negative round-off eigenvalues count as 0; a zero denominator (λ = ε = 0) gives gain 0, not NaN
    (such a direction has no effect on the recovery).
    """
    lam = eigenvalues.clamp_min(0)
    return lam.sqrt() / (lam + eps).clamp_min(torch.finfo(lam.dtype).tiny)


def expected_i2f_sq(eigenvalues: torch.Tensor, sigma: float | torch.Tensor, eps: float | torch.Tensor) -> torch.Tensor:
    """E[I²] for eigenvalues [..., n] of K, noise scale σ and Tikhonov ε (broadcast over [...])."""
    eps = torch.as_tensor(eps, dtype=eigenvalues.dtype, device=eigenvalues.device)
    sigma = torch.as_tensor(sigma, dtype=eigenvalues.dtype, device=eigenvalues.device)
    lam = eigenvalues.clamp_min(0)
    return sigma**2 * (lam / (lam + eps.unsqueeze(-1)) ** 2).sum(-1)


def expected_i2f_lb_sq(jacobian_fro2: torch.Tensor, lambda_max: torch.Tensor, sigma: float | torch.Tensor) -> torch.Tensor:
    """E[I_lb²] = σ² ‖J‖²_F / λmax²."""
    return torch.as_tensor(sigma) ** 2 * jacobian_fro2 / lambda_max**2


def unit_noise_i2f_lb(jacobian_fro2: torch.Tensor, lambda_max: torch.Tensor) -> torch.Tensor:
    """√E[I_lb²] for δ ~ N(0, I): ‖J‖_F/λmax — the lower-bound recovery error per unit of σ."""
    return jacobian_fro2.sqrt() / lambda_max


def sigma_for_i2f_lb(target_rmse: Value, unit_noise: Value, dx: int) -> Value:
    """σ at which the expected lower-bound RMSE σ·(‖J‖_F/λmax)/√dx equals ``target_rmse``;
    ``unit_noise`` is ‖J‖_F/λmax (``unit_noise_i2f_lb``)."""
    return from_rmse(target_rmse, dx) / unit_noise
