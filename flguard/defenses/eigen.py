"""Eigen-aware noise: random mixtures of each sample's weakest-seen directions (I2F §5.1).

Noise along the right singular vector v_j = J_iᵀu_j/√λ_j moves sample i's best reconstruction by
|a|·√λ_j/(λ_j+ε) (the regularised gain), while noise in J_i's null space does nothing. So per
sample we take the ``subspace_size`` Ritz directions of K_i with the largest gain, map them to
parameter space, and mix them with fresh Gaussian coefficients — random *within* the subspace, so
the server can neither predict nor cancel the noise. Each sample's mixture is normalised to unit
*estimated* I2F on its own sample (√Σ a_j²g_j² from the Ritz gains), the mixtures are summed, and
the guard measures the sum's exact I2F for every sample (cross-terms included) and scales it
until all meet the floor jointly.
"""

from __future__ import annotations

import torch

from flguard.defenses.base import DefenseContext, Direction
from flguard.risk.closed_forms import regularised_gain
from flguard.risk.lanczos import LanczosResult, from_basis

def _ritz_pairs(ctx: DefenseContext) -> LanczosResult:
    """The guard's spectrum of K_i, which must carry Ritz vectors [B, m, dx] (Lanczos run with
    ``return_vectors=True`` and ``min_iter=krylov_steps`` for a subspace to choose from)."""
    spectrum = ctx.spectrum
    if spectrum is None or spectrum.ritz_vectors is None:
        raise ValueError("the eigen defense needs the guard's Lanczos spectrum with Ritz vectors")
    if spectrum.ritz_vectors.shape != (ctx.op.batch_size, spectrum.ritz_values.shape[1], ctx.op.dx):
        raise ValueError(f"Ritz vectors of shape {tuple(spectrum.ritz_vectors.shape)} do not match "
                         f"[B={ctx.op.batch_size}, m={spectrum.ritz_values.shape[1]}, dx={ctx.op.dx}]")
    return spectrum


def eigen_direction(ctx: DefenseContext) -> Direction:
    """Unit-estimated-I2F mixtures of each sample's ``subspace_size`` highest-gain Ritz directions, summed."""
    spectrum = _ritz_pairs(ctx)
    op, cfg = ctx.op, ctx.config
    gains = regularised_gain(spectrum.ritz_values, ctx.eps.unsqueeze(1))  # [B, m]
    k = min(cfg.subspace_size, gains.shape[1])
    best = gains.topk(k, dim=1)
    chosen = spectrum.ritz_vectors.gather(1, best.indices.unsqueeze(2).expand(-1, -1, op.dx))  # [B, k, dx]
    coefficients = torch.randn(op.batch_size, k, generator=ctx.generator, dtype=op.dtype, device=op.device)
    estimated = (coefficients * best.values).pow(2).sum(1).sqrt()
    if not bool((estimated > 0).all()):
        raise RuntimeError("eigen defense: a sample's weak directions have no measurable effect on its recovery")
    weights = coefficients / estimated.unsqueeze(1)  # each sample's mixture at unit estimated I2F
    # Σ_j w_j J_iᵀu_j/‖J_iᵀu_j‖ = J_iᵀ(Σ_j w_j u_j/√θ_j): for a Ritz pair ‖J_iᵀu‖² = uᵀK_iu = θ (the
    # basis is re-orthogonalised, so QᵀKQ = T to float precision), so the batch's mixtures take one
    # summed Jᵀ product instead of one per direction (32 of eigen's ≈ 170 products per sample on a
    # ResNet-20). θ is floored at 1e-8·θmax: a near-null Ritz value is noise, and its direction's
    # gain √θ/(θ+ε) is too small to matter.
    theta = spectrum.ritz_values.gather(1, best.indices)
    floor = 1e-8 * spectrum.ritz_values.max(dim=1, keepdim=True).values.clamp_min(torch.finfo(theta.dtype).tiny)
    mixed = from_basis(chosen, weights / torch.maximum(theta, floor).sqrt())
    combined = op.jt_sum(mixed)
    return Direction(combined, {"kind": "eigen", "subspace": k, "best_gain": best.values[:, 0],
                                "mean_gain": best.values.mean(1)})
