"""λmax and the regularised solve from one Lanczos run: ε = eps·λmax and (A_i + ε_iI)⁻¹b_i together.

The calibrated Gaussian guard needs, per sample, λmax of K_i (it sets ε_i = eps·λmax) and then
I2F's solve (K_i + ε_iI)x_i = b_i. Run separately that is a Lanczos run from a random start and a
CG run from b_i. But Lanczos started at b_i builds the Krylov space K_m(A_i, b_i) — the space CG
searches, and a shift-invariant one — so with its basis Q_m and tridiagonal T_m:

- the Ritz values of T_m estimate λmax with the usual residual test β_m|s_m,top| ≤ rtol·θmax
  (``flguard.risk.lanczos``);
- for any ε the Galerkin solution is x_m = ‖b‖Q_m(T_m + εI)⁻¹e₁, CG's iterate, with residual
  ‖b − (A+εI)x_m‖ = ‖b‖β_m|e_mᵀ(T_m + εI)⁻¹e₁| (the Lanczos relation).

A sample stops when both meet rtol, at ε set by that step's θmax. Its stop is then verified like
``flguard.risk.krylov.preconditioned_cg``'s: the true residual by one explicit product (batched
with the next step's Lanczos products), and the sample's answer is the centre of the ball that residual
places x* in (``flguard.risk.krylov.residual_ball``), ``error_bound`` its radius ‖b − (A+εI)x‖/(2ε).
A sample whose true residual misses — in float32 the products of a nearly saturated sample are
accurate to ~1e-3 of λmax and slightly asymmetric, which breaks the Lanczos relation the recurrence
estimate rests on — is finished by PCG from its x, preconditioned by its own Ritz pairs (PCG
re-forms the true residual and restarts from it). Each sample keeps its own basis length: it takes
products only while iterating or being verified.

``sufficient`` (the guard's certificate, ``flguard.risk.krylov.Sufficient``) stops a sample as soon as
its iterate, at its estimated error, serves the caller — on a trained CNN most samples of a batch need
a third of the iterations their rtol test asks (docs/results.md, "Stopping each sample when it
certifies"). Once every sample has stopped and been verified, the rule is asked again on the verified
iterates: a sample it no longer accepts (the batch's least accurate sample converged further and the
target moved) resumes its own Lanczos run where it stopped.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flguard.risk.krylov import (Matvec, RowsMatvec, Sufficient, _on_rows, preconditioned_cg, residual_ball,
                                 spectral_preconditioner)
from flguard.risk.lanczos import from_basis, orthogonalised

_ITERATE, _VERIFY, _DONE = 0, 1, 2
#: With ``sufficient``: a stop whose true error bound is within DRIFT× the recurrence's estimate was
#: judged on a sound estimate; one the rule rejects resumes its Lanczos run (PCG finishes the others).
DRIFT = 2.0


@dataclass
class LanczosSolveResult:
    """Per sample: ``solution`` [B, n]; ``lambda_max`` (θmax when it stopped) and ``eps`` [B];
    ``error_bound`` ≥ ‖solution − x*‖ from an explicit product's residual (``residual_ball``) [B];
    ``lambda_converged`` (the Ritz residual test) and ``converged`` (that and error_bound ≤ rtol‖x‖, or the
    ``sufficient`` rule's acceptance of the verified x) [B]."""

    solution: torch.Tensor
    lambda_max: torch.Tensor
    eps: torch.Tensor
    error_bound: torch.Tensor
    lambda_converged: torch.Tensor
    converged: torch.Tensor
    iterations: int
    matvecs: int
    iterate: torch.Tensor | None = None  # the Galerkin (or PCG) iterate whose residual placed the ball


def lanczos_solve(matvec: Matvec, rhs: torch.Tensor, *, eps: float, relative: bool = True, rtol: float = 1e-3,
                  max_iter: int | None = None, rows_matvec: RowsMatvec | None = None,
                  seed: int = 0, skip: torch.Tensor | None = None,
                  sufficient: Sufficient | None = None) -> LanczosSolveResult:
    """λmax of each PSD A_i and (A_i + ε_iI)⁻¹rhs_i, ε_i = eps·λmax_i (``relative``) or eps, from one
    Lanczos run per sample started at rhs_i (a random start where rhs_i = 0: x = 0 there).

    ``max_iter`` caps each sample's basis (default n). ``rows_matvec``: products on the samples that
    need them only (iterating or being verified). ``skip`` [B] bool: samples not to solve at all — no
    product, x = 0, neither λmax nor the solve converged (a caller that can leave them out).
    ``sufficient``: a sample whose λmax has converged may stop once the rule accepts its iterate at the
    estimated error (module doc); the verified iterates are asked again when all have stopped.
    """
    batch, dim = rhs.shape
    limit = dim if max_iter is None else min(max_iter, dim)
    dtype, device = rhs.dtype, rhs.device
    machine, tiny = torch.finfo(dtype).eps, torch.finfo(dtype).tiny
    generator = torch.Generator(device=device).manual_seed(seed)
    rows = torch.arange(batch, device=device)

    rhs_norm = rhs.norm(dim=1)
    random = torch.randn(batch, dim, generator=generator, dtype=dtype, device=device)
    start = torch.where((rhs_norm > 0).unsqueeze(1), rhs, random)
    capacity = min(limit, 16) + 1  # grown as the longest basis needs: most samples stop early
    basis = torch.zeros(batch, capacity, dim, dtype=dtype, device=device)
    basis[:, 0] = start / start.norm(dim=1, keepdim=True)
    alpha = torch.zeros(batch, capacity, dtype=dtype, device=device)
    beta = torch.zeros(batch, capacity, dtype=dtype, device=device)
    length = torch.zeros(batch, dtype=torch.long, device=device)  # Lanczos products taken per sample
    phase = torch.full((batch,), _ITERATE, dtype=torch.long, device=device)
    if skip is not None:
        phase = torch.where(skip.to(device), torch.full_like(phase, _DONE), phase)
    refine = torch.zeros(batch, dtype=torch.bool, device=device)
    x, iterates = torch.zeros_like(rhs), torch.zeros_like(rhs)
    lambda_max, shift, bound = (torch.zeros(batch, dtype=dtype, device=device) for _ in range(3))
    lambda_ok = torch.zeros(batch, dtype=torch.bool, device=device)
    exhausted = torch.zeros_like(lambda_ok)
    accepted = torch.zeros_like(lambda_ok)  # stopped by ``sufficient``, and accepted on the verified x
    iterations = matvecs = 0
    while bool((phase != _DONE).any()):
        iterations += 1
        iterating, verifying = phase == _ITERATE, phase == _VERIFY
        current = basis[rows, length]
        out = _on_rows(matvec, rows_matvec, torch.where(verifying.unsqueeze(1), x, current), iterating | verifying)
        matvecs += 1

        if bool(verifying.any()):  # the true residual of the samples that stopped last step
            residual = torch.where((rhs_norm > 0).unsqueeze(1), rhs - out - shift.unsqueeze(1) * x, torch.zeros_like(x))
            centre, true_bound = residual_ball(x, residual, shift)
            estimate, bound = bound, torch.where(verifying, true_bound, bound)
            iterate, x = x, torch.where(verifying.unsqueeze(1), centre, x)  # the ball's centre is the answer
            iterates = torch.where(verifying.unsqueeze(1), iterate, iterates)
            passed = true_bound <= rtol * x.norm(dim=1)
            resume = torch.zeros_like(passed)
            if sufficient is not None:  # rejected on a sound estimate: the target moved, so iterate on
                passed = passed | sufficient(x, bound, verifying & ~passed & lambda_ok & (shift > 0))
                resume = verifying & ~passed & ~exhausted & (true_bound <= DRIFT * estimate)
            # the recurrence estimate drifted: PCG below (which needs ε > 0; a sample without it stays unconverged)
            refine = refine | (verifying & ~passed & ~exhausted & ~resume & (shift > 0))
            x = torch.where(refine.unsqueeze(1), iterate, x)  # PCG starts from the iterate, whose residual is small
            phase = torch.where(resume, _ITERATE, torch.where(verifying, _DONE, phase))

        if bool(iterating.any()):
            idx = iterating.nonzero().squeeze(1)
            w, q, m = out[idx], current[idx], length[idx]
            if int(m.max()) + 2 > capacity:  # room for this vector's successor
                grow = min(capacity, limit + 1 - capacity)
                basis = torch.cat([basis, basis.new_zeros(batch, grow, dim)], dim=1)
                alpha, beta = (torch.cat([t, t.new_zeros(batch, grow)], dim=1) for t in (alpha, beta))
                capacity += grow
            size = int(m.max()) + 1  # the longest basis among them, this vector included
            alpha[idx, m] = (w * q).sum(1)
            used = basis[idx, :size]  # rows past each sample's length are zero: harmless in Gram-Schmidt
            for _ in range(2):  # full re-orthogonalisation, twice
                w = orthogonalised(used, w)
            b = w.norm(dim=1)
            length[idx] = m + 1
            theta, top_residual, y_last, y, eps_now = _tridiagonal_facts(alpha[idx], beta[idx], length[idx], b,
                                                                         eps, relative, rhs_norm[idx])
            top = theta[:, -1]
            lam_ok = top_residual <= rtol * top.abs().clamp_min(tiny)
            no_rhs = rhs_norm[idx] == 0  # x = 0 is exact; λmax is still wanted
            # a sample that stops: x = Q y, checked against the true residual at the next product; until then its
            # residual is −y_m·w by the Lanczos relation (w = β_m q_{m+1}), which gives the ball's estimate
            solution = from_basis(used, y[:, :size])
            centre, radius = residual_ball(solution, -y_last.unsqueeze(1) * w, eps_now)
            solve_ok = no_rhs | ((eps_now > 0) & (radius <= rtol * centre.norm(dim=1)))
            full = length[idx] >= limit
            if sufficient is not None:  # every iterate is current, so the rule sees the whole batch
                x[idx], bound[idx] = centre, radius
                ask = torch.zeros_like(lambda_ok)
                ask[idx] = lam_ok & ~solve_ok & (eps_now > 0)  # ε = 0: no error bound to judge it by
                solve_ok = solve_ok | sufficient(x, bound, ask)[idx]
            stop = (lam_ok & solve_ok) | full
            x[idx] = torch.where(stop.unsqueeze(1), solution, x[idx])
            lambda_max[idx], shift[idx], lambda_ok[idx], exhausted[idx] = top, eps_now, lam_ok, full
            phase[idx] = torch.where(stop, _VERIFY, phase[idx])
            # every iterating sample gets its next Lanczos vector (a fresh orthogonal one at a
            # breakdown), so one whose stop fails the check can resume where it stopped
            broken = b <= 10 * machine * top.abs().clamp_min(tiny)
            following = w / torch.where(broken, torch.ones_like(b), b).unsqueeze(1)
            if bool(broken.any()):  # drawn only at a step where some sample broke down
                fresh = torch.randn(idx.numel(), dim, generator=generator, dtype=dtype, device=device)
                for _ in range(2):
                    fresh = orthogonalised(used, fresh)
                following = torch.where(broken.unsqueeze(1), fresh / fresh.norm(dim=1, keepdim=True), following)
            basis[idx, length[idx]] = following
            beta[idx, m] = torch.where(broken, torch.zeros_like(b), b)
        if sufficient is not None and not bool((phase != _DONE).any()):
            # all verified: the rule again on the verified iterates; one it no longer accepts resumes
            tight = bound <= rtol * x.norm(dim=1)
            open_ = ~tight & lambda_ok & ~refine & ~exhausted & (length > 0) & (shift > 0)
            accepted = sufficient(x, bound, open_)
            resume = open_ & ~accepted
            phase = torch.where(resume, torch.full_like(phase, _ITERATE), phase)
    if bool(refine.any()):
        idx = refine.nonzero().squeeze(1)
        x[idx], bound[idx], extra, finished, iterates[idx] = _finish_with_pcg(
            matvec, rows_matvec, rhs, x, shift, idx, (basis, alpha, beta, length), rtol, limit, sufficient, bound)
        matvecs += extra
        accepted[idx] = finished  # by rtol or by the rule, on PCG's true residual
    # ε = 0 with rhs ≠ 0 (K_i zero in float32) leaves ‖r‖/ε no bound at all: x and it overflow, never "converged"
    bounded = ((shift > 0) | (rhs_norm == 0)) & torch.isfinite(bound) & torch.isfinite(x.norm(dim=1))
    converged = lambda_ok & bounded & ((bound <= rtol * x.norm(dim=1)) | accepted)
    return LanczosSolveResult(x, lambda_max, shift, bound, lambda_ok, converged, iterations, matvecs, iterates)


def _finish_with_pcg(matvec: Matvec, rows_matvec: RowsMatvec | None, rhs: torch.Tensor, x: torch.Tensor,
                     shift: torch.Tensor, idx: torch.Tensor, lanczos_state: tuple, rtol: float,
                     limit: int, sufficient: Sufficient | None = None, bounds: torch.Tensor | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor, int, torch.Tensor, torch.Tensor]:
    """(x, error bound, products, converged, iterate) of the samples ``idx`` by PCG from their Lanczos x,
    preconditioned by their own Ritz pairs (the padding past a sample's length gives θ = 0 pairs, which
    the spectral preconditioner leaves alone); ``sufficient`` sees the whole batch, the other samples' x
    and error ``bounds`` as they are."""
    basis, alpha, beta, length = lanczos_state
    batch = rhs.shape[0]
    size = int(length[idx].max())
    theta, s = torch.linalg.eigh(_tridiagonal(alpha[idx], beta[idx], length[idx], size))
    precond = spectral_preconditioner(theta, torch.einsum("rkn,rkj->rjn", basis[idx, :size], s), shift[idx])

    def sub_rows(v: torch.Tensor, sub: torch.Tensor) -> torch.Tensor:
        mask = torch.zeros(batch, dtype=torch.bool, device=rhs.device)
        mask[idx[sub]] = True
        padded = torch.zeros_like(rhs)
        padded[idx[sub]] = v
        return _on_rows(matvec, rows_matvec, padded, mask)[idx[sub]]

    def sub_rule(v: torch.Tensor, error: torch.Tensor, ask: torch.Tensor) -> torch.Tensor:
        whole, errors, asked = x.clone(), bounds.clone(), torch.zeros_like(shift, dtype=torch.bool)
        whole[idx], errors[idx], asked[idx] = v, error, ask
        return sufficient(whole, errors, asked)[idx]

    every = torch.arange(idx.numel(), device=rhs.device)
    finish = preconditioned_cg(lambda v: sub_rows(v, every), rhs[idx], shift[idx], precond, rtol=rtol,
                               max_iter=limit, rows_matvec=sub_rows, initial=x[idx],
                               sufficient=None if sufficient is None else sub_rule)
    return finish.solution, finish.error_bound, finish.matvecs, finish.converged, finish.iterate


def _tridiagonal(alpha: torch.Tensor, beta: torch.Tensor, length: torch.Tensor, size: int) -> torch.Tensor:
    """T_m of each row [r, size, size] from its α and β, zero past its length m."""
    inside = torch.arange(size, device=alpha.device).unsqueeze(0) < length.unsqueeze(1)
    a = torch.where(inside, alpha[:, :size], torch.zeros_like(alpha[:, :size]))
    off = torch.where(inside[:, 1:], beta[:, :size - 1], torch.zeros_like(beta[:, :size - 1]))
    return torch.diag_embed(a) + torch.diag_embed(off, offset=1) + torch.diag_embed(off, offset=-1)


def _tridiagonal_facts(alpha: torch.Tensor, beta: torch.Tensor, length: torch.Tensor, last_beta: torch.Tensor,
                       eps: float, relative: bool, rhs_norm: torch.Tensor):
    """For rows of different lengths m (padded to the longest): Ritz values θ [r, M] (ascending, padding
    as zeros: T is PSD, so θmax is unaffected), the top Ritz residual β_m|s_m,top|, the Galerkin
    coefficients y = ‖b‖(T_m+εI)⁻¹e₁ [r, capacity] (zero on the padding), their last entry y_m, and ε
    (eps·θmax when ``relative``)."""
    size = int(length.max())
    r = alpha.shape[0]
    inside = torch.arange(size, device=alpha.device).unsqueeze(0) < length.unsqueeze(1)  # [r, M]
    t = _tridiagonal(alpha, beta, length, size)
    theta, s = torch.linalg.eigh(t)
    last = (length - 1).view(-1, 1, 1).expand(-1, 1, size)
    s_last = s.gather(1, last).squeeze(1)  # [r, M]: row m-1 of the eigenvectors
    top_residual = last_beta * s_last[:, -1].abs()
    top = theta[:, -1]
    eps_now = eps * top if relative else torch.full_like(top, eps)
    # y = ‖b‖(T + εI)⁻¹e₁ = ‖b‖·S diag(1/(θ + ε)) Sᵀe₁ from the eigenpairs already at hand (no solve per
    # iteration). The padding is a zero block of the padded T, so e₁ has no part in it: y is zeroed there.
    # (A zero operator has ε = 0 and b = 0: the tiny shift keeps 1/(θ + ε) finite, and y = 0.)
    shifted = theta + eps_now.clamp_min(torch.finfo(alpha.dtype).tiny).unsqueeze(1)
    y = torch.einsum("rij,rj->ri", s, s[:, 0, :] / shifted) * rhs_norm.unsqueeze(1)
    y = torch.where(inside, y, torch.zeros_like(y))
    y_last = y.gather(1, (length - 1).unsqueeze(1)).squeeze(1)
    padded = torch.zeros(r, alpha.shape[1], dtype=alpha.dtype, device=alpha.device)
    padded[:, :size] = y
    return theta, top_residual, y_last, padded, eps_now
