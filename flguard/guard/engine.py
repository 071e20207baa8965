"""The leakage guard: measure → perturb → verify → report, failing closed.

``Guard(config).protect(model, x, y, gradient)`` returns the gradient to upload — or ``None`` —
and a ``GuardReport``. The promise: when ``report.met`` is true, every sample's predicted recovery
RMSE (``assess``'s ``rmse_i2f`` with δ = the noise actually added) is at least the floor τ
(``GuardConfig.floor``: ``min_rmse``, or ``max_psnr`` converted to input units).
Anything that goes wrong (a NaN gradient, a solver that does not converge, an exception, a floor
that needs more noise than the budget) ends in the ``on_unmet`` policy; with the default ``drop``
no gradient leaves the client, and never the unguarded one unless ``send`` was acknowledged.

The engine runs a step: it checks the gradient, builds the per-sample operator (clipped with
``clip_per_sample``), hands it to ``flguard.guard.perturb`` for the noise and applies the policy.
What the noise is and how it is scaled to the floor live there and in ``flguard.guard.floor``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch
from torch import nn

from flguard.defenses import draw_generator
from flguard.defenses.gaussian import isotropic
from flguard.guard import clipping
from flguard.guard.clipping import CLIP_MAX_MOVE, AdaptiveClip, clip_level, lower_quantile
from flguard.guard.config import THRESHOLD_DEFENSES, GuardConfig
from flguard.guard.damage import Displacement, StepEffect, step_effect
from flguard.guard.failure import GuardFailure, UnexplainedGradient, dead_network_reason, failure_reason
from flguard.guard.floor import Outcome, noise_budget
from flguard.guard.model_check import require_supported
from flguard.guard.perturb import AUTO_MAX_MOVE, Perturber
from flguard.guard.report import GuardOutput, GuardReport
from flguard.risk.clipped import ClippedJacobian, Jacobian
from flguard.risk.operator import JacobianOperator, LossFn, ProductLimit
from flguard.risk.precision import autocast_as, exact_float32, gradient_rtol
from flguard.risk import sizing
from flguard.risk.sizing import release_freed_memory

__all__ = ["Guard", "GuardFailure", "clip_level"]

UNKNOWN_MASKS = ("the model has train-mode dropout, and the gradient was made with masks the guard does not know: "
                 "pass the pass's draws (Guard.protect(..., draws=…), flguard.guard.DropoutDraws), or "
                 "guard the loop with make_guarded, which records them")


class Guard:
    """Applies the configured defense to one batch's flat gradient (see module doc)."""

    def __init__(self, config: GuardConfig | None = None) -> None:
        self.config = config if config is not None else GuardConfig()
        self._generators: dict[torch.device, torch.Generator] = {}
        self._perturber = Perturber(self.config)  # the defense; it keeps what auto learnt across steps
        self._adaptive_clip = AdaptiveClip()  # clip_per_sample="auto": the recent steps' moves

    def _generator(self, device: torch.device) -> torch.Generator:
        """One stream per device for the guard's lifetime: successive updates get fresh noise
        (a repeated draw across steps or rounds would let the server difference it away), and a
        configured seed makes the whole sequence reproducible."""
        if device not in self._generators:
            self._generators[device] = draw_generator(self.config.seed, device)
        return self._generators[device]

    def protect(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor, gradient: torch.Tensor,
                loss_fn: LossFn | None = None, step_size: float | None = None,
                step_rule: Displacement | None = None, draws: Sequence[torch.Tensor] | None = None,
                check_gradient: Callable[[torch.Tensor], bool] | None = None) -> GuardOutput:
        """The gradient to upload for the batch ``(x, y)`` — perturbed to the floor, or None — and its
        report (module doc). ``gradient``: the flat gradient of the trainable parameters; ``loss_fn``: the
        loss it is the gradient of (mean cross-entropy by default). ``step_size``: the learning rate of a
        plain SGD step that will apply the update (``make_guarded`` passes it for ``torch.optim.SGD``):
        ``auto`` then sends the Gaussian only while its noise moves the parameters by at most
        ``flguard.guard.perturb.AUTO_MAX_MOVE`` of their norm per step, in root mean square over the
        recent steps. ``step_rule``: the change another optimizer's next step would make with a gradient
        (``flguard.guard.trial_step``; ``make_guarded`` passes it for Adam and the others): ``clip_per_sample="auto"``
        then judges what its noise does to that step (``flguard.guard.damage``), from the median level, as it does
        SGD's. Either changes which certified noise is sent, or that none is, never the certificate. The step's freed
        memory goes back to the OS afterwards (``flguard.risk.sizing.release_freed_memory``). Called inside a
        ``torch.autocast`` block, every pass of the guard still runs in float32 (autocast is off inside).
        ``draws``: where the model has train-mode dropout, the multipliers its dropouts drew in the pass that made
        ``gradient``, in call order (``flguard.risk.dropout_draws``: record them with ``with DropoutDraws() as
        drawing: loss = criterion(model(x), y)`` and pass ``drawing.finish()``; ``make_guarded`` does): the guard
        measures and verifies that very map. Without them such a step is withheld: the gradient was made with
        masks the guard does not know. ``check_gradient``: called once with the guard's own gradient of the batch loss
        c·Σ_i∇_θℓ_i [dθ] (from its per-sample gradients, which clipping takes anyway, before any noise is drawn or any
        state of the guard's changes); where it returns False, or the operator is coupled (no per-sample gradients),
        ``flguard.guard.failure.UnexplainedGradient`` is raised instead of a step (``make_guarded``'s step checks
        ``.grad`` against it rather than recomputing the gradient: docs/results.md, "The guarded step checks .grad
        against the guard's own gradient")."""
        try:
            with autocast_as(()):
                return self._protect(model, x, y, gradient, loss_fn, step_size, step_rule, draws, check_gradient)
        finally:
            release_freed_memory()

    def _protect(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor, gradient: torch.Tensor,
                 loss_fn: LossFn | None, step_size: float | None, step_rule: Displacement | None,
                 draws: Sequence[torch.Tensor] | None,
                 check_gradient: Callable[[torch.Tensor], bool] | None = None) -> GuardOutput:
        start = time.perf_counter()
        cfg = self.config
        batch = int(x.shape[0])
        op: Jacobian | None = None
        self._clip: float | None = None  # this step's clipping norm C, once known (the budget's unit, × _span)
        self._span = 1.0  # the clipped update's largest norm per unit C (the operator's ``span``: loss_split)
        clip_share: float | None = None  # the share of the batch whose per-sample norm is at most C
        require_supported(model, "Guard.protect")  # a clear error before any measuring, not a failed step
        try:
            flat = _checked_gradient(gradient, model)
            op = JacobianOperator(model, x, y, loss_fn, limit=ProductLimit(batch, cfg.max_products, cfg.max_seconds),
                                  draws=draws, products=sizing.guard_products(x.device))
            if op.drew_masks:
                raise GuardFailure(UNKNOWN_MASKS)
            # only auto (the defense, or the clip level) reads it
            move_scale = _move_scale(model, step_size) if "auto" in (cfg.defense, cfg.clip_per_sample) else None
            with exact_float32(x.device):  # no TF32 in what the certificate rests on (flguard.risk.precision)
                if check_gradient is not None and (op.coupled or not check_gradient(
                        op.scale * op.sample_gradient_set().total())):  # (coupled: no per-sample gradients)
                    raise UnexplainedGradient("the gradient given is not the guard's gradient of the batch loss")
                if cfg.clip_per_sample is None:
                    outcome = self._perturber.perturb(op, flat, None, self._generator(x.device), move_scale=move_scale)
                else:  # the attacker then inverts the clipped upload
                    # clip_per_sample="auto" also judges what its noise does to the step (flguard.guard.damage)
                    judged = step_rule if step_rule is not None else step_size if move_scale is not None else None
                    effect = step_effect(op, judged) if judged is not None and cfg.clip_per_sample == "auto" else None
                    op, outcome, clip_details = self._clipped_step(op, flat, move_scale, self._generator(x.device),
                                                                   effect)
                    clip_share = float((op.sample_norms <= op.clip).double().mean())
                    flat = op.gradient
        except UnexplainedGradient:
            raise  # the caller's to resolve: nothing was measured against the gradient, nothing is sent
        except Exception as error:  # fail closed on anything, with the reason in the report
            reason = dead_network_reason(op, self._generator(x.device)) or failure_reason(error)
            return self._failed(gradient, batch, reason, op, start)
        report = GuardReport(
            rmse_after=outcome.rmse_after.cpu(), rmse_lb_after=outcome.rmse_lb_after.cpu(),
            eps=outcome.eps.cpu(), noise_norm=float(outcome.noise.norm()),
            rel_noise=float(outcome.noise.norm() / flat.norm().clamp_min(1e-30)), met=outcome.met, defense=cfg.defense,
            reason=outcome.reason, matvecs=op.applications, seconds=0.0, min_rmse=cfg.floor,
            details=outcome.info if self._clip is None else {**outcome.info, "clip": self._clip,
                                                             "clip_share": clip_share, **clip_details},
            rmse_error=None if outcome.rmse_error is None else outcome.rmse_error.cpu())
        if outcome.met or cfg.defense not in THRESHOLD_DEFENSES:
            report.seconds = time.perf_counter() - start
            base = flat if outcome.update is None else outcome.update
            return GuardOutput((base + outcome.noise).view_as(gradient), report)
        return self._apply_policy(flat, gradient, report, start)

    def _clipped_step(self, op: JacobianOperator, flat: torch.Tensor, move_scale: float | None,
                      generator: torch.Generator, effect: StepEffect | None = None
                      ) -> tuple[ClippedJacobian, Outcome, dict]:
        """The step on the clipped upload's operator at this step's C: (that operator, the defense's outcome,
        what the report says of the level). ``clip_per_sample="auto"`` (``flguard.guard.clipping.AdaptiveClip``)
        starts from the retention level, where ``auto`` sends the Gaussian only while its moves stay within
        CLIP_MAX_MOVE, and where the noise sent would still move the parameters too far, or undo the steps' progress
        (``effect``: its progress and damage on the batch loss, CLIP_MAX_DAMAGE), it redoes the step at the median
        (its products count against the same step limit); at either level, noise that would undo training
        (``AdaptiveClip.ruinous``, WITHHOLD_LOSS_SHARE) leaves the step unmet: withheld by the policy. Where the
        median's noise does harm, the next steps take a fraction of the median (``AdaptiveClip.adjust``)."""
        cfg = self.config
        setting = self._adaptive_clip.setting(move_scale) if cfg.clip_per_sample == "auto" else cfg.clip_per_sample
        level = clip_level(setting, op, cfg.clip_quantile, cfg.clip_retention)
        lowered = cfg.clip_per_sample == "auto" and setting == "median" and self._adaptive_clip.factor < 1
        clipped = _clipped(op, flat, level * self._adaptive_clip.factor if lowered else level)
        self._clip, self._span = clipped.clip, clipped.span
        if cfg.clip_per_sample != "auto":
            outcome = self._perturber.perturb(clipped, clipped.gradient, self._clip, generator, move_scale=move_scale)
            return clipped, outcome, {}
        memory = self._perturber.memory()
        # at the level "auto" raised, auto sends the Gaussian only within the stricter limit, else its aimed noise
        outcome = self._perturber.perturb(clipped, clipped.gradient, self._clip, generator, move_scale=move_scale,
                                          max_move=CLIP_MAX_MOVE if setting == "retention" else AUTO_MAX_MOVE)
        details = {"clip_rule": setting, **({"clip_factor": self._adaptive_clip.factor} if lowered else {})}
        if (move_scale is not None or effect is not None) and outcome.met:
            move = _move(move_scale, outcome)
            measured = _measured_effect(effect, clipped, outcome, details)
            median = lower_quantile(clipped.sample_norms, 0.5)  # clip_level's median, from the norms at hand
            raised = setting == "retention" and self._clip > median  # a lower level to fall back on
            far = raised and self._adaptive_clip.too_far(move)
            harm = raised and not far and measured is not None and self._adaptive_clip.harmful(measured)
            if far or harm:
                why = (f"its noise would move the parameters by {move:.1%} of their norm, over {CLIP_MAX_MOVE:.0%} "
                       "root mean square over the recent steps" if far else
                       f"its noise would add {measured[1]:.3g} to the batch loss against the {measured[0]:.3g} the "
                       "step removes: over the recent steps, more than the steps' progress")
                details["clip_reasons"] = (f"retention (C = {self._clip:.4g}, {self._clip / median:.3g}× the median): "
                                           + why)
                self._perturber.restore(memory)  # the retention attempt is not a step auto learns from
                self._adaptive_clip.fall_back()
                clipped = ClippedJacobian(op, median)  # ``flat`` was checked against this operator above
                self._clip, details["clip_rule"] = clipped.clip, "median"
                outcome = self._perturber.perturb(clipped, clipped.gradient, self._clip, generator,
                                                  move_scale=move_scale)
                move = _move(move_scale, outcome)
                measured = _measured_effect(effect, clipped, outcome, details) if outcome.met else None
            at_median = details["clip_rule"] == "median" or not raised  # (the retention level may be the median)
            ruined = outcome.met and measured is not None and self._adaptive_clip.ruinous(measured, at_median)
            if ruined:
                outcome.met = False  # the engine's policy: withheld (drop), with the reason
                outcome.reason = (f"the floor needs noise that would undo training: it would add {measured[1]:.3g} to "
                                  f"the batch loss of {measured[2]:.3g}, against the {measured[0]:.3g} the step "
                                  "removes (" + (f"at C = {self._clip:.4g}: more than the steps' progress over "
                                                 "the recent steps, or on this step alone more than its progress "
                                                 f"and {clipping.WITHHOLD_LOSS_SHARE:.0%} of the loss" if at_median
                                                 else "over the recent steps or on this step alone, more than the "
                                                 "steps' progress and more than "
                                                 f"{clipping.WITHHOLD_LOSS_SHARE:.0%} of the loss")
                                  + "; a larger batch or a weaker floor needs less noise)")
            elif outcome.met:
                self._adaptive_clip.record(move, measured)
            if at_median and measured is not None and (ruined or outcome.met):
                why = self._adaptive_clip.adjust(measured, withheld=ruined)  # the next steps' factor of the median
                if why:
                    details["clip_reasons"] = "; ".join(filter(None, (details.get("clip_reasons"), why)))
                    outcome.reason += f"; for the next steps {why}" if ruined else ""
        return clipped, outcome, details

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
            noise = _budget_noise(flat, cfg, self._generator(flat.device), getattr(self, "_clip", None),
                                  getattr(self, "_span", 1.0))
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


def _measured_effect(effect: StepEffect | None, clipped: ClippedJacobian, outcome: Outcome,
                     details: dict) -> tuple[float, float, float] | None:
    """(progress, damage, batch loss) of the step ``outcome`` would send (``flguard.guard.damage``), written into
    ``details`` (``step_progress``, ``noise_damage``, ``batch_loss``); None without ``effect``."""
    if effect is None:
        return None
    update = clipped.gradient if outcome.update is None else outcome.update
    measured = effect(update, outcome.noise)
    details["step_progress"], details["noise_damage"], details["batch_loss"] = measured
    return measured


def _move(move_scale: float | None, outcome: Outcome) -> float | None:
    """The share of the parameters' norm the noise sent moves them by (None without a step size)."""
    return None if move_scale is None else move_scale * float(outcome.noise.norm())


def _move_scale(model: nn.Module, step_size: float | None) -> float | None:
    """``step_size`` ÷ ‖θ‖ (trainable parameters): × ‖noise‖, the share of the parameters' norm a step of
    that noise moves them by (``auto``'s AUTO_MAX_MOVE); None without a positive step size."""
    if step_size is None or not step_size > 0:
        return None
    with torch.no_grad():
        norm = float(torch.sqrt(sum(p.detach().double().pow(2).sum() for p in model.parameters() if p.requires_grad)))
    return step_size / norm if norm > 0 else None


def _checked_gradient(gradient: torch.Tensor, model: nn.Module) -> torch.Tensor:
    total = sum(p.numel() for p in model.parameters() if p.requires_grad)
    if not isinstance(gradient, torch.Tensor) or gradient.numel() != total:
        raise GuardFailure(f"gradient must be a tensor of {total} entries (the trainable parameters)")
    if not bool(torch.isfinite(gradient).all()):
        raise GuardFailure("gradient contains NaN or Inf")
    return gradient.detach().reshape(-1)


def _budget_noise(flat: torch.Tensor, cfg: GuardConfig, generator: torch.Generator,
                  clip: float | None, span: float) -> torch.Tensor:
    """Isotropic noise of norm max_rel_noise·‖g‖ (or ·span·C) — the most the budget allows, no measurement needed."""
    z = isotropic(flat.shape, generator, flat).vector
    return z * (noise_budget(flat, cfg, clip, span) / float(z.norm()))


def _clipped(op: JacobianOperator, flat: torch.Tensor, clip: float) -> ClippedJacobian:
    """The clipped upload's operator, after checking that ``flat`` is the batch loss's gradient (the
    guard then sends Σ clip(g_i) instead, so anything else in ``flat`` would be silently lost)."""
    clipped = ClippedJacobian(op, clip)
    reference = clipped.unclipped_gradient.to(flat)
    # float32 sums of B per-sample gradients differ from the batch gradient by rounding relative to the
    # summands, not to their (cancelling) sum: 1.1e-4 of ‖g‖ on an untrained ResNet-18, more once trained.
    # On a CUDA device ``flat`` may come from TF32 convolutions (``gradient_rtol``; the reference is IEEE float32).
    # The check only catches a gradient of something else: the clipped sum is what is sent, not ``flat``.
    summands = op.scale * float(clipped.sample_norms.sum())
    gap, allowed = float((reference - flat).norm()), gradient_rtol(flat, 1e-3) * (float(flat.norm()) + summands) + 1e-12
    if gap > allowed:
        raise GuardFailure(f"clip_per_sample: the gradient given is not the batch loss's gradient at (model, x, y): "
                           f"‖difference‖ {gap:.3g} against the {allowed:.3g} that rounding explains (‖g‖ = "
                           f"{float(flat.norm()):.3g}; a gradient of something else, or one too ill-conditioned for "
                           "float32 — an untrained model whose gradients explode; under torch.autocast, pass the "
                           "float32 gradient: the guard measures and sends float32)")
    return clipped
