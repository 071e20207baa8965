"""Meeting the floor: the least scale of a noise direction at which every sample's certified
recovery error reaches τ, within the noise budget, leaving samples out where ``max_excluded`` allows.

I²F's shift Δx_i = (K_i+εI)⁻¹J_iδ is linear in δ, so one solve per sample on the realised direction
gives every sample's I²F at any scale of it; ``FloorCalibrator.meet`` fits that scale, verifies it on
the noise actually sent and reports why not when the budget is too small. The defense that chose
the direction is ``flguard.guard.perturb``'s; the fail-closed policy is ``flguard.guard.engine``'s.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from flguard.defenses import DIRECTIONS, DefenseContext, Direction
from flguard.defenses.gaussian import gaussian_direction
from flguard.guard.box_bound import BoxProfile, flat64
from flguard.guard.config import GuardConfig
from flguard.guard.exclusion import excludable, kept_gradient, negligible_samples, reachable_at
from flguard.guard.failure import GuardFailure
from flguard.risk.assess import i2f_solve, jacobian_product
from flguard.risk.closed_forms import from_rmse, i2f_lower_bound, to_rmse
from flguard.risk.clipped import Jacobian, base_operator
from flguard.risk.krylov import Sufficient

#: The I²F solves behind the floor run PCG preconditioned by the Lanczos run's Ritz pairs (the
#: spectral preconditioner of ``flguard.risk.krylov``), stopped on the true residual: same
#: certificate from the true residual (``flguard.risk.krylov.residual_ball``), fewer Jacobian products (docs/results.md "Issue 12 §3 — cost,
#: continued"): on the demo's trained CNN 5–11% fewer CG products per step, and a certificate on
#: the true residual — plain CG's recurrence residual under-stated it by up to 6% in float32.
#: False: plain CG, as before.
PRECONDITION_CG = True

#: Iterations per sample at most in the guard's Lanczos and CG runs (eigen: at least its
#: ``krylov_steps``): a solve takes 3–30 on the models measured; a sample still iterating at 100 is
#: one whose float32 products cannot certify it (a well-fitted sample with a negligible gradient),
#: and without the cap it ran to the input size, thousands of small products per step.
SOLVER_MAX_ITER = 100

#: The I²F solves stop each sample once it certifies at the scale the batch's least accurate sample will
#: need (``FloorCalibrator.sufficient``), not at rtol: on the trained quickstart CNN most samples are
#: saturated in the pixel box and need a third of the iterations (docs/results.md, "Stopping each sample
#: when it certifies"). The floor is fitted and verified on the verified solves either way. Applies to
#: the one-run solve (gaussian, rowspace) and to a single direction's PCG solve (eigen without
#: ``gaussian_floor``). False: every sample to rtol, as before.
STOP_WHEN_SUFFICIENT = True

#: The preconditioned I²F solve starts from the Galerkin solution on the λmax run's Krylov space (resolvent and
#: eigen: the run their direction came from), its residual from the Lanczos relation — no product
#: (``flguard.risk.lanczos.galerkin_start``); the certificate still rests on an explicit product's residual.
#: Measured on trained models' seeded steps: 10% fewer products a step on ResNet-20-GN (B = 8), 6% on ResNet-18-GN,
#: 2.5% on the quickstart CNN (docs/results.md, "The guard step's own overhead, and the verification solve started
#: where the λmax run left off"). False: from zero, as before.
GALERKIN_START = True
#: With GALERKIN_START, the solve's search directions are also kept A-orthogonal to that Krylov space (deflated CG,
#: ``flguard.risk.lanczos.Deflation``: the run's T_i and remainder give (K_i + ε_iI)Q_i for no product). Measured
#: (docs/results.md, the same section): 3% fewer products a step on the trained ResNet-20-GN and ResNet-18-GN, 0.5% on
#: the quickstart CNN, beyond the start's. False: the start only.
DEFLATED_CG = True


@dataclass
class Outcome:
    """One defense's result on a step: the noise, each sample's certified RMSE after it, whether the
    floor was met (else why not) and, with left-out samples, the update without them."""
    noise: torch.Tensor
    rmse_after: torch.Tensor
    rmse_lb_after: torch.Tensor
    eps: torch.Tensor
    met: bool
    reason: str = ""
    info: dict = field(default_factory=dict)
    update: torch.Tensor | None = None  # the upload without left-out samples (``max_excluded``); None: all kept
    rmse_error: torch.Tensor | None = None  # per sample, |rmse_after − the exact value| at most this (``GuardReport``)


class FloorCalibrator:
    """Scales one step's noise direction to the floor (``config.floor``) within the budget: C = ``clip``,
    this step's clipping norm, or None (the budget is then in units of ‖g‖)."""

    def __init__(self, config: GuardConfig, clip: float | None) -> None:
        self.config = config
        self.clip = clip

    def meet(self, ctx: DefenseContext,
             solved: tuple[Direction, tuple[torch.Tensor, ...]] | None = None,
             kind: str = "gaussian") -> Outcome:
        """Scale the defense's direction d so that every sample's I2F RMSE ≥ τ.

        I2F's shift Δx = (K+εI)⁻¹Jδ is linear in δ, so for c·d it is c·Δx(d) exactly: one CG solve on
        the realised direction gives every sample's I2F for the noise actually sent. Each sample's
        solve carries its verified error bound η_i ≥ ‖Δx̃_i − Δx_i‖, so c·(‖Δx̃_i‖ − η_i) bounds its
        exact I2F below; the scale is fitted so that this certified bound reaches τ(1 + rtol) — the
        exact value is then above τ. With ``input_bounds`` the promise is about clip(x + c·Δx) − x
        instead, bounded below from Δx̃ and η_i (``box_scale``, ``flguard.guard.box_bound``).
        ``solved``: the direction and its checked solve when they came from elsewhere
        (the Gaussian's one Lanczos run, ``flguard.guard.perturb``).
        """
        cfg, op = self.config, ctx.op
        direction = solved[0] if solved is not None else DIRECTIONS[kind](ctx)
        if cfg.floor == 0:
            zeros = torch.zeros(op.batch_size, dtype=op.dtype, device=op.device)
            return Outcome(torch.zeros_like(ctx.gradient), zeros, zeros, ctx.eps, True)
        vector = direction.vector
        floor = cfg.gaussian_floor if kind == "eigen" else 0.0
        # with max_excluded, a sample whose I2F cannot be certified at all (CG did not converge, or the
        # noise does not move it) is one more sample to leave out rather than a reason to withhold
        budget = noise_budget(ctx.gradient, cfg, self.clip, op.span)
        rule = (self.sufficient(op.x, budget / max(float(vector.norm()), 1e-30))
                if STOP_WHEN_SUFFICIENT and floor == 0 and solved is None else None)
        shift, unit_jd, usable, slack = (solved[1] if solved is not None else
                                         self.solve(ctx, vector, allow_unusable=cfg.max_excluded > 0 and floor == 0,
                                                    sufficient=rule))
        info: dict = {}
        if floor > 0:  # an isotropic part of its own that meets floor·τ: no subspace to discard
            z = gaussian_direction(ctx).vector
            shift_z, _, _, slack_z = self.solve(ctx, z)
            scale_z, rmse_z, _ = self._fit(op.x, shift_z, slack_z, floor * cfg.floor, budget / float(z.norm()))
            scale_e, _, _ = self._fit(op.x, shift, slack, cfg.floor, budget / float(vector.norm()))
            vector, shift = scale_z * z + scale_e * vector, scale_z * shift_z + scale_e * shift
            slack = scale_z * slack_z + scale_e * slack  # the triangle inequality
            info["rmse_gaussian_part"] = rmse_z
        limit, at_least = budget / max(float(vector.norm()), 1e-30), 1.0 if floor > 0 else 0.0
        certifiable = bool(usable.all())
        scale, rmse, reachable = (self._fit(op.x, shift, slack, cfg.floor, limit, at_least) if certifiable
                                  else (limit, None, False))
        keep = None
        if not (reachable and float(vector.norm()) * scale <= budget):
            chosen = self._protectable(op, shift, slack, limit, usable)
            if chosen is None and not certifiable:
                raise GuardFailure(_UNUSABLE)
            if chosen is not None:  # fitted up to the scale at which the kept samples all certify
                keep, at, free, fitted = chosen
                keep = None if bool(keep.all()) else keep
                scale, rmse, reachable = fitted or self._fit(op.x, shift, slack, cfg.floor, max(at, at_least), at_least,
                                                             keep=keep)
                if keep is not None:
                    info["excluded"] = int((~keep).sum())
                    info["excluded_negligible"] = int((~keep & free).sum())
        info["rmse_unbounded"] = to_rmse((shift if keep is None else shift[keep]).norm(dim=1) * scale, op.dx)
        # ‖c·Δ̃ − c·Δ‖ ≤ c·η, and clip is 1-Lipschitz: the reported RMSE is within c·η/√dx of the exact one
        error = to_rmse(slack * scale, op.dx) if keep is None else torch.where(keep, to_rmse(slack * scale, op.dx), 0.0)
        noise = vector * scale
        jd = jacobian_product(op, noise).norm(dim=1) if floor > 0 else unit_jd * scale
        if keep is not None:  # a left-out sample is not in the update: nothing of it to recover
            jd = torch.where(keep, jd, torch.full_like(jd, float("inf")))
        info = {"scale": float(scale), **({"clip": self.clip} if self.clip is not None else {}),
                **_summaries({**direction.info, **info})}
        if reachable and not bool((rmse >= cfg.floor * (1 + cfg.rtol)).all()):  # non-finite arithmetic
            raise GuardFailure("the floor could not be verified on the realised noise")
        if not reachable or float(noise.norm()) > budget:
            return Outcome(noise, rmse, rmse_lb(jd, ctx.lambda_max, op.dx), ctx.eps, False,
                            f"the floor τ={cfg.floor:.4g} needs noise {float(noise.norm()):.4g} = "
                            + (_in_clip_units(float(noise.norm()), self.clip, op.span)
                               if self.clip is not None else
                               f"{float(noise.norm()) / max(float(ctx.gradient.norm()), 1e-30):.3g}× the gradient norm")
                            + f"{'' if reachable else ' or more (input_bounds clip the predicted error)'}; "
                            f"budget max_rel_noise={cfg.max_rel_noise}", info, rmse_error=error)
        update = None if keep is None else kept_gradient(op, ctx.gradient, keep)
        return Outcome(noise, rmse, rmse_lb(jd, ctx.lambda_max, op.dx), ctx.eps, True, "", info, update, error)

    def _protectable(self, op: Jacobian, shift: torch.Tensor, slack: torch.Tensor, limit: float,
                     usable: torch.Tensor) -> tuple[torch.Tensor, float, torch.Tensor, tuple | None] | None:
        """(the samples to keep, a scale ≤ ``limit`` at which they all certify, the negligible samples, and
        ``_fit``'s result for them when it was already fitted)
        when the budget (scale ``limit`` of the direction) cannot protect the whole batch — never an
        uncertifiable sample (``usable`` False); the scale is the least, on ``scales``' grid, that
        leaves out the fewest non-negligible samples, then the fewest samples. None when leaving the
        others out is not allowed (``max_excluded``, beyond which negligible samples do not count; the
        per-sample path) or would not help. All samples kept comes back too: the box certificate can
        hold for all of them in a window of scales that the doubling fit from the linear scale steps
        over (then they are fitted up to that window)."""
        cfg = self.config
        if cfg.max_excluded <= 0 or base_operator(op).coupled or not bool(usable.any()):
            return None
        free = negligible_samples(op)
        if not bool(usable.all()) and bool((usable | free).all()) and excludable(usable, cfg.max_excluded, free):
            # only negligible samples are out (unsolved, ``SKIP_NEGLIGIBLE``): the others certify together within
            # the budget, or the grid below finds whom else to leave out
            fitted = self._fit(op.x, shift, slack, cfg.floor, limit, 0.0, keep=usable)
            if fitted[2] and fitted[0] <= limit:
                return usable, fitted[0], free, fitted
        best, at, rank = None, limit, None
        bounds = None if cfg.bounds is None else BoxProfile(op.x, shift, *input_bounds(cfg.bounds, op.x))
        for scale in scale_grid(shift[usable], cfg.floor * (1 + cfg.rtol), limit):
            keep = reachable_at(op.x, shift, bounds, scale, cfg.floor, cfg.rtol, slack) & usable
            here = (int((~keep & ~free).sum()), int((~keep).sum()))  # counted left out, then all left out
            if rank is None or here < rank:
                best, at, rank = keep, scale, here
        if best is None or not (bool(best.all()) or excludable(best, cfg.max_excluded, free)):
            return None
        return best, at, free, None  # all kept: the doubling fit from the linear scale missed the window where all certify

    def sufficient(self, x: torch.Tensor, limit: float) -> Sufficient:
        """The solver's early stop (``flguard.risk.krylov.Sufficient``) for a direction whose scale may
        reach ``limit``: the scale ĉ the batch will need is the largest of the samples' least scales
        (each shift taken as exact, ``least_scales``, and lowered by its error: the exact shift may be
        longer; samples that need more than ``limit`` are left out or withhold and do not set it), and a
        sample's solve is accurate enough once its certified error, with its error bound as the radius,
        reaches τ(1 + rtol) at ĉ/(1 + rtol) and at ĉ(1 + rtol) — room for ĉ to fall while the batch's
        binding samples converge, and for the fit to land above it. The binding
        samples themselves never pass it: they run to rtol. The floor is then fitted on the verified
        solves as always (``meet``), so the rule only sets how much is spent."""
        cfg = self.config
        target, spread = cfg.floor * (1 + cfg.rtol), 1 + cfg.rtol
        box = None if cfg.bounds is None else flat64(x, *input_bounds(cfg.bounds, x))  # x, low, high [B, dx]
        seen: list = []  # the last call's shifts, their box profiles and least scales

        def rule(shift: torch.Tensor, error: torch.Tensor, ask: torch.Tensor) -> torch.Tensor:
            dx, out = shift.shape[1], torch.zeros_like(ask)
            if not bool(ask.any()):
                return out
            if box is None:
                least = from_rmse(target, dx) / shift.double().norm(dim=1)
                least = torch.where(least <= limit, least, torch.full_like(least, float("inf")))
            elif not seen:
                profile = BoxProfile(box[0], shift, box[1], box[2])
                seen[:] = [shift.clone(), profile, profile.least_scales(target, limit)]
            else:  # re-sorted only for the rows whose shift moved since the last call (the samples still iterating)
                rows = (shift != seen[0]).any(dim=1).nonzero().squeeze(1)
                if rows.numel():
                    fresh = BoxProfile(box[0][rows], shift[rows], box[1][rows], box[2][rows])
                    seen[1].replace(rows, fresh)
                    seen[2][rows] = fresh.least_scales(target, limit)
                    seen[0] = shift.clone()
            least = least if box is None else seen[2]
            # a sample's exact shift may be longer by its error: the least scale it will need is at least this
            norm = shift.double().norm(dim=1)
            least = least * norm / (norm + error.double()).clamp_min(1e-300)
            finite = torch.isfinite(least)
            if not bool(finite.any()):
                return out
            need, rows = float(least[finite].max()), ask.nonzero().squeeze(1)
            if box is None:
                out[rows] = to_rmse((shift[rows].double().norm(dim=1) - error[rows].double()) * need / spread, dx) >= target
                return out
            out[rows] = seen[1].rows(rows).certifies((need / spread, need * spread), error[rows], target).all(dim=0)
            return out

        return rule

    def solve(self, ctx: DefenseContext, vector: torch.Tensor, allow_unusable: bool = False,
              sufficient: Sufficient | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """I2F's shift (K_i+εI)⁻¹J_i·vector [B, dx], ‖J_i·vector‖, which samples' shifts are usable
        (converged and nonzero) and each shift's error bound, checked: an unusable sample fails the
        guard unless ``allow_unusable``, and then its shift is zeroed (it can only be left out).
        ``sufficient``: the solver's early stop (``FloorCalibrator.sufficient``)."""
        ritz = (ctx.spectrum.ritz_values, ctx.spectrum.ritz_vectors) if PRECONDITION_CG and ctx.spectrum else None
        start = (ctx.spectrum if GALERKIN_START and ritz is not None and ctx.spectrum.remainder is not None
                 and ctx.spectrum.basis.shape[0] == ctx.op.batch_size else None)
        shift, jd, converged, bound = i2f_solve(ctx.op, vector, ctx.eps, self.config.rtol, ritz=ritz,
                                                max_iter=SOLVER_MAX_ITER, sufficient=sufficient, start=start,
                                                deflate=DEFLATED_CG)
        return checked_solve(shift, jd, converged, allow_unusable, bound)

    def _fit(self, x: torch.Tensor, shift: torch.Tensor, slack: torch.Tensor, tau: float, limit: float,
             at_least: float = 0.0, keep: torch.Tensor | None = None) -> tuple[float, torch.Tensor, bool]:
        """(c ≥ at_least, RMSE per sample of c·shift, reachable within scale ``limit``): the smallest
        scale at which every (kept) sample's certified RMSE reaches τ(1 + rtol) — c(‖Δx̃‖ − η)/√dx
        for ``shift`` Δx̃ and its error bound ``slack`` η, or with ``input_bounds`` the clipped one
        (``box_scale``). The RMSE returned is the solved one (‖c·Δx̃‖, or clipped). Left-out samples
        (``keep`` False) are not in the update: their RMSE is +inf."""
        if keep is not None:  # the box of the kept samples alone ("batch": the tightest one the upload holds)
            scale, kept, reachable = self._fit_all(x[keep], shift[keep], slack[keep], tau, limit, at_least)
            rmse = torch.full((x.shape[0],), float("inf"), dtype=kept.dtype, device=kept.device)
            rmse[keep] = kept
            return scale, rmse, reachable
        return self._fit_all(x, shift, slack, tau, limit, at_least)

    def _fit_all(self, x: torch.Tensor, shift: torch.Tensor, slack: torch.Tensor, tau: float, limit: float,
                 at_least: float) -> tuple[float, torch.Tensor, bool]:
        cfg, dx = self.config, shift.shape[1]
        unit, target = shift.norm(dim=1), from_rmse(tau * (1 + cfg.rtol), dx)
        if cfg.bounds is None:  # the budget is checked on the final noise
            linear = max(target / max(float((unit - slack).min()), 1e-30), at_least)
            return linear, to_rmse(unit * linear, dx), True
        low, high = input_bounds(cfg.bounds, x)
        start = max(target / max(float(unit.min()), 1e-30), at_least)  # no sample certifies below it
        return box_scale(x, shift, low, high, tau, cfg.rtol, start, max(limit, start), slack)


def checked_solve(shift: torch.Tensor, jd: torch.Tensor, converged: torch.Tensor, allow_unusable: bool,
                  error_bound: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(shift with unusable samples zeroed, ‖J_i·vector‖, usable = converged and moved, the shift's
    error bound, zero where zeroed); an unusable sample fails the guard unless ``allow_unusable``
    (then it can only be left out)."""
    moved = shift.norm(dim=1) > 0
    usable = converged & moved
    if not allow_unusable:
        if not bool(converged.all()):
            raise GuardFailure("the I2F solve did not converge")
        if not bool(moved.all()):
            raise GuardFailure("the noise direction has no measurable effect on some sample")
    return (torch.where(usable.unsqueeze(1), shift, torch.zeros_like(shift)), jd, usable,
            torch.where(usable, error_bound.to(shift), torch.zeros_like(error_bound, dtype=shift.dtype)))


_UNUSABLE = ("the I2F solve did not converge or the noise direction has no measurable effect on some sample, "
             "and leaving it out is not possible (max_excluded)")


def noise_budget(flat: torch.Tensor, cfg: GuardConfig, clip: float | None, span: float = 1.0) -> float:
    """The most noise (norm) an update may carry: max_rel_noise × ‖g‖, or with per-sample clipping
    × span·C (``clip``, this step's clipping norm) — the largest norm the clipped update can have
    (DP-SGD's unit: C for a mean loss, B·C for a sum: the operator's ``span``, ``flguard.risk.loss_split``),
    which unlike ‖g‖ does not shrink as the model converges and the samples' gradients cancel. With clipping but no
    C yet (a step that failed before measuring), a numeric ``clip_per_sample``, else ‖g‖."""
    if clip is None and isinstance(cfg.clip_per_sample, (int, float)):
        clip = float(cfg.clip_per_sample)
    return cfg.max_rel_noise * (clip * span if clip is not None else float(flat.norm()))


def _in_clip_units(noise: float, clip: float, span: float) -> str:
    """A noise norm in the budget's unit, for a reason: × C for a mean loss, × c·B·C for another scale."""
    if span == 1.0:
        return f"{noise / clip:.3g}× the clipping norm C={clip:.3g}"
    return f"{noise / (span * clip):.3g}× {span:.4g}·C, the clipped update's largest norm (C={clip:.3g})"


def input_bounds(bounds: tuple | str, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``input_bounds`` as tensors broadcastable to x [B, C, ...], widened to contain x itself;
    ``"batch"``: per channel (dim 1) the batch's own min and max."""
    if bounds == "batch":
        dims = [d for d in range(x.ndim) if d != 1] if x.ndim > 2 else list(range(x.ndim))
        return x.amin(dim=dims, keepdim=True), x.amax(dim=dims, keepdim=True)
    out = []
    for value in bounds:
        t = torch.as_tensor(value, dtype=x.dtype, device=x.device).reshape(-1)
        if t.numel() > 1:
            if x.ndim < 2 or x.shape[1] != t.numel():
                raise GuardFailure(f"input_bounds has {t.numel()} channel values; "
                                   f"the input has shape {tuple(x.shape[1:])}")
            t = t.view(1, -1, *([1] * (x.ndim - 2)))
        out.append(t)
    return torch.minimum(out[0], x), torch.maximum(out[1], x)


#: ``box_scale``'s first step up from the least scale where every solved shift's clipped error reaches the target.
FIRST_STEP = 1 / 128


def box_scale(x: torch.Tensor, shift: torch.Tensor, low: torch.Tensor, high: torch.Tensor, tau: float, rtol: float,
              start: float, limit: float, slack: torch.Tensor | None = None) -> tuple[float, torch.Tensor, bool]:
    """Smallest scale c ≥ ``start`` with every sample's clip(x + c·Δx) − x of RMSE ≥ τ, for Δx = ``shift``.

    Each pixel's clipped error |clip(x + c·a) − x| is nondecreasing in c, so the worst sample's RMSE
    is too and bisection finds c. The exact shift lies within ``slack`` η_i of Δx̃_i (the solver's
    verified bound; default rtol‖Δx̃_i‖), so what must reach τ(1 + rtol) is the certified lower bound
    of ``flguard.guard.box_bound`` at radius c·η_i — at least r̃(c) − c·η_i/√dx (clip is 1-Lipschitz),
    more where pixels saturate. Returns (c, r̃(c) per sample, reachable within ``limit``); the
    returned c always satisfies the bound when reachable (bisection keeps a verified upper end).
    """
    dx = shift.shape[1]
    delta = shift.view_as(x)
    slack = rtol * shift.norm(dim=1) if slack is None else slack

    def clipped(c: float) -> torch.Tensor:
        return to_rmse((torch.clamp(x + c * delta, low, high) - x).flatten(1).norm(dim=1), dx)

    def meets(c: float) -> bool:
        return bool(profile.certifies(c, slack, target).all())

    target, profile = tau * (1 + rtol), BoxProfile(x, shift, low, high)  # one sort for every scale tried
    # no sample certifies below the scale where its solved shift's clipped error alone reaches the target (the
    # certified bound is at most that error): the search starts there, computed exactly (``least_scales``)
    nominal = float(profile.least_scales(target, limit).max())
    if not nominal <= limit:
        return limit, clipped(limit), False
    lo = min(max(start, nominal), limit)
    if meets(lo):
        return lo, clipped(lo), True
    # The certified bound is not monotone: r̃ saturates at the box while the solver's slack grows with
    # c, so it is judged where it first succeeds — in steps up from there that double, the first of FIRST_STEP
    # (the trained quickstart CNN's steps certified 0.2–3% above that start) — never only at ``limit``.
    hi, step = min(lo * (1 + FIRST_STEP), limit), 2 * FIRST_STEP
    while not meets(hi):
        if hi >= limit:
            return limit, clipped(limit), False
        lo, hi, step = hi, min(hi * (1 + step), limit), 2 * step
    for _ in range(60):
        mid = (lo * hi) ** 0.5
        lo, hi = (lo, mid) if meets(mid) else (mid, hi)
        if hi / lo < 1 + 1e-4:
            break
    return hi, clipped(hi), True


#: The grid of ``scales``: steps of 2^(1/4) (19%), at most 256 scales (a span of 2^64).
SCALE_STEP, MAX_SCALES = 2 ** 0.25, 256


def scale_grid(shift: torch.Tensor, target: float, limit: float) -> list[float]:
    """Noise scales at which to ask which samples are certifiable: steps of SCALE_STEP from the least
    scale at which the most movable sample reaches ``target`` (linearly) up to ``limit``, included.
    With ``input_bounds`` a sample's certified (box-clipped, minus the solver's slack rtol·c·‖Δx‖)
    error is not monotone in the scale c — the clipped error saturates while the slack grows — so a
    sample certifies on a window of scales, which a doubling search can step over; the samples to
    keep are chosen where most of them certify, not only at the budget's end. The grid spans at most
    the MAX_SCALES steps below ``limit``: a sample with a near-zero λmax (a fitted sample whose
    gradient vanishes) can move 10^20× more than the others, and a grid started at its scale ran out
    of steps decades below the scales where the rest certify."""
    start = from_rmse(target, shift.shape[1]) / max(float(shift.norm(dim=1).max()), 1e-30)
    start = max(start, limit * SCALE_STEP ** -(MAX_SCALES - 1))
    scales, scale = [], min(start, limit)
    while scale < limit and len(scales) < MAX_SCALES:
        scales.append(scale)
        scale *= SCALE_STEP
    return scales + [limit]


def rmse_lb(jd_norm: torch.Tensor, lambda_max: torch.Tensor, dx: int) -> torch.Tensor:
    """The lower bound's RMSE ‖J_iδ‖/(λmax√dx) per sample, the guard's ``rmse_lb_after``."""
    return to_rmse(i2f_lower_bound(jd_norm, lambda_max), dx)


def _summaries(info: dict) -> dict:
    return {k: (float(v.min()) if isinstance(v, torch.Tensor) else v) for k, v in info.items()}
