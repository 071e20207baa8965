"""Row-space noise: Gaussian noise in the inputs, carried to the update through the samples' Jacobians.

δ = Σ_i J_iᵀz_i with z_i ~ N(0, I_dx) drawn fresh per sample — to first order the change of the
batch's gradient when every input moves by z_i. It lives where sample i's reconstruction is
sensitive (J_i's row space, dx of the dθ directions) instead of spreading over all of parameter
space as isotropic noise does, and along each right singular vector v_j its size is √λ_j|u_jᵀz_i|,
so sample i's I²F shift (K_i+εI)⁻¹K_iz_i ≈ z_i on every direction with λ_j ≫ ε: the attacker's
best first-order reconstruction is the input plus Gaussian noise. Pieces need no normalisation
across samples: ‖J_iᵀz_i‖ grows as √tr K_i, so a sample that moves its gradient more gets more noise.

Why not eigen's few weak directions: this noise covers every direction the gradient moves in, so an
attacker that discards a subspace of it (``flguard.attacks.adaptive``) discards the signal with it,
and it costs one summed product instead of a Lanczos run per sample. Measured (docs/results.md,
"Row-space noise"): on a trained ResNet-18-GN it sent every step the Gaussian could not, at an eighth
of eigen's products; on the trained quickstart CNN it needs 7× less noise in norm than the Gaussian
but costs more accuracy (its noise lies in the directions that move the model's outputs), so
``auto`` tries the Gaussian first.
The guard scales δ to the floor and verifies it on the noise sent, as for the other directions.
"""

from __future__ import annotations

import torch

from flguard.defenses.base import DefenseContext, Direction
from flguard.risk.clipped import Jacobian


def rowspace(op: Jacobian, generator: torch.Generator) -> Direction:
    """Σ_i J_iᵀz_i for z_i ~ N(0, I_dx) from ``generator`` (one summed transpose product)."""
    z = torch.randn(op.batch_size, op.dx, generator=generator, dtype=op.dtype, device=op.device)
    vector = op.jt_sum(z)
    if not bool(torch.isfinite(vector).all()) or not bool(vector.any()):
        raise RuntimeError("row-space noise: the samples' Jacobians map the input noise to zero or non-finite values")
    return Direction(vector, {"kind": "rowspace"})


def rowspace_direction(ctx: DefenseContext) -> Direction:
    """The row-space direction of the step's (clipped) operator."""
    return rowspace(ctx.op, ctx.generator)
