"""Calibrated Gaussian: an isotropic draw z ~ N(0, I), scaled by the guard to meet the floor.

I2F is linear in δ, so for the realised draw the σ that puts sample i exactly on the floor is
τ√dx / I_i(z); the guard takes the largest over samples and verifies it on the final noise. The
closed form E[I²] = σ²Σ_j λ_j/(λ_j+ε)² is what σ would be *in expectation*; this draw's
‖(K+εI)⁻¹Jz‖² is a one-probe unbiased estimate of that sum, so the calibration is the closed form
evaluated on the noise actually sent.
"""

from __future__ import annotations

import torch

from flguard.defenses.base import DefenseContext, Direction


def isotropic(size: int | tuple, generator: torch.Generator, like: torch.Tensor) -> Direction:
    """z ~ N(0, I) of ``size`` from the guard's stream, in ``like``'s dtype and device."""
    z = torch.randn(size, generator=generator, dtype=like.dtype, device=like.device)
    return Direction(z, {"kind": "isotropic"})


def gaussian_direction(ctx: DefenseContext) -> Direction:
    """z ~ N(0, I_dθ); the guard's scale is then σ."""
    return isotropic(ctx.op.dtheta, ctx.generator, ctx.gradient)
