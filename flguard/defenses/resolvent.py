"""Resolvent noise: each sample's random input noise filtered by (K_i+ε_iI)⁻¹ on a short Krylov space, each
sample's part scaled to unit I²F on its own sample, carried to the update through the Jacobians.

δ = Σ_i J_iᵀv_i/ι_i, v_i ≈ (K_i+ε_iI)⁻¹z_i and ι_i ≈ ‖(K_i+ε_iI)⁻¹K_iv_i‖ — the I²F that sample i's own part
causes on sample i — both taken on the Krylov space of a Lanczos run on K_i started at z_i (z_i ~ N(0, I_dx)
up to its norm, fresh per sample and step; K_i's Krylov spaces do not depend on the shift ε_i): v_i is CG's
k_i-th iterate, Q_i(T_i+ε_iI)⁻¹e₁ on the run's first k_i vectors, and ι_i the Galerkin solution's norm on the whole
run (``krylov_resolvent``). The run is the guard's own λmax run, which goes on to ``run_steps()`` steps at least
(``DefenseContext.spectrum``; ε_i is read off that very run), so the direction costs no product beyond the run's and
one summed Jᵀ product for δ; without it the defense runs one of its own.

Each sample's filter length k_i is its own (``CHOOSE_FILTER``, on a run of ``RUN_STEPS`` = 6): of the run's prefixes,
the one with the most own I²F per unit of ‖K_iv_i(k)‖ (``chosen_resolvent``, ``FILTER_CHOICE = "kernel"``), read off
T_i. Weighing the noise by ‖J_iᵀv‖ alone (``"norm"``) aims best per unit of norm but leaves the noise along large-θ
directions, where the loss curves most: measured, the trained CNN's rounds lost 3 points with it. ‖K_iv‖ weighs each
direction by θ_j once more; the samples pick k = 4–5 on trained models (on average: in the trained quickstart CNN's
seeded round most pick 2–3, some 6–7), the second-order loss the noise adds stays
level with the former fixed filter (6 of a 9-step run, ``CHOOSE_FILTER = False``), and the rounds train as they did,
for a fifth fewer products in the trained CNN's rounds, 8–16% on trained ResNets (docs/results.md, "Each
sample's own filter length").

Why: along the eigenvector u_j of K_i (eigenvalue θ_j) noise of unit norm moves sample i's best
reconstruction by the regularised gain √θ_j/(θ_j+ε), largest at θ_j = ε. Eigen finds directions near
that peak with a 64-step Lanczos run per sample; the resolvent puts the noise there directly — the
noise's energy along u_j is θ_j/(θ_j+ε)²·(u_jᵀz)², itself peaked at θ_j = ε, over every direction of
the spectrum rather than a few resolved ones — and a polynomial of low degree already suppresses the
large-θ directions that buy little I²F per unit of noise. What makes it work is the per-sample scale
ι_i (as eigen's normalisation to unit estimated I²F): without it the samples whose K_i is largest take
the noise and the least protected sample gets little (``rowspace``, which sums the filtered noise
unscaled). Measured (docs/results.md, "Resolvent noise from the λmax run, and auto's fallback"): on trained
ResNet-20-GN batches (B = 8) the least protected sample's I²F per unit of noise 0.77–1.9× eigen's, on the CNN at its
initialisation 1.25–1.35×; a guarded ResNet-18-GN step at B = 8 in 30 products per sample against eigen's 135; the
CNN trained from scratch by federated rounds as well as with eigen — so it is ``auto``'s aimed noise by default. The
direction only shapes the noise; the guard scales it to the floor and verifies every sample on the noise sent, as
for every other direction.
"""

from __future__ import annotations

import torch

from flguard.defenses.base import DefenseContext, Direction
from flguard.risk.clipped import Jacobian
from flguard.risk.lanczos import LanczosResult, from_basis
from flguard.risk.regularised import RegularisedK

#: The fixed filter (``CHOOSE_FILTER = False``, the default until 2026-11-27): v_i on the first FILTER_STEPS steps
#: (CG's FILTER_STEPS-th iterate) of a run of FILTER_STEPS + NORM_STEPS, the further steps refining ι_i; a longer run
#: filters on its first FILTER_STEPS. Measured (docs/results.md, "Resolvent noise from the λmax run";
#: ``benchmarks/study_aimed_noise.py``).
FILTER_STEPS, NORM_STEPS = 6, 3
#: Each sample's filter length chosen from a run of at least RUN_STEPS (``chosen_resolvent``), weighing the noise by
#: FILTER_CHOICE: "kernel" (‖K_iv‖, the default) or "norm" (‖J_iᵀv‖, measured and not kept: it trained the CNN worse).
#: ``run_steps`` reads CHOOSE_FILTER at call time. Measured: docs/results.md, "Each sample's own filter length".
CHOOSE_FILTER = True
RUN_STEPS = 6
FILTER_CHOICE = "kernel"


def run_steps() -> int:
    """The λmax run's least length for resolvent noise under the current ``CHOOSE_FILTER``: its filter and its scale."""
    return RUN_STEPS if CHOOSE_FILTER else FILTER_STEPS + NORM_STEPS


def resolvent(ctx: DefenseContext) -> Direction:
    """Σ_i J_iᵀv_i/ι_i (module doc) on the step's (clipped) operator at the guard's ε_i."""
    op = ctx.op
    run = ctx.spectrum
    steps = run_steps()
    if run is None or run.basis.shape[1] < min(steps, op.dx):
        run = RegularisedK(op).lanczos(rtol=0.0, min_iter=steps, max_iter=steps, start=resolvent_start(ctx.generator, op))
    if CHOOSE_FILTER:
        filtered, own, lengths = chosen_resolvent(run, ctx.eps, FILTER_CHOICE)
    else:
        filtered, own = krylov_resolvent(run, ctx.eps, FILTER_STEPS)
        lengths = torch.full_like(own, float(min(FILTER_STEPS, run.basis.shape[1])))
    vector = carried(op, filtered, own)
    return Direction(vector, {"kind": "resolvent", "own_i2f": own, "filter_steps": lengths,
                              "filter_steps_mean": float(lengths.mean()), "lanczos_steps": float(run.basis.shape[1])})


def carried(op: Jacobian, filtered: torch.Tensor, own: torch.Tensor) -> torch.Tensor:
    """δ = Σ_i J_iᵀv_i/ι_i: each sample's filtered noise v_i (``filtered`` [B, dx]) scaled to unit own I²F ι_i
    (``own`` [B]) and carried to the update by one summed Jᵀ product. A sample with no usable part (ι_i zero or
    non-finite) gets no noise of its own; the verification on the noise sent decides about it. Raises where no
    sample has one, or the product is zero or non-finite."""
    usable = torch.isfinite(own) & (own > 0) & torch.isfinite(filtered).all(dim=1)
    if not bool(usable.any()):
        raise RuntimeError("resolvent noise: no sample's Jacobian moves its recovery (every K_i zero or non-finite)")
    weights = torch.where(usable, 1.0 / torch.where(usable, own, torch.ones_like(own)), torch.zeros_like(own))
    vector = op.jt_sum(torch.where(usable.unsqueeze(1), filtered, torch.zeros_like(filtered)) * weights.unsqueeze(1))
    if not bool(torch.isfinite(vector).all()) or not bool(vector.any()):
        raise RuntimeError("resolvent noise: the samples' Jacobians map the filtered noise to zero or non-finite values")
    return vector


def resolvent_start(generator: torch.Generator, op: Jacobian) -> torch.Tensor:
    """z_i ~ N(0, I_dx) per sample [B, dx] from the guard's stream: the Lanczos run's start, so the noise's
    randomness is the stream's (its 64-bit OS-entropy seed), not a run's 31-bit seed."""
    return torch.randn(op.batch_size, op.dx, generator=generator, dtype=op.dtype, device=op.device)


def krylov_resolvent(run: LanczosResult, eps: torch.Tensor,
                     filter_steps: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(v_i [B, dx], ι_i [B]) from a Lanczos run of m steps on K_i (basis Q_i, first vector the start;
    T_i = S_iΘ_iS_iᵀ from ``coordinates`` and Ritz values): v_i = Q_i[:k]·(T_i[:k, :k]+ε_iI)⁻¹e₁ on the first
    k = ``filter_steps`` (default m) vectors — CG's k-th iterate — and ι_i = ‖(T_i+ε_iI)⁻¹T_i[:, :k]y_i‖, the
    Galerkin solution on all m vectors of (K_i+ε_iI)w = K_iv_i. For k < m, K_iv_i = Q_iT_i[:, :k]y_i exactly (the
    Lanczos relation), so the m − k further steps refine ι_i as that many CG steps from K_iv_i would (their Krylov
    space lies inside Q_i's); for k = m the part of K_iv_i beyond the run is dropped. A zero block (T_i = 0) gives
    ι_i = 0, and ε_i = 0 there non-finite values; the caller drops such a sample's part."""
    y, galerkin = _coefficients_and_galerkin(run, eps, filter_steps)
    return from_basis(run.basis[:, :y.shape[1]], y), galerkin.norm(dim=1)


def chosen_resolvent(run: LanczosResult, eps: torch.Tensor, by: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(v_i [B, dx], ι_i [B], k_i [B]): ``krylov_resolvent``'s pair on the prefix k_i of the run (1 ≤ k_i ≤ m) that
    maximises ι_i(k)/‖K_i^(p/2)v_i(k)‖, v_i(k) = Q_i[:k]y_k: ``by="norm"`` (p = 1) the own I²F per unit of the
    sample's own noise, ‖J_iᵀv‖² = y_kᵀT_i[:k, :k]y_k; ``by="kernel"`` (p = 2) per unit of ‖K_iv‖, which weighs the
    noise along each direction of K_i by its θ_j as well — ‖K_iv‖² = ‖T_i[:, :k]y_k‖² + (β_m·y_k[-1])² where k = m
    (β_m the run's last off-diagonal, ‖residuals‖). A sample whose every k gives a zero or non-finite ratio keeps
    k = 1 (its ι_i is then zero or non-finite and ``carried`` drops its part). No product: m small eigenproblems."""
    if by not in ("norm", "kernel"):
        raise ValueError(f"by={by!r} must be 'norm' or 'kernel'")
    best = None  # [y padded to the run's m, ι, k, ratio]: v_i formed once, for the k chosen
    m, projected = run.basis.shape[1], _projected(run)
    for k in range(1, m + 1):
        y, galerkin, energy = _coefficients_and_galerkin(run, eps, k, energy=by, projected=projected)
        own = galerkin.norm(dim=1)
        ratio = own / energy.clamp_min(0.0).sqrt()
        ratio = torch.where(torch.isfinite(ratio), ratio, torch.full_like(ratio, -1.0))
        y = torch.nn.functional.pad(y, (0, m - k))
        if best is None:
            best = [y, own, torch.ones_like(own), ratio]
            continue
        better = ratio > best[3]
        best = [torch.where(better.unsqueeze(1), y, best[0]), torch.where(better, own, best[1]),
                torch.where(better, torch.full_like(own, float(k)), best[2]), torch.where(better, ratio, best[3])]
    return from_basis(run.basis, best[0]), best[1], best[2]


def own_solution(run: LanczosResult, eps: torch.Tensor, filter_steps: int | None = None) -> torch.Tensor:
    """w_i [B, dx]: ``krylov_resolvent``'s Galerkin solution of (K_i+ε_iI)w = K_iv_i in input space (‖w_i‖ = ι_i) —
    the solve of sample i's own part of resolvent noise that the run already holds."""
    _, galerkin = _coefficients_and_galerkin(run, eps, filter_steps)
    return torch.einsum("bmn,bmj,bj->bn", run.basis, run.coordinates, galerkin)


def _coefficients_and_galerkin(run: LanczosResult, eps: torch.Tensor, filter_steps: int | None,
                               energy: str | None = None, projected: torch.Tensor | None = None):
    """(y_i [B, k], v_i = Q_i[:k]y_i's coefficients on the run's first k vectors; the Galerkin solution's coordinates
    in T_i's eigenbasis [B, m]) — ``krylov_resolvent``'s parts, no pass over the input space; ``energy`` adds
    ‖J_iᵀv_i‖² = yᵀT_i[:k, :k]y ("norm") or ‖K_iv_i‖² ("kernel", ``chosen_resolvent``) [B]. ``projected``: T_i =
    S_iΘ_iS_iᵀ (``_projected``) where the caller asks for several k."""
    m = run.basis.shape[1]
    k = m if filter_steps is None else min(filter_steps, m)
    theta = run.ritz_values.clamp_min(0.0)  # K_i is PSD: a negative Ritz value is rounding
    t = _projected(run) if projected is None else projected
    block = t[:, :k, :k]
    # y = (T_i[:k, :k]+ε_iI)⁻¹e₁ through the block's eigenvalues (clamped at zero): never raises; a singular shifted
    # block gives non-finite values
    values, vectors = torch.linalg.eigh(block)
    inverse = 1.0 / (values.clamp_min(0.0) + eps.unsqueeze(1))
    y = (vectors @ (inverse * vectors[:, 0, :]).unsqueeze(2)).squeeze(2)
    # (T_i+ε_iI)⁻¹T_i[:, :k]y = S_i(Θ_i+ε_iI)⁻¹Θ_iS_i[:k]ᵀy, in S_i's coordinates: its norm is ι_i (S_i orthogonal)
    galerkin = theta / (theta + eps.unsqueeze(1)) * (y.unsqueeze(1) @ run.coordinates[:, :k, :]).squeeze(1)
    if energy == "norm":
        return y, galerkin, (y * (block @ y.unsqueeze(2)).squeeze(2)).sum(dim=1)
    if energy == "kernel":  # K_iQ_i[:k]y = Q_iT_i[:, :k]y (+ β_m·y[-1]·q_{m+1} where k = m: the Lanczos relation)
        image = (t[:, :, :k] @ y.unsqueeze(2)).squeeze(2)
        outside = run.residuals.norm(dim=1) * y[:, -1] if k == m else torch.zeros_like(y[:, 0])
        return y, galerkin, (image ** 2).sum(dim=1) + outside ** 2
    return y, galerkin


def _projected(run: LanczosResult) -> torch.Tensor:
    """T_i = Q_iᵀK_iQ_i = S_iΘ_iS_iᵀ [B, m, m] from the run's Ritz values (clamped at zero: K_i is PSD) and their
    coordinates."""
    coordinates = run.coordinates
    return (coordinates * run.ritz_values.clamp_min(0.0).unsqueeze(1)) @ coordinates.transpose(1, 2)
