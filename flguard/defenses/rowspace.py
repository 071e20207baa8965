"""Row-space noise: Gaussian noise in the inputs, filtered by each sample's regularised gain and carried
to the update through the samples' Jacobians.

δ = Σ_i J_iᵀw_i, w_i = (K_i + ε_iI)⁻ᵖz_i (p = ``FILTER_POWER``), z_i ~ N(0, I_dx) drawn fresh per sample.
Along each right singular vector v_j of J_i the noise is √λ_j/(λ_j+ε)ᵖ·(u_jᵀz_i) — for p = 1 the
regularised gain that eigen's selection maximises (largest at λ_j = ε) — so, like eigen, the noise
goes where a unit of it moves sample i's reconstruction most, but over every direction with Gaussian
weights instead of a few chosen ones: an attacker that discards a subspace of it
(``flguard.attacks.adaptive``) discards a share, not all of it. The filter is one loose Lanczos run per
sample and p − 1 loose CG solves (``FILTER_ITER`` products each at most, ε_i from the run's own λmax
estimate; the filter only shapes the direction, nothing is certified by it), then one summed
transpose product: a fraction of eigen's 64-step Lanczos run and its k-vector map. The guard
scales δ to the floor and verifies it on the noise sent, as for the other directions.

Measured (docs/results.md, "Row-space noise"): on a trained ResNet-20-GN (B = 8) it sends every step at
140× a training step and 47 products per sample where eigen takes 557× and 170, but a 5-step round ends
at 49% accuracy against eigen's 62% (unguarded 67.5%); unfiltered (w_i = z_i, the noise along v_j
√λ_j(u_jᵀz_i), mostly along the largest-λ directions) it ended at 9.5%. So
``auto`` does not use it: it is the choice for a user who trades accuracy for a guard 4× cheaper.
"""

from __future__ import annotations

import torch

from flguard.defenses.base import DefenseContext, Direction
from flguard.risk.clipped import Jacobian
from flguard.risk.regularised import RegularisedK


#: Lanczos steps per sample of the gain filter (K_i+ε_iI)⁻¹z_i, and the tolerance it stops at: the
#: filter shapes the direction only (every sample's floor is verified on the noise sent), so a
#: rough solve serves.
FILTER_ITER, FILTER_RTOL = 16, 0.1
#: The filter's power p, w_i = (K_i+ε_iI)⁻ᵖz_i: along v_j the noise is √λ_j/(λ_j+ε)ᵖ·(u_jᵀz_i), which for
#: p = 2 peaks at λ_j = ε/3 and falls as λ_j^(-3/2) above it — less noise along the directions of largest λ,
#: which buy little I²F per unit of noise (and, on our reading, cost accuracy). Measured on
#: the trained ResNet-20-GN, a 5-step guarded round at B = 8 (unguarded 67.5%): p = 1 30.5%, p = 2 48.8%,
#: p = 3 44.7% (eigen: 61.9%).
FILTER_POWER = 2


def rowspace(op: Jacobian, generator: torch.Generator, eps: float, relative: bool = True) -> Direction:
    """Σ_i J_iᵀ(K_i + ε_iI)⁻ᵖz_i (p = ``FILTER_POWER``) for z_i ~ N(0, I_dx) from ``generator``,
    ε_i = ``eps``·λmax,i (``relative``) or ``eps``."""
    z = torch.randn(op.batch_size, op.dx, generator=generator, dtype=op.dtype, device=op.device)
    seed = int(torch.randint(0, 2**31 - 1, (1,), generator=generator, device=op.device))
    run = RegularisedK(op).solve_with_lambda_max(z, eps, relative=relative, rtol=FILTER_RTOL,
                                                 max_iter=FILTER_ITER, seed=seed)
    filtered = _finite(run.solution)
    for _ in range(FILTER_POWER - 1):  # (K+εI)⁻ᵖ: the same ε, each further power one more rough solve
        filtered = _finite(RegularisedK(op, run.eps).solve(filtered, rtol=FILTER_RTOL, max_iter=FILTER_ITER).solution)
    vector = op.jt_sum(filtered)
    if not bool(torch.isfinite(vector).all()) or not bool(vector.any()):
        raise RuntimeError("row-space noise: the samples' Jacobians map the input noise to zero or non-finite values")
    return Direction(vector, {"kind": "rowspace"})


def _finite(w: torch.Tensor) -> torch.Tensor:
    """A rough solve's output with non-finite entries (a sample whose ε underflowed) set to 0: that
    sample then gets no noise of its own, and the verification on the noise sent decides about it."""
    return torch.nan_to_num(w, nan=0.0, posinf=0.0, neginf=0.0)


def rowspace_direction(ctx: DefenseContext) -> Direction:
    """The row-space direction of the step's (clipped) operator at the guard's relative ε."""
    return rowspace(ctx.op, ctx.generator, ctx.config.eps, ctx.config.eps_mode == "relative")
