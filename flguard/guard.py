"""The leakage guard: measure → perturb → verify → report, failing closed.

``Guard(config).protect(model, x, y, gradient)`` returns the gradient to upload — or ``None`` —
and a ``GuardReport``. The promise: when ``report.met`` is true, every sample's predicted recovery
RMSE (``assess``'s ``rmse_i2f`` with δ = the noise actually added) is at least the floor τ
(``GuardConfig.floor``: ``min_rmse``, or ``max_psnr`` converted to input units).
Anything that goes wrong (a NaN gradient, a solver that does not converge, an exception, a floor
that needs more noise than the budget) ends in the ``on_unmet`` policy; with the default ``drop``
no gradient leaves the client, and never the unguarded one unless ``send`` was acknowledged.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from torch import nn

from flguard.defenses import BASELINES, DIRECTIONS, DefenseContext, Direction, draw_generator
from flguard.defenses.gaussian import gaussian_direction, isotropic
from flguard.guard_config import THRESHOLD_DEFENSES, GuardConfig
from flguard.guard_exclusion import excludable, kept_gradient, negligible_samples, reachable_at
from flguard.guard_model import require_supported
from flguard.guard_report import GuardOutput, GuardReport
from flguard.risk.assess import i2f_norms, i2f_solve, i2f_solve_with_lambda_max, jacobian_product
from flguard.risk.closed_forms import from_rmse, i2f_lower_bound, to_rmse
from flguard.risk.operator import ClippedJacobian, Jacobian, JacobianOperator, LossFn, ProductLimit, base_operator
from flguard.risk.regularised import RegularisedK


#: The I²F solves behind the floor run PCG preconditioned by the Lanczos run's Ritz pairs (the
#: spectral preconditioner of ``flguard.risk.krylov``), stopped on the true residual: same
#: certificate ‖x − x*‖ ≤ ‖r‖/ε, fewer Jacobian products (docs/results.md "Issue 12 §3 — cost,
#: continued"): on the demo's trained CNN 5–11% fewer CG products per step, and a certificate on
#: the true residual — plain CG's recurrence residual under-stated it by up to 6% in float32.
#: False: plain CG, as before.
PRECONDITION_CG = True

#: The calibrated Gaussian's noise direction does not depend on K's spectrum, so its λmax (for ε)
#: and its I²F solve come from one Lanczos run per sample started at J_iz
#: (``flguard.risk.lanczos_solve``) instead of a Lanczos run and then PCG: the same certificate
#: (true-residual bound ‖r‖/ε ≤ rtol‖x‖, ε from λmax's own residual test), about a third fewer
#: Jacobian products (docs/results.md "One Lanczos run for λmax and the solve"). False: as before.
LANCZOS_SOLVE = True


#: Iterations per sample at most in the guard's Lanczos and CG runs (eigen: at least its
#: ``krylov_steps``): a solve takes 3–30 on the models measured; a sample still iterating at 100 is
#: one whose float32 products cannot certify it (a well-fitted sample with a negligible gradient),
#: and without the cap it ran to the input size, thousands of small products per step.
SOLVER_MAX_ITER = 100


#: ``defense="auto"`` (the default): the calibrated Gaussian first — isotropic noise, one Lanczos
#: run per sample — and, when it needs more than the budget, noise aimed at the samples' weak
#: directions (eigen), which needs far less of it where the parameters outnumber the inputs: on the
#: trained ResNet-20-GN at B = 8 the Gaussian needed 54–663 C and sent 0 of 5 steps, eigen 5 of 5
#: (docs/results.md, "The guard on the models practitioners train").
AUTO_ORDER = ("gaussian", "eigen")
#: ``auto`` reuses what a step learnt: when the Gaussian needed more than AUTO_SKIP_FACTOR × the budget,
#: the next AUTO_SKIP_STEPS steps go straight to eigen (the model moves little from one step to the
#: next; every kind still verifies its own floor, so skipping only saves the Gaussian's products).
AUTO_SKIP_FACTOR = 2.0
AUTO_SKIP_STEPS = 8


class GuardFailure(RuntimeError):
    """Measuring or perturbing failed; the message is the reply's reason."""


@dataclass
class _Outcome:
    noise: torch.Tensor
    rmse_after: torch.Tensor
    rmse_lb_after: torch.Tensor
    eps: torch.Tensor
    met: bool
    reason: str = ""
    info: dict = field(default_factory=dict)
    update: torch.Tensor | None = None  # the upload without left-out samples (``max_excluded``); None: all kept


class Guard:
    """Applies the configured defense to one batch's flat gradient (see module doc)."""

    def __init__(self, config: GuardConfig | None = None) -> None:
        self.config = config if config is not None else GuardConfig()
        self._generators: dict[torch.device, torch.Generator] = {}
        self._skip_gaussian = 0  # auto: steps left that start with eigen (AUTO_SKIP_STEPS)

    def _generator(self, device: torch.device) -> torch.Generator:
        """One stream per device for the guard's lifetime: successive updates get fresh noise
        (a repeated draw across steps or rounds would let the server difference it away), and a
        configured seed makes the whole sequence reproducible."""
        if device not in self._generators:
            self._generators[device] = draw_generator(self.config.seed, device)
        return self._generators[device]

    def protect(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor, gradient: torch.Tensor,
                loss_fn: LossFn | None = None) -> GuardOutput:
        start = time.perf_counter()
        cfg = self.config
        batch = int(x.shape[0])
        op: Jacobian | None = None
        self._clip: float | None = None  # this step's clipping norm C, once known (the budget's unit)
        require_supported(model, "Guard.protect")  # a clear error before any measuring, not a failed step
        try:
            flat = _checked_gradient(gradient, model)
            op = JacobianOperator(model, x, y, loss_fn, limit=ProductLimit(batch, cfg.max_products, cfg.max_seconds))
            if cfg.clip_per_sample is not None:  # the attacker then inverts the clipped upload
                op = _clipped(op, flat, clip_level(cfg.clip_per_sample, op))
                flat = op.gradient
                self._clip = op.clip
            outcome = self._perturb(op, flat)
        except Exception as error:  # fail closed on anything, with the reason in the report
            reason = _dead_network(op, self._generator(x.device)) or _reason(error)
            return self._failed(gradient, batch, reason, op, start)
        report = GuardReport(
            rmse_after=outcome.rmse_after.cpu(), rmse_lb_after=outcome.rmse_lb_after.cpu(),
            eps=outcome.eps.cpu(), noise_norm=float(outcome.noise.norm()),
            rel_noise=float(outcome.noise.norm() / flat.norm().clamp_min(1e-30)), met=outcome.met, defense=cfg.defense,
            reason=outcome.reason, matvecs=op.applications, seconds=0.0, min_rmse=cfg.floor, details=outcome.info)
        if outcome.met or cfg.defense not in THRESHOLD_DEFENSES:
            report.seconds = time.perf_counter() - start
            base = flat if outcome.update is None else outcome.update
            return GuardOutput((base + outcome.noise).view_as(gradient), report)
        return self._apply_policy(flat, gradient, report, start)

    # -- measuring and perturbing -----------------------------------------------------------
    def _perturb(self, op: Jacobian, flat: torch.Tensor, kind: str | None = None) -> _Outcome:
        """The configured defense's outcome on this step (``kind``: the threshold defense to apply
        instead, for ``auto``)."""
        cfg = self.config
        kind = kind or cfg.defense
        if kind == "auto":
            return self._auto(op, flat)
        generator = self._generator(flat.device)
        eigen = kind == "eigen"
        lanczos_seed = int(torch.randint(0, 2**31 - 1, (1,), generator=generator, device=flat.device))
        if kind == "gaussian" and LANCZOS_SOLVE and cfg.floor > 0:
            return self._gaussian_in_one_run(op, flat, generator, lanczos_seed)
        spectrum = RegularisedK(op).lanczos(rtol=cfg.rtol, ends="max", min_iter=cfg.krylov_steps if eigen else 0,
                                            max_iter=max(SOLVER_MAX_ITER, cfg.krylov_steps if eigen else 0),
                                            return_vectors=eigen or PRECONDITION_CG, seed=lanczos_seed)
        if not bool(spectrum.converged.all()):
            raise GuardFailure("λmax did not converge within the Lanczos limit")
        lambda_max = spectrum.lambda_max
        eps = cfg.eps * lambda_max if cfg.eps_mode == "relative" else torch.full_like(lambda_max, cfg.eps)
        ctx = DefenseContext(op, flat, eps, lambda_max, generator, cfg, spectrum=spectrum)
        if kind in THRESHOLD_DEFENSES:
            return self._meet_floor(ctx, kind=kind)
        noise = BASELINES[cfg.defense](ctx) - flat
        i2f, jd, converged = i2f_norms(op, noise, eps, cfg.rtol) if noise.any() else _zeros(op, flat)
        if not bool(converged.all()):
            raise GuardFailure("I2F solve did not converge")
        rmse = to_rmse(i2f, op.dx)
        met = bool((rmse >= cfg.floor).all())
        return _Outcome(noise, rmse, _rmse_lb(jd, lambda_max, op.dx), eps, met,
                        "" if met else "baseline misses min_rmse", dict(ctx.info))

    def _gaussian_in_one_run(self, op: Jacobian, flat: torch.Tensor, generator: torch.Generator,
                             seed: int) -> _Outcome:
        """The calibrated Gaussian with λmax and the I2F solve of its draw z from one Lanczos run
        per sample (``LANCZOS_SOLVE``), then scaled to the floor exactly as ``_meet_floor`` does."""
        cfg = self.config
        direction = isotropic(op.dtheta, generator, flat)  # gaussian_direction's draw, before ε exists
        shift, jd, converged, lambda_max, eps, lambda_ok = i2f_solve_with_lambda_max(
            op, direction.vector, cfg.eps, cfg.eps_mode == "relative", cfg.rtol, seed=seed, max_iter=SOLVER_MAX_ITER)
        if not bool(lambda_ok.all()) and cfg.max_excluded <= 0:  # else such a sample is one to leave out
            raise GuardFailure("λmax did not converge within the Lanczos limit")
        ctx = DefenseContext(op, flat, eps, lambda_max, generator, cfg)
        solved = _checked_solve(shift, jd, converged, allow_unusable=cfg.max_excluded > 0)
        return self._meet_floor(ctx, (direction, solved), kind="gaussian")

    def _auto(self, op: Jacobian, flat: torch.Tensor) -> _Outcome:
        """``auto``: each of AUTO_ORDER in turn on the same operator (its products count against the
        same step limit) until one meets the floor within the budget; the last one's outcome otherwise.
        The report's details name the one that was sent (``defense_used``)."""
        reasons, order = [], AUTO_ORDER
        if self._skip_gaussian > 0:
            self._skip_gaussian -= 1
            order = tuple(kind for kind in AUTO_ORDER if kind != "gaussian")
            reasons.append(f"gaussian: skipped (it needed over {AUTO_SKIP_FACTOR:g}× the budget within the last "
                           f"{AUTO_SKIP_STEPS} steps)")
        for kind in order:
            try:
                outcome = self._perturb(op, flat, kind)
            except Exception as failure:  # the next kind may still certify; every kind verifies its own floor
                outcome = None
                reasons.append(f"{kind}: {_reason(failure)}")
                continue
            outcome.info["defense_used"] = kind
            if outcome.met:
                return outcome
            reasons.append(f"{kind}: {outcome.reason}")
            if kind == "gaussian" and float(outcome.noise.norm()) > AUTO_SKIP_FACTOR * _budget(flat, self.config, self._clip):
                self._skip_gaussian = AUTO_SKIP_STEPS
        if outcome is None:
            raise GuardFailure("; ".join(reasons))
        outcome.reason = "; ".join(reasons)
        return outcome

    def _meet_floor(self, ctx: DefenseContext,
                    solved: tuple[Direction, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None = None,
                    kind: str = "gaussian") -> _Outcome:
        """Scale the defense's direction d so that every sample's I2F RMSE ≥ τ.

        I2F's shift Δx = (K+εI)⁻¹Jδ is linear in δ, so for c·d it is c·Δx(d) exactly: one CG solve on
        the realised direction gives every sample's I2F for the noise actually sent. The CG bound
        keeps the exact I2F within rtol of the solved one, so the scale aims at τ(1 + 2·rtol) and the
        reported value is checked against τ(1 + rtol) — the exact value is then ≥ τ. With
        ``input_bounds`` the promise is about clip(x + c·Δx) − x instead (``_box_scale``).
        ``solved``: the direction and its checked solve when they came from elsewhere
        (``_gaussian_in_one_run``).
        """
        cfg, op = self.config, ctx.op
        direction = solved[0] if solved is not None else DIRECTIONS[kind](ctx)
        if cfg.floor == 0:
            zeros = torch.zeros(op.batch_size, dtype=op.dtype, device=op.device)
            return _Outcome(torch.zeros_like(ctx.gradient), zeros, zeros, ctx.eps, True)
        vector = direction.vector
        floor = cfg.gaussian_floor if kind == "eigen" else 0.0
        # with max_excluded, a sample whose I2F cannot be certified at all (CG did not converge, or the
        # noise does not move it) is one more sample to leave out rather than a reason to withhold
        shift, unit_jd, usable = (solved[1] if solved is not None else
                                  self._solve(ctx, vector, allow_unusable=cfg.max_excluded > 0 and floor == 0))
        budget = _budget(ctx.gradient, cfg, self._clip)
        info: dict = {}
        if floor > 0:  # an isotropic part of its own that meets floor·τ: no subspace to discard
            z = gaussian_direction(ctx).vector
            shift_z, _, _ = self._solve(ctx, z)
            scale_z, rmse_z, _ = self._fit(op.x, shift_z, floor * cfg.floor, budget / float(z.norm()))
            scale_e, _, _ = self._fit(op.x, shift, cfg.floor, budget / float(vector.norm()))
            vector, shift = scale_z * z + scale_e * vector, scale_z * shift_z + scale_e * shift
            info["rmse_gaussian_part"] = rmse_z
        limit, at_least = budget / max(float(vector.norm()), 1e-30), 1.0 if floor > 0 else 0.0
        certifiable = bool(usable.all())
        scale, rmse, reachable = self._fit(op.x, shift, cfg.floor, limit, at_least) if certifiable else (limit, None, False)
        keep = None
        if not (reachable and float(vector.norm()) * scale <= budget):
            chosen = self._protectable(op, shift, limit, usable)
            if chosen is None and not certifiable:
                raise GuardFailure(_UNUSABLE)
            if chosen is not None:  # fitted up to the scale at which the kept samples all certify
                keep, at, free = chosen
                keep = None if bool(keep.all()) else keep
                scale, rmse, reachable = self._fit(op.x, shift, cfg.floor, max(at, at_least), at_least, keep=keep)
                if keep is not None:
                    info["excluded"] = int((~keep).sum())
                    info["excluded_negligible"] = int((~keep & free).sum())
        info["rmse_unbounded"] = to_rmse((shift if keep is None else shift[keep]).norm(dim=1) * scale, op.dx)
        noise = vector * scale
        jd = jacobian_product(op, noise).norm(dim=1) if floor > 0 else unit_jd * scale
        if keep is not None:  # a left-out sample is not in the update: nothing of it to recover
            jd = torch.where(keep, jd, torch.full_like(jd, float("inf")))
        info = {"scale": float(scale), **({"clip": self._clip} if self._clip is not None else {}),
                **_summaries({**direction.info, **info})}
        if reachable and not bool((rmse >= cfg.floor * (1 + cfg.rtol)).all()):  # non-finite arithmetic
            raise GuardFailure("the floor could not be verified on the realised noise")
        if not reachable or float(noise.norm()) > budget:
            return _Outcome(noise, rmse, _rmse_lb(jd, ctx.lambda_max, op.dx), ctx.eps, False,
                            f"the floor τ={cfg.floor:.4g} needs noise {float(noise.norm()):.4g} = "
                            + (f"{float(noise.norm()) / self._clip:.3g}× the clipping norm C={self._clip:.3g}"
                               if self._clip is not None else
                               f"{float(noise.norm()) / max(float(ctx.gradient.norm()), 1e-30):.3g}× the gradient norm")
                            + f"{'' if reachable else ' or more (input_bounds clip the predicted error)'}; "
                            f"budget max_rel_noise={cfg.max_rel_noise}", info)
        update = None if keep is None else kept_gradient(op, ctx.gradient, keep)
        return _Outcome(noise, rmse, _rmse_lb(jd, ctx.lambda_max, op.dx), ctx.eps, True, "", info, update)

    def _protectable(self, op: Jacobian, shift: torch.Tensor, limit: float,
                     usable: torch.Tensor) -> tuple[torch.Tensor, float, torch.Tensor] | None:
        """(the samples to keep, a scale ≤ ``limit`` at which they all certify, the negligible samples)
        when the budget (scale ``limit`` of the direction) cannot protect the whole batch — never an
        uncertifiable sample (``usable`` False); the scale is the least, on ``_scales``' grid, that
        leaves out the fewest non-negligible samples, then the fewest samples. None when leaving the
        others out is not allowed (``max_excluded``, beyond which negligible samples do not count; the
        per-sample path) or would not help. All samples kept comes back too: the box certificate can
        hold for all of them in a window of scales that the doubling fit from the linear scale steps
        over (then they are fitted up to that window)."""
        cfg = self.config
        if cfg.max_excluded <= 0 or base_operator(op).coupled or not bool(usable.any()):
            return None
        bounds = None if cfg.bounds is None else _bounds(cfg.bounds, op.x)
        free = negligible_samples(op)
        best, at, rank = None, limit, None
        for scale in _scales(shift[usable], cfg.floor * (1 + 2 * cfg.rtol), limit):
            keep = reachable_at(op.x, shift, bounds, scale, cfg.floor, cfg.rtol) & usable
            here = (int((~keep & ~free).sum()), int((~keep).sum()))  # counted left out, then all left out
            if rank is None or here < rank:
                best, at, rank = keep, scale, here
        if best is None or not (bool(best.all()) or excludable(best, cfg.max_excluded, free)):
            return None
        return best, at, free  # all kept: the doubling fit from the linear scale missed the window where all certify

    def _solve(self, ctx: DefenseContext, vector: torch.Tensor,
               allow_unusable: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """I2F's shift (K_i+εI)⁻¹J_i·vector [B, dx], ‖J_i·vector‖ and which samples' shifts are usable
        (converged and nonzero), checked: an unusable sample fails the guard unless
        ``allow_unusable``, and then its shift is zeroed (it can only be left out)."""
        ritz = (ctx.spectrum.ritz_values, ctx.spectrum.ritz_vectors) if PRECONDITION_CG and ctx.spectrum else None
        shift, jd, converged = i2f_solve(ctx.op, vector, ctx.eps, self.config.rtol, ritz=ritz, max_iter=SOLVER_MAX_ITER)
        return _checked_solve(shift, jd, converged, allow_unusable)

    def _fit(self, x: torch.Tensor, shift: torch.Tensor, tau: float, limit: float,
             at_least: float = 0.0, keep: torch.Tensor | None = None) -> tuple[float, torch.Tensor, bool]:
        """(c ≥ at_least, RMSE per sample of c·shift, reachable within scale ``limit``): the smallest
        scale at which every (kept) sample's predicted RMSE reaches τ — the I2F RMSE ‖c·Δx‖/√dx, aimed
        at τ(1 + 2·rtol), or with ``input_bounds`` the clipped one (``_box_scale``). Left-out samples
        (``keep`` False) are not in the update: their RMSE is +inf."""
        if keep is not None:  # the box of the kept samples alone ("batch": the tightest one the upload holds)
            scale, kept, reachable = self._fit_all(x[keep], shift[keep], tau, limit, at_least)
            rmse = torch.full((x.shape[0],), float("inf"), dtype=kept.dtype, device=kept.device)
            rmse[keep] = kept
            return scale, rmse, reachable
        return self._fit_all(x, shift, tau, limit, at_least)

    def _fit_all(self, x: torch.Tensor, shift: torch.Tensor, tau: float, limit: float,
                 at_least: float) -> tuple[float, torch.Tensor, bool]:
        cfg, dx = self.config, shift.shape[1]
        unit = shift.norm(dim=1)
        linear = max(from_rmse(tau * (1 + 2 * cfg.rtol), dx) / float(unit.min()), at_least)
        if cfg.bounds is None:  # the budget is checked on the final noise
            return linear, to_rmse(unit * linear, dx), True
        low, high = _bounds(cfg.bounds, x)
        return _box_scale(x, shift, low, high, tau, cfg.rtol, linear, max(limit, linear))

    # -- fail closed ------------------------------------------------------------------------
    def _apply_policy(self, flat: torch.Tensor, original: torch.Tensor, report: GuardReport, start: float) -> GuardOutput:
        cfg = self.config
        report.met = False
        if cfg.on_unmet == "send":
            report.reason += " (sent unguarded: on_unmet='send' acknowledged)"
            report.noise_norm, report.rel_noise = 0.0, 0.0
            report.seconds = time.perf_counter() - start
            return GuardOutput(original.clone(), report)
        if cfg.on_unmet == "max-noise":
            noise = _budget_noise(flat, cfg, self._generator(flat.device), getattr(self, "_clip", None))
            report.noise_norm, report.rel_noise = float(noise.norm()), cfg.max_rel_noise
            report.reason += " (sent with the full noise budget, isotropic; floor not verified)"
            report.seconds = time.perf_counter() - start
            return GuardOutput((flat + noise).view_as(original), report)
        report.reason += " (update dropped)"
        report.seconds = time.perf_counter() - start
        return GuardOutput(None, report)

    def _failed(self, gradient: torch.Tensor, batch: int, reason: str, op: Jacobian | None,
                start: float) -> GuardOutput:
        nan = torch.full((batch,), float("nan"))
        report = GuardReport(rmse_after=nan, rmse_lb_after=nan, eps=nan, noise_norm=0.0, rel_noise=0.0, met=False,
                             defense=self.config.defense, reason=reason,
                             matvecs=op.applications if op is not None else 0, seconds=0.0,
                             min_rmse=self.config.floor)
        finite = isinstance(gradient, torch.Tensor) and bool(torch.isfinite(gradient).all())
        if not finite and self.config.on_unmet != "drop":
            report.reason += " (gradient not finite: dropped whatever the policy)"
            report.seconds = time.perf_counter() - start
            return GuardOutput(None, report)
        return self._apply_policy(gradient.reshape(-1) if finite else gradient, gradient, report, start)


def _reason(error: Exception) -> str:
    """A failure as the reply's reason: a GuardFailure's message, anything else with its type."""
    return str(error) if isinstance(error, GuardFailure) else f"{type(error).__name__}: {error}"


#: The reason's prefix when the parameters the server sent leave nothing to certify (denial of service).
SUSPICIOUS = "suspicious parameters"


def _dead_network(op: Jacobian | None, generator: torch.Generator) -> str | None:
    """The reason for a server-made dead network, or None: after a failed step, one product J·z on a
    random parameter direction z — zero for every sample (almost surely only if every J_i = 0) means
    the inputs do not move the gradient at all, e.g. a layer whose ReLUs the server's biases killed.
    Nothing of the images leaks then (the update holds only label terms), but no floor can be
    certified either: the reply says so, instead of a solver's failure round after round."""
    if op is None:
        return None
    try:
        probe = torch.randn(op.dtheta, generator=generator, device=op.device, dtype=op.dtype)
        moved = jacobian_product(op, probe).norm(dim=1)
    except Exception:  # the step's limit, or the failure itself: keep the original reason
        return None
    if bool((moved > 0).any()):
        return None
    return (f"{SUSPICIOUS}: no sample's input moves its gradient (every per-sample Jacobian is zero: a dead "
            "network, e.g. biases that switch a layer's ReLUs off); nothing can be certified, so the client "
            "withholds — a server that sends such parameters is denying service")


def _checked_solve(shift: torch.Tensor, jd: torch.Tensor, converged: torch.Tensor,
                   allow_unusable: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(shift with unusable samples zeroed, ‖J_i·vector‖, usable = converged and moved); an unusable
    sample fails the guard unless ``allow_unusable`` (then it can only be left out)."""
    moved = shift.norm(dim=1) > 0
    usable = converged & moved
    if not allow_unusable:
        if not bool(converged.all()):
            raise GuardFailure("the I2F solve did not converge")
        if not bool(moved.all()):
            raise GuardFailure("the noise direction has no measurable effect on some sample")
    return torch.where(usable.unsqueeze(1), shift, torch.zeros_like(shift)), jd, usable


def _checked_gradient(gradient: torch.Tensor, model: nn.Module) -> torch.Tensor:
    total = sum(p.numel() for p in model.parameters() if p.requires_grad)
    if not isinstance(gradient, torch.Tensor) or gradient.numel() != total:
        raise GuardFailure(f"gradient must be a tensor of {total} entries (the trainable parameters)")
    if not bool(torch.isfinite(gradient).all()):
        raise GuardFailure("gradient contains NaN or Inf")
    return gradient.detach().reshape(-1)


_UNUSABLE = ("the I2F solve did not converge or the noise direction has no measurable effect on some sample, "
             "and leaving it out is not possible (max_excluded)")


def _budget_noise(flat: torch.Tensor, cfg: GuardConfig, generator: torch.Generator,
                  clip: float | None) -> torch.Tensor:
    """Isotropic noise of norm max_rel_noise·‖g‖ (or ·C) — the most the budget allows, no measurement needed."""
    z = isotropic(flat.shape, generator, flat).vector
    return z * (_budget(flat, cfg, clip) / float(z.norm()))


def _budget(flat: torch.Tensor, cfg: GuardConfig, clip: float | None) -> float:
    """The most noise (norm) an update may carry: max_rel_noise × ‖g‖, or with per-sample clipping
    × C (``clip``, this step's clipping norm) — the largest norm the clipped mean update can have
    (DP-SGD's unit), which unlike ‖g‖ does not shrink as the model converges and the samples'
    gradients cancel. With clipping but no C yet (a step that failed before measuring), a numeric
    ``clip_per_sample``, else ‖g‖."""
    if clip is None and isinstance(cfg.clip_per_sample, (int, float)):
        clip = float(cfg.clip_per_sample)
    return cfg.max_rel_noise * (clip if clip is not None else float(flat.norm()))


def clip_level(setting: float | str, op: JacobianOperator) -> float:
    """This step's clipping norm C: ``clip_per_sample`` itself, or for ``"median"`` the median of the
    batch's unscaled per-sample gradient norms ‖g_i‖ (the lower median for an even batch, so C is
    one sample's norm; that sample is measured unclipped, the derivative of clip_C from below).

    ``"median"`` needs no tuning: C and the budget max_rel_noise·C scale with the model's gradients,
    from one step to the next and from a small CNN to a ResNet, and half the batch is clipped. C is
    a statistic of the batch; the guard's threat model takes it as known to the attacker (it is
    part of "everything but sample i"), and each block is measured at that C."""
    if not isinstance(setting, str):
        return float(setting)
    norms = op.per_sample_gradients().norm(dim=1)
    level = float(norms.median())
    if not level > 0:
        raise GuardFailure("clip_per_sample='median': the median per-sample gradient norm is 0 (half the batch has "
                           "a zero gradient); set a numeric clip_per_sample")
    return level


def _clipped(op: JacobianOperator, flat: torch.Tensor, clip: float) -> ClippedJacobian:
    """The clipped upload's operator, after checking that ``flat`` is the batch loss's gradient (the
    guard then sends Σ clip(g_i) instead, so anything else in ``flat`` would be silently lost)."""
    clipped = ClippedJacobian(op, clip)
    reference = clipped.unclipped_gradient.to(flat)
    # float32 sums of B per-sample gradients differ from the batch gradient by rounding relative to the
    # summands, not to their (cancelling) sum: 1.1e-4 of ‖g‖ on an untrained ResNet-18, more once trained.
    # The check only catches a gradient of something else: the clipped sum is what is sent, not ``flat``.
    summands = op.scale * float(clipped.sample_norms.sum())
    if float((reference - flat).norm()) > 1e-3 * (float(flat.norm()) + summands) + 1e-12:
        raise GuardFailure("clip_per_sample: the gradient given is not the batch loss's gradient at (model, x, y)")
    return clipped


def _bounds(bounds: tuple | str, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
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


def _box_scale(x: torch.Tensor, shift: torch.Tensor, low: torch.Tensor, high: torch.Tensor, tau: float, rtol: float,
               start: float, limit: float) -> tuple[float, torch.Tensor, bool]:
    """Smallest scale c ≥ ``start`` with every sample's clip(x + c·Δx) − x of RMSE ≥ τ, for Δx = ``shift``.

    Each pixel's clipped error |clip(x + c·a) − x| is nondecreasing in c, so the worst sample's RMSE
    is too and bisection finds c. CG's bound ‖Δx̃ − Δx‖ ≤ rtol‖Δx̃‖ and clip being 1-Lipschitz
    bound the exact clipped RMSE below by r̃(c) − rtol·c‖Δx̃‖/√dx; that is what must reach
    τ(1 + rtol) (aimed at τ(1 + 2·rtol)). Returns (c, r̃(c) per sample, reachable within ``limit``);
    the returned c always satisfies the bound when reachable (bisection keeps a verified upper end).
    """
    dx = shift.shape[1]
    delta = shift.view_as(x)
    slack = to_rmse(rtol * shift.norm(dim=1), dx)

    def clipped(c: float) -> torch.Tensor:
        return to_rmse((torch.clamp(x + c * delta, low, high) - x).flatten(1).norm(dim=1), dx)

    def worst(c: float) -> float:
        return float((clipped(c) - c * slack).min())

    target = tau * (1 + 2 * rtol)
    lo = min(start, limit)
    if worst(lo) >= target:
        return lo, clipped(lo), True
    # The bound r̃(c) − c·slack is not monotone: r̃ saturates at the box while the CG slack grows with
    # c, so it is judged where it first succeeds — doubling from ``start`` — never only at ``limit``.
    hi = lo
    while worst(hi) < target:
        if hi >= limit:
            return limit, clipped(limit), False
        lo, hi = hi, min(2 * hi, limit)
    for _ in range(60):
        mid = (lo * hi) ** 0.5
        lo, hi = (lo, mid) if worst(mid) >= target else (mid, hi)
        if hi / lo < 1 + 1e-4:
            break
    return hi, clipped(hi), True


#: The grid of ``_scales``: steps of 2^(1/4) (19%), at most 256 scales (a span of 2^64).
SCALE_STEP, MAX_SCALES = 2 ** 0.25, 256


def _scales(shift: torch.Tensor, target: float, limit: float) -> list[float]:
    """Noise scales at which to ask which samples are certifiable: steps of SCALE_STEP from the least
    scale at which the most movable sample reaches ``target`` (linearly) up to ``limit``, included.
    With ``input_bounds`` a sample's certified (box-clipped, minus the solver's slack rtol·c·‖Δx‖)
    error is not monotone in the scale c — the clipped error saturates while the slack grows — so a
    sample certifies on a window of scales, which a doubling search can step over; the samples to
    keep are chosen where most of them certify, not only at the budget's end."""
    start = from_rmse(target, shift.shape[1]) / max(float(shift.norm(dim=1).max()), 1e-30)
    scales, scale = [], min(start, limit)
    while scale < limit and len(scales) < MAX_SCALES:
        scales.append(scale)
        scale *= SCALE_STEP
    return scales + [limit]


def _rmse_lb(jd_norm: torch.Tensor, lambda_max: torch.Tensor, dx: int) -> torch.Tensor:
    """The lower bound's RMSE ‖J_iδ‖/(λmax√dx) per sample, the guard's ``rmse_lb_after``."""
    return to_rmse(i2f_lower_bound(jd_norm, lambda_max), dx)


def _zeros(op: Jacobian, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    zeros = torch.zeros(op.batch_size, dtype=flat.dtype, device=flat.device)
    return zeros, zeros, torch.ones(op.batch_size, dtype=torch.bool, device=flat.device)


def _summaries(info: dict) -> dict:
    return {k: (float(v.min()) if isinstance(v, torch.Tensor) else v) for k, v in info.items()}
