"""Resolvent noise: each sample's random input noise filtered by a few CG steps of (K_i+ε_iI)⁻¹, each
sample's part scaled to unit I²F on its own sample, carried to the update through the Jacobians.

δ = Σ_i J_iᵀv_i/ι_i, v_i = p(K_i)z_i ≈ (K_i+ε_iI)⁻¹z_i (``FILTER_STEPS`` CG steps from zero, so p is a
polynomial of degree FILTER_STEPS − 1), z_i ~ N(0, I_dx) fresh per sample and step, and
ι_i ≈ ‖(K_i+ε_iI)⁻¹K_iv_i‖ — the I²F that sample i's own part causes on sample i (``NORM_STEPS`` CG steps).

Why: along the eigenvector u_j of K_i (eigenvalue θ_j) noise of unit norm moves sample i's best
reconstruction by the regularised gain √θ_j/(θ_j+ε), largest at θ_j = ε. Eigen finds directions near
that peak with a 64-step Lanczos run per sample; the resolvent puts the noise there directly — the
noise's energy along u_j is θ_j/(θ_j+ε)²·(u_jᵀz)², itself peaked at θ_j = ε, over every direction of
the spectrum rather than a few resolved ones — and a polynomial of low degree already suppresses the
large-θ directions that buy little I²F per unit of noise. What makes it work is the per-sample scale
ι_i (as eigen's normalisation to unit estimated I²F): without it the samples whose K_i is largest take
the noise and the least protected sample gets little (``rowspace``, which sums the filtered noise
unscaled). Measured (docs/results.md, "Resolvent noise"): on trained ResNet-20-GN batches (B = 8) the
least protected sample's I²F per unit of noise 0.77–1.8× eigen's at 3 + 1 + 3 K products per sample for
the direction, where eigen spends 64; guarded rounds of trained ResNets about as accurate as eigen's at a third
of its time; but the CNN trained from scratch by federated rounds ended 1.4–13 points lower than with eigen, so
``auto`` keeps eigen unless ``fallback="resolvent"``. The direction only shapes the noise; the guard scales it to
the floor and verifies every sample on the noise sent, as for every other direction.
"""

from __future__ import annotations

import torch

from flguard.defenses.base import DefenseContext, Direction
from flguard.risk.regularised import RegularisedK

#: CG steps of the filter v_i ≈ (K_i+ε_iI)⁻¹z_i and of the estimate ι_i ≈ ‖(K_i+ε_iI)⁻¹K_iv_i‖. Measured
#: (docs/results.md, "Resolvent noise"; ``benchmarks/study_aimed_noise.py``): 2, 3 and 5 filter steps gave the
#: same least-sample I²F per unit noise within the draws' spread; ι_i solved to 1% gained up to 15% at 2.5× the
#: direction's products.
FILTER_STEPS, NORM_STEPS = 3, 3


def resolvent(ctx: DefenseContext) -> Direction:
    """Σ_i J_iᵀv_i/ι_i (module doc) on the step's (clipped) operator at the guard's ε_i."""
    op = ctx.op
    z = torch.randn(op.batch_size, op.dx, generator=ctx.generator, dtype=op.dtype, device=op.device)
    regularised = RegularisedK(op, ctx.eps)
    filtered = regularised.solve(z, rtol=0.0, max_iter=FILTER_STEPS).solution
    own = regularised.solve(RegularisedK(op).matvec(filtered), rtol=0.0, max_iter=NORM_STEPS).solution.norm(dim=1)
    usable = torch.isfinite(own) & (own > 0) & torch.isfinite(filtered).all(dim=1)
    if not bool(usable.any()):
        raise RuntimeError("resolvent noise: no sample's Jacobian moves its recovery (every K_i zero or non-finite)")
    # a sample with no usable part gets no noise of its own; the verification on the noise sent decides about it
    weights = torch.where(usable, 1.0 / torch.where(usable, own, torch.ones_like(own)), torch.zeros_like(own))
    vector = op.jt_sum(torch.where(usable.unsqueeze(1), filtered, torch.zeros_like(filtered)) * weights.unsqueeze(1))
    if not bool(torch.isfinite(vector).all()) or not bool(vector.any()):
        raise RuntimeError("resolvent noise: the samples' Jacobians map the filtered noise to zero or non-finite values")
    return Direction(vector, {"kind": "resolvent", "own_i2f": own})

