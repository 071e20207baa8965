"""Batched conjugate gradients for (K_i + ε_i I) b_i = r_i, with a guaranteed error bound.

For PSD K and ε > 0, ‖x − x*‖ ≤ ‖r‖ / ε (the smallest eigenvalue of K + εI is at least ε), so
stopping when ‖r‖/ε ≤ rtol‖x‖ bounds the solution's *relative error* by rtol — not just the
residual. With ε = 0 (only meaningful when the right-hand side lies in K's range, as J_iδ does)
the test falls back to ‖r‖ ≤ rtol‖b‖ and at most n iterations.

``preconditioned_cg`` is the same solve with an SPD preconditioner (``spectral_preconditioner``:
the top Ritz pairs of K_i from the Lanczos run that already set ε) and a *verified* stop: it ends
only when the true residual r = rhs − (K+εI)x, formed by an explicit product, meets the test, and
its ``error_bound`` comes from that r. The bound holds for any x, so the preconditioner can change how
fast the floor is certified, never whether the certificate is valid.

Both verified solvers (this one and ``flguard.risk.lanczos_solve``) return the centre of the least ball
that the residual alone places x* in (``residual_ball``): x* − x = (A+εI)⁻¹r with (A+εI)⁻¹'s eigenvalues
in (0, 1/ε], so x* lies within ‖r‖/(2ε) of x + r/(2ε) — a ball inside the one of radius ‖r‖/ε around
x, for no product — and test rtol on it: radius ≤ rtol × the centre's norm.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

import torch

from flguard.risk.lanczos import from_basis, in_basis

Matvec = Callable[[torch.Tensor], torch.Tensor]
#: (v [r, n], rows [r]) → A_i v_i for the samples ``rows`` only: lets a solver pay for the samples
#: still iterating, not the whole batch (``flguard.risk.regularised``'s shrinking products).
RowsMatvec = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
#: (x [B, n], error bound [B], ask [B] bool) → [B] bool, False where not asked: the samples whose
#: solve, at that accuracy, already serves its caller (the guard: the sample certifies at the noise
#: scale the batch's least accurate sample will need). A solver stops such a sample before its rtol
#: test; the caller re-checks the verified result, so the rule decides how much is spent, never
#: whether a certificate holds. Every row of x is current: the rule may look at the whole batch.
Sufficient = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class Deflating(Protocol):
    """A deflation space for CG (``flguard.risk.lanczos.Deflation``: a Lanczos run's Krylov space)."""

    def correct(self, x: torch.Tensor, r: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, r) corrected on the space (Galerkin), r the new residual (an estimate)."""

    def directions(self, z: torch.Tensor) -> torch.Tensor:
        """z made A-orthogonal to the space."""


#: The verified solvers return ``residual_ball``'s centre and radius (False: the iterate x and ‖r‖/ε, as before;
#: for measurements). On trained CNN batches the guard's solves certify in about a fifth fewer products
#: (docs/results.md, "Half the radius from the same residual").
BALL_CENTRE = True


def residual_ball(x: torch.Tensor, residual: torch.Tensor, shift: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(centre [B, n], radius [B]) of a ball holding x* = (A+εI)⁻¹b, from an iterate x and its residual
    r = b − (A+εI)x (A PSD, ε = ``shift`` [B]). x* − x = (A+εI)⁻¹r and every eigenvalue μ of (A+εI)⁻¹ lies in
    (0, 1/ε], so |μ − 1/(2ε)| ≤ 1/(2ε) and ‖x* − x − r/(2ε)‖ ≤ ‖r‖/(2ε): half the radius ‖r‖/ε of the
    usual bound, in a ball inside that one (the least such ball: every point of it is x*, or a limit of x*,
    for some such A). It needs only uᵀ(A+εI)u ≥ ε‖u‖² for all u, as ‖r‖/ε does, so a slightly asymmetric
    A with a PSD symmetric part keeps it. Where ε = 0 (no bound from r) x stays the centre and the radius is
    ‖r‖/ε's overflow."""
    tiny = torch.finfo(residual.dtype).tiny
    norm = residual.norm(dim=1)
    if not BALL_CENTRE:
        return x, norm / shift.clamp_min(tiny)
    positive = shift > 0
    half = torch.where(positive, 0.5 / shift.clamp_min(tiny), torch.zeros_like(shift))
    radius = torch.where(positive, norm * half, norm / shift.clamp_min(tiny))
    return x + half.unsqueeze(1) * residual, radius


@dataclass
class CGResult:
    """``error_bound`` [B]: ‖solution − x*‖ ≤ error_bound from the true residual (``preconditioned_cg``, whose
    ``solution`` is ``residual_ball``'s centre around its last ``iterate``, error_bound the radius); None where the
    solver did not form it (plain CG stops on its recurrence residual and returns its iterate)."""

    solution: torch.Tensor
    converged: torch.Tensor
    iterations: int
    matvecs: int
    error_bound: torch.Tensor | None = None
    iterate: torch.Tensor | None = None


def _on_rows(matvec: Matvec, rows_matvec: RowsMatvec | None, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """A_i v_i where ``mask`` holds; with ``rows_matvec`` the other rows are not computed (zero)."""
    if rows_matvec is None or bool(mask.all()):
        return matvec(v)
    out = torch.zeros_like(v)
    rows = mask.nonzero().squeeze(1)
    if rows.numel():
        out[rows] = rows_matvec(v[rows], rows)
    return out


def conjugate_gradient(matvec: Matvec, rhs: torch.Tensor, shift: torch.Tensor, *, rtol: float = 1e-3,
                       max_iter: int | None = None, rows_matvec: RowsMatvec | None = None) -> CGResult:
    """Solve (A_i + shift_i I) x_i = rhs_i for every sample i; ``rhs`` [B, n], ``shift`` [B].
    ``rows_matvec``: products on the still-active samples only (same iterates, less work)."""
    batch, dim = rhs.shape
    limit = dim if max_iter is None else max_iter
    x = torch.zeros_like(rhs)
    r = rhs.clone()
    p = r.clone()
    rr = (r * r).sum(1)
    rhs_norm = rhs.norm(dim=1)
    active = rhs_norm > 0
    converged = ~active
    tiny = torch.finfo(rhs.dtype).tiny
    iterations = 0
    for iterations in range(1, limit + 1):
        ap = _on_rows(matvec, rows_matvec, p, active) + shift.unsqueeze(1) * p
        step = rr / (p * ap).sum(1).clamp_min(tiny)
        step = torch.where(active, step, torch.zeros_like(step))
        x = x + step.unsqueeze(1) * p
        r = r - step.unsqueeze(1) * ap
        rr_new = (r * r).sum(1)
        residual = rr_new.sqrt()
        bounded = torch.where(shift > 0, residual / shift.clamp_min(tiny) <= rtol * x.norm(dim=1),
                              residual <= rtol * rhs_norm)
        converged = converged | (active & bounded)
        active = active & ~bounded
        if not bool(active.any()):
            break
        p = r + (rr_new / rr.clamp_min(tiny)).unsqueeze(1) * p
        rr = rr_new
    return CGResult(x, converged, iterations, iterations)


def spectral_preconditioner(ritz_values: torch.Tensor, ritz_vectors: torch.Tensor, shift: torch.Tensor) -> Matvec:
    """M⁻¹ for A_i = K_i + ε_iI from Ritz pairs (θ_j, v_j) of K_i (values [B, k], vectors [B, k, n]).

    M⁻¹u = u + V diag(σ/(θ_j+ε) − 1) Vᵀu with σ = min_j θ_j + ε: on an exact eigenvector v_j,
    M⁻¹A v_j = σ v_j, so the top k eigenvalues are folded down to σ and PCG sees a condition number
    ≈ (θ_{k+1}+ε)/ε instead of (λmax+ε)/ε. With orthonormal V its eigenvalues are σ/(θ_j+ε) ∈ (0, 1]
    and 1: symmetric positive definite, whatever the quality of the Ritz vectors.
    """
    theta = ritz_values.clamp_min(0)
    sigma = theta.amin(dim=1, keepdim=True) + shift.unsqueeze(1)
    denominator = theta + shift.unsqueeze(1)
    # a zero operator with ε = 0 (a sample the parameters do not see): the identity there, not 0/0
    scale = torch.where(denominator > 0, sigma / denominator.clamp_min(torch.finfo(theta.dtype).tiny) - 1,
                        torch.zeros_like(theta))

    def apply(u: torch.Tensor) -> torch.Tensor:
        return u + from_basis(ritz_vectors, in_basis(ritz_vectors, u) * scale)

    return apply


def preconditioned_cg(matvec: Matvec, rhs: torch.Tensor, shift: torch.Tensor, precond: Matvec, *,
                      rtol: float = 1e-3, max_iter: int | None = None,
                      rows_matvec: RowsMatvec | None = None, initial: torch.Tensor | None = None,
                      sufficient: Sufficient | None = None, initial_residual: torch.Tensor | None = None,
                      deflation: Deflating | None = None) -> CGResult:
    """Solve (A_i + shift_i I) x_i = rhs_i (A_i PSD; shift_i > 0 where rhs_i ≠ 0) by PCG, SPD ``precond``.

    The stop is verified: a sample whose recurrence residual passes the test — ``residual_ball``'s
    radius ≤ rtol × its centre's norm — is set aside (its recurrence frozen); once no sample is still
    iterating, the true residual of every sample set aside is formed by one batched product and must
    pass the same test. One whose recurrence drifted resumes from its true residual (direction
    restarted). ``solution`` and ``error_bound``: that ball's centre and radius from the explicit
    product's residual — ‖solution − x*‖ ≤ error_bound, since λmin(A+εI) ≥ ε.
    ``rows_matvec``: every product on the samples that need it only (iterating, or being verified).
    ``initial``: a starting x (its residual is formed by one explicit product, or taken as ``initial_residual``
    where the caller derived it: ``flguard.risk.lanczos.galerkin_start`` — an estimate is enough, as every stop is
    verified on an explicit product's residual); default 0. ``deflation``: a space the start is corrected on
    (Galerkin, ``Deflating.correct``; from 0 that is the start, for no product) and every search direction made
    A-orthogonal to (``Deflating.directions``: deflated CG), so the iteration works on the rest of the space; a
    sample restarted from its true residual is corrected on it again. Its residuals are estimates: every stop is
    verified on an explicit product's residual as without it.
    ``sufficient``: the caller's early stop (``Sufficient``), asked on the recurrence residual's bound
    and again on the true one; a sample it accepts there counts as converged.
    """
    if not bool(((shift > 0) | (rhs.norm(dim=1) == 0)).all()):
        raise ValueError("preconditioned_cg needs shift > 0 (its error bound is ‖r‖/shift) where rhs ≠ 0")
    batch, dim = rhs.shape
    limit = dim if max_iter is None else max_iter
    tiny = torch.finfo(rhs.dtype).tiny

    def apply(v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return _on_rows(matvec, rows_matvec, v, mask) + shift.unsqueeze(1) * v

    active = rhs.norm(dim=1) > 0
    matvecs = iterations = 0
    if initial is None:
        x, r = torch.zeros_like(rhs), rhs.clone()
        if deflation is not None:
            x, r = deflation.correct(x, r)
    else:
        x = torch.where(active.unsqueeze(1), initial, torch.zeros_like(initial))
        if initial_residual is None:
            r = rhs - apply(x, active)
            matvecs += 1
        else:
            r = torch.where(active.unsqueeze(1), initial_residual, torch.zeros_like(initial_residual))
    z = precond(r)
    p = z.clone() if deflation is None else deflation.directions(z)
    rz = (r * z).sum(1)
    converged = ~active
    pending = torch.zeros_like(active)  # passed on the recurrence residual, awaiting the true one
    bound = torch.zeros_like(shift)  # rhs = 0: x = 0 is exact
    while iterations < limit:
        iterations += 1
        ap = apply(p, active)
        matvecs += 1
        step = torch.where(active, rz / (p * ap).sum(1).clamp_min(tiny), torch.zeros_like(rz))
        x = x + step.unsqueeze(1) * p
        r = r - step.unsqueeze(1) * ap
        centre, radius = residual_ball(x, r, shift)
        passed = active & (radius <= rtol * centre.norm(dim=1))
        if sufficient is not None:
            passed = passed | sufficient(centre, radius, active & ~passed)
        pending, active = pending | passed, active & ~passed
        restart = torch.zeros_like(active)
        if not bool(active.any()) and bool(pending.any()):
            true_r = rhs - apply(x, pending)
            matvecs += 1
            r = torch.where(pending.unsqueeze(1), true_r, r)  # a verified sample's r is its true residual from here
            centre, radius = residual_ball(x, r, shift)
            verified = pending & (radius <= rtol * centre.norm(dim=1))
            bound = torch.where(pending, radius, bound)
            if sufficient is not None:
                verified = verified | sufficient(centre, bound, pending & ~verified)
            converged = converged | verified
            restart = pending & ~verified
            active, pending = restart, torch.zeros_like(pending)
            if deflation is not None and bool(restart.any()):  # the true residual left the space's complement
                corrected = deflation.correct(x, r)
                x, r = (torch.where(restart.unsqueeze(1), new, old) for new, old in zip(corrected, (x, r)))
        if not bool(active.any()):
            break
        z = precond(r)
        rz_new = torch.where(active, (r * z).sum(1), rz)
        beta = torch.where(restart, torch.zeros_like(rz), rz_new / rz.clamp_min(tiny))
        direction = z if deflation is None else deflation.directions(z)
        p = torch.where(active.unsqueeze(1), direction + beta.unsqueeze(1) * p, p)
        rz = rz_new
    unverified = ~converged
    if bool(unverified.any()):  # out of iterations: the ball of the x returned, from an explicit product
        r = torch.where(unverified.unsqueeze(1), rhs - apply(x, unverified), r)
        matvecs += 1
    centre, radius = residual_ball(x, r, shift)  # r: every row's true residual now (a verified row's is frozen)
    return CGResult(centre, converged, iterations, matvecs, radius, x)
