"""Perturbing one step: the configured defense's noise direction, calibrated to the floor.

``Perturber.perturb`` runs the configured kind on the step's (clipped) operator: a threshold defense
(``gaussian``, ``rowspace``, ``eigen``) scaled by ``flguard.guard.floor``; ``auto`` tries them in turn on
the same operator; a baseline (``localdp``, pruning, …) applies its fixed rule and reports the I²F it leaves.
It raises ``GuardFailure`` on anything it cannot certify; the engine turns that into its policy.
"""

from __future__ import annotations

import torch

from flguard.defenses import BASELINES, DefenseContext
from flguard.defenses.gaussian import isotropic
from flguard.defenses.resolvent import resolvent_start, run_steps
from flguard.defenses.rowspace import rowspace
from flguard.guard.box_bound import clipped_norms, flat64
from flguard.guard.config import DEFAULT_FALLBACK, THRESHOLD_DEFENSES, GuardConfig
from flguard.guard.exclusion import excludable, kept_gradient, negligible_samples
from flguard.guard.failure import GuardFailure, failure_reason
# its PRECONDITION_CG, SOLVER_MAX_ITER and STOP_WHEN_SUFFICIENT are read at call time (tests and benchmarks set them)
from flguard.guard import floor
from flguard.guard.floor import FloorCalibrator, Outcome, checked_solve, input_bounds, noise_budget, rmse_lb
from flguard.risk.assess import i2f_norms, i2f_solve_with_lambda_max
from flguard.risk.closed_forms import from_rmse, to_rmse
from flguard.risk.clipped import Jacobian, base_operator
from flguard.risk.krylov import Sufficient
from flguard.risk.regularised import RegularisedK

#: The calibrated Gaussian's direction and row-space noise need no Ritz vectors from the verification's
#: spectrum (row-space noise's filter runs a rough Lanczos of its own), so their λmax (for ε) and their
#: I²F solve come from one Lanczos run per sample started at J_iδ (``flguard.risk.lanczos_solve``)
#: instead of a Lanczos run and then PCG: the same certificate (the true residual's bound ≤ rtol‖x‖, ε
#: from λmax's own residual test), about a third fewer Jacobian products (docs/results.md "One Lanczos
#: run for λmax and the solve"). False: as before.
LANCZOS_SOLVE = True
#: The kinds whose direction is drawn before the spectrum is known (LANCZOS_SOLVE applies to them).
ONE_RUN_KINDS = ("gaussian", "rowspace")
#: With ``max_excluded`` > 0 the negligible samples (``flguard.guard.exclusion``: gradient ≤ 1% of C) are
#: left out unsolved, free of the share: the one-run solve skips them, and eigen (or a kind run without
#: the one-run solve) runs on the other samples alone (``Perturber._without``). They are the well-fitted
#: samples whose float32 solves rarely certify: they ran to SOLVER_MAX_ITER — on the trained quickstart
#: CNN at B = 32, 8–12 of 32 samples, and about 60% of the guard's time per step — and eigen's Lanczos run
#: could not converge their λmax, which withheld every step (docs/results.md, "Negligible samples left out
#: unsolved"). Leaving a sample out is always safe: nothing of it is sent.
SKIP_NEGLIGIBLE = True


#: ``defense="auto"`` (the default): the calibrated Gaussian first — isotropic noise, one Lanczos run per
#: sample — and, when it needs more than the budget or its noise would randomise the parameters
#: (AUTO_MAX_MOVE), noise aimed at the samples' weak directions (the config's ``fallback``: ``resolvent`` by
#: default, or ``eigen``), which needs far less of it where the parameters outnumber the inputs: on the
#: trained ResNet-20-GN at B = 8 the Gaussian needed 54–663 C and sent 0 of 5 steps, eigen 5 of 5
#: (docs/results.md, "The guard on the models practitioners train"); resolvent noise sends there at about a quarter
#: of eigen's products and trains those rounds, and the CNN from scratch, about as well (docs/results.md,
#: "Resolvent noise from the λmax run, and auto's fallback"). Row-space noise (``rowspace``, the filtered noise
#: without the per-sample scale) sends too, but a 5-step round on that ResNet ended at 49% accuracy against
#: eigen's 62% (unguarded 67.5%), so it is an explicit choice, not auto's (docs/results.md, "Row-space noise").
AUTO_FIRST = "gaussian"

#: ``auto`` reuses what a step learnt: when its first kind needed more than AUTO_SKIP_FACTOR × the budget,
#: or its moves exceeded AUTO_MAX_MOVE, the next AUTO_SKIP_STEPS steps try the next kind first (the model
#: moves little from one step to the next; every kind still verifies its own floor, so the order only
#: changes which certified noise is sent and what is spent).
AUTO_SKIP_FACTOR = 2.0
AUTO_SKIP_STEPS = 8
#: ``auto`` with a known step size (``Guard.protect(step_size=…)``: SGD's learning rate, which
#: ``make_guarded`` and ``guard_step(step_size=…)`` pass) sends the Gaussian only while its noise keeps the
#: parameters' random walk small: the Gaussian's move per step, m = step_size·‖noise‖/‖θ‖, is averaged in
#: square over the steps it was computed on (an exponential average over AUTO_MOVE_STEPS steps), and where
#: that root mean square exceeds AUTO_MAX_MOVE the aimed noise (``fallback``) is sent instead (the Gaussian only if
#: the aimed noise does not meet the floor). Isotropic noise costs little while it stays small beside the weights
#: and randomises the model once it does not; a single large step does little, a run of them undoes
#: training. Measured (docs/results.md, "auto judges the Gaussian's move"; benchmarks/study_gaussian_move.py):
#: on the trained quickstart CNN (lr 0.01) the Gaussian's moves are heavy-tailed (0.01–5.5% a step, running
#: root mean square at most 2.2%), on the trained ResNet-20-GN at B = 32 (lr 0.01) 5.7% median (running RMS at
#: most 7.9%), and neither costs accuracy over a round; on the CNN trained from scratch (lr 0.1) they are 0.7%
#: at initialisation and 11–16% in root mean square from its 40th step on (running RMS 17–20%), where the
#: federated round collapsed to 10–12% and eigen trains. 5% (the first setting) sent eigen on the ResNet-20's
#: round at 8× the Gaussian's products and 1.9 points less accuracy.
AUTO_MAX_MOVE = 0.10
AUTO_MOVE_STEPS = 8
#: ``auto`` abandons its first kind's solve part-way (``Hopeless``) once its error bounds show that the floor needs
#: more noise than the budget: the finished solve's decision — the kind is not sent — without the rest of its
#: products; the next AUTO_SKIP_STEPS steps then try the fallback first (a solve abandoned part-way does not know by
#: how much the budget falls short, so unlike a finished one it does not compare with AUTO_SKIP_FACTOR). Measured on
#: the trained ResNet-18-GN at B = 8: the first step's 44 products to 30 (the Gaussian's ~20 to ~6), the round's mean
#: step 53× → 45× a training step, the same iterates; ResNet-20-GN's first step 44.75 → 40 (docs/results.md, "auto's
#: first kind: not computed where it cannot be sent, abandoned part-way …"). False: solved to the end.
ABANDON_HOPELESS = True


def auto_order(config: GuardConfig) -> tuple[str, str]:
    """``auto``'s kinds in the order tried: the Gaussian, then the config's aimed ``fallback``."""
    return AUTO_FIRST, getattr(config, "fallback", DEFAULT_FALLBACK)


class Perturber:
    """The guard's defense on one step after another; ``auto`` remembers across steps when its first
    kind was far over budget or moved the parameters too far (AUTO_SKIP_STEPS), and the Gaussian's recent
    moves (AUTO_MAX_MOVE)."""

    def __init__(self, config: GuardConfig) -> None:
        self.config = config
        self._skip_first = 0  # auto: steps left that skip auto_order's first kind (AUTO_SKIP_STEPS)
        self._move_square: float | None = None  # auto: the Gaussian's mean square move (AUTO_MAX_MOVE)

    def perturb(self, op: Jacobian, flat: torch.Tensor, clip: float | None, generator: torch.Generator,
                kind: str | None = None, move_scale: float | None = None, max_move: float = AUTO_MAX_MOVE,
                abandon: bool = False) -> Outcome:
        """The configured defense's outcome on this step (``kind``: the threshold defense to apply
        instead, for ``auto``; ``move_scale``: step size ÷ ‖θ‖, which turns ‖noise‖ into the share of
        the parameters' norm it moves them by, for auto's limit ``max_move``: AUTO_MAX_MOVE, or the engine's
        stricter one at a raised clip level, ``flguard.guard.clipping.CLIP_MAX_MOVE``; ``abandon``: raise
        ``Hopeless`` part-way through a one-run solve once the floor certainly needs more than the budget,
        ``auto``'s first kind)."""
        cfg = self.config
        kind = kind or cfg.defense
        if kind == "auto":
            return self._auto(op, flat, clip, generator, move_scale, max_move)
        eigen = kind == "eigen"
        one_run = kind in ONE_RUN_KINDS and LANCZOS_SOLVE and cfg.floor > 0
        if kind in THRESHOLD_DEFENSES and not one_run:  # the one-run solve skips them itself
            left = _left_out_unsolved(op, cfg)
            if left is not None:
                return self._without(left, op, flat, clip, generator, kind)
        lanczos_seed = int(torch.randint(0, 2**31 - 1, (1,), generator=generator, device=flat.device))
        if one_run:
            return self._in_one_run(kind, op, flat, clip, generator, lanczos_seed, abandon)
        # eigen chooses among the run's Ritz directions, resolvent filters its start vector on its Krylov space
        spectrum = RegularisedK(op).lanczos(rtol=cfg.rtol, ends="max", min_iter=_krylov_steps(kind, cfg),
                                            max_iter=max(floor.SOLVER_MAX_ITER, cfg.krylov_steps if eigen else 0),
                                            return_vectors=eigen or floor.PRECONDITION_CG, seed=lanczos_seed,
                                            start=resolvent_start(generator, op) if kind == "resolvent" else None)
        if not bool(spectrum.converged.all()):
            raise GuardFailure("λmax did not converge within the Lanczos limit")
        lambda_max = spectrum.lambda_max
        eps = cfg.eps * lambda_max if cfg.eps_mode == "relative" else torch.full_like(lambda_max, cfg.eps)
        ctx = DefenseContext(op, flat, eps, lambda_max, generator, cfg, spectrum=spectrum)
        if kind in THRESHOLD_DEFENSES:
            return FloorCalibrator(cfg, clip).meet(ctx, kind=kind)
        noise = BASELINES[cfg.defense](ctx) - flat
        i2f, jd, converged = i2f_norms(op, noise, eps, cfg.rtol) if noise.any() else _zeros(op, flat)
        if not bool(converged.all()):
            raise GuardFailure("I2F solve did not converge")
        rmse = to_rmse(i2f, op.dx)
        met = bool((rmse >= cfg.floor).all())
        return Outcome(noise, rmse, rmse_lb(jd, lambda_max, op.dx), eps, met,
                       "" if met else "baseline misses min_rmse", dict(ctx.info))

    def _in_one_run(self, kind: str, op: Jacobian, flat: torch.Tensor, clip: float | None,
                    generator: torch.Generator, seed: int, abandon: bool = False) -> Outcome:
        """A direction drawn before the verification's ε exists (``ONE_RUN_KINDS``: the isotropic draw z, or
        row-space noise Σ J_iᵀw_i), with λmax and its I2F solve from one Lanczos run per sample
        (``LANCZOS_SOLVE``), then scaled to the floor exactly as ``FloorCalibrator.meet`` does; with ``abandon``,
        given up (``Hopeless``) once the floor certainly needs more than the budget."""
        cfg = self.config
        direction = (isotropic(op.dtheta, generator, flat) if kind == "gaussian"
                     else rowspace(op, generator, cfg.eps, cfg.eps_mode == "relative"))
        calibrator = FloorCalibrator(cfg, clip)
        limit = noise_budget(flat, cfg, clip, op.span) / max(float(direction.vector.norm()), 1e-30)
        rule = calibrator.sufficient(op.x, limit) if floor.STOP_WHEN_SUFFICIENT else None
        if abandon:
            rule = _abandoning(rule, op, cfg, limit)
        shift, jd, converged, lambda_max, eps, lambda_ok, bound = i2f_solve_with_lambda_max(
            op, direction.vector, cfg.eps, cfg.eps_mode == "relative", cfg.rtol, seed=seed, max_iter=floor.SOLVER_MAX_ITER,
            skip=_left_out_unsolved(op, cfg), sufficient=rule)
        if not bool(lambda_ok.all()) and cfg.max_excluded <= 0:  # else such a sample is one to leave out
            raise GuardFailure("λmax did not converge within the Lanczos limit")
        ctx = DefenseContext(op, flat, eps, lambda_max, generator, cfg)
        solved = checked_solve(shift, jd, converged, cfg.max_excluded > 0, bound)
        return calibrator.meet(ctx, (direction, solved), kind=kind)

    def _without(self, left: torch.Tensor, op: Jacobian, flat: torch.Tensor, clip: float | None,
                 generator: torch.Generator, kind: str) -> Outcome:
        """``kind`` measured and verified on the samples not ``left`` out (``SKIP_NEGLIGIBLE``): its
        spectrum, direction and solves on the restricted operator, against the upload without the
        left-out samples (``kept_gradient``), which is what is then sent. ``max_excluded`` then counts
        the other samples' share of the rest (stricter than of the batch: it never leaves out more)."""
        keep = ~left
        index = keep.nonzero().squeeze(1)
        sub = op.restricted(index)
        kept = kept_gradient(op, flat, keep)
        counter = base_operator(sub)
        try:
            outcome = self.perturb(sub, kept, clip, generator, kind)
        finally:  # the step's count stays in whole-batch products (and its limit saw every product)
            base_operator(op).applications += counter.applications * index.numel() / op.batch_size

        def full(values: torch.Tensor, fill: float) -> torch.Tensor:
            out = torch.full((op.batch_size,), fill, dtype=values.dtype, device=values.device)
            out[index] = values
            return out

        info, count = dict(outcome.info), int(left.sum())
        info["excluded"] = int(info.get("excluded", 0)) + count
        info["excluded_negligible"] = int(info.get("excluded_negligible", 0)) + count
        return Outcome(outcome.noise, full(outcome.rmse_after, float("inf")), full(outcome.rmse_lb_after, float("inf")),
                       full(outcome.eps, 0.0), outcome.met, outcome.reason, info,
                       kept if outcome.update is None else outcome.update,
                       None if outcome.rmse_error is None else full(outcome.rmse_error, 0.0))

    def _auto(self, op: Jacobian, flat: torch.Tensor, clip: float | None, generator: torch.Generator,
              move_scale: float | None, max_move: float = AUTO_MAX_MOVE) -> Outcome:
        """``auto``: each of ``auto_order`` in turn on the same operator (its products count against the
        same step limit) until one meets the floor within the budget — the first, isotropic kind only
        while its moves stay within ``max_move`` (``_moved_too_far``), else kept as the fallback; the
        last one's outcome when none met. Where the Gaussian's average move would stay over ``max_move`` whatever
        this step's (``_always_too_far``), the aimed noise is tried first and the Gaussian computed only if that
        fails: the same noise is sent as when the Gaussian was computed first and found too far, without computing
        it (the random draws differ). The report's details name the one that was sent (``defense_used``) and why
        the others were not (``auto_reasons``)."""
        reasons, order, fallback, outcome = [], auto_order(self.config), None, None
        first, deferred = order[0], False
        if self._skip_first > 0:
            self._skip_first -= 1
            order = order[1:] + order[:1]
            reasons.append(f"{first}: tried last (within the last {AUTO_SKIP_STEPS} steps it needed over "
                           f"{AUTO_SKIP_FACTOR:g}× the budget, or over it by a solve abandoned part-way, or its moves "
                           "exceeded their limit)")
        elif self._always_too_far(move_scale, max_move):  # it can only be the fallback's fallback: not computed first
            order, deferred, self._skip_first = order[1:] + order[:1], True, AUTO_SKIP_STEPS
            reasons.append(f"{first}: tried last (its moves' root mean square over the recent steps stays over "
                           f"{max_move:.0%} whatever this step's move: {self._move_square ** 0.5:.1%} before it)")
        for kind in order:
            if deferred and kind == first:
                deferred = False  # computed after all: its own move enters the average (``_moved_too_far``)
            abandon = ABANDON_HOPELESS and kind == first and kind != order[-1]  # a fallback to go on to
            try:
                outcome = self.perturb(op, flat, clip, generator, kind, abandon=abandon)
            except Exception as failure:  # the next kind may still certify; every kind verifies its own floor
                outcome = None
                reasons.append(f"{kind}: {failure_reason(failure)}")
                if isinstance(failure, Hopeless):  # over the budget, by how much unknown (ABANDON_HOPELESS)
                    self._skip_first = AUTO_SKIP_STEPS
                continue
            outcome.info["defense_used"] = kind
            noise = float(outcome.noise.norm())
            far = kind == first and outcome.met and self._moved_too_far(noise, move_scale, max_move)
            if outcome.met and not far:
                if deferred:  # the Gaussian was not computed: its move counts as the least it could be, none
                    self._move_square = averaged_square(self._move_square, 0.0, AUTO_MOVE_STEPS)
                return _noted(outcome, reasons)
            if outcome.met:
                fallback = outcome
                reasons.append(f"{kind}: its noise would move the parameters by {noise * move_scale:.1%} of their norm, "
                               f"{self._move_square ** 0.5:.1%} root mean square over the recent steps (over "
                               f"{max_move:.0%})")
            else:
                reasons.append(f"{kind}: {outcome.reason}")
            budget = noise_budget(flat, self.config, clip, op.span)
            if kind == first and (far or noise > AUTO_SKIP_FACTOR * budget):
                self._skip_first = AUTO_SKIP_STEPS
        if fallback is not None:
            return _noted(fallback, reasons)
        if outcome is None:
            raise GuardFailure("; ".join(reasons))
        outcome.reason = "; ".join(reasons)
        return outcome

    def memory(self) -> tuple:
        """What ``auto`` remembers across steps, to ``restore`` after an attempt that is not sent (the engine's
        ``clip_per_sample="auto"`` redoing a step at another clip level)."""
        return self._skip_first, self._move_square

    def restore(self, memory: tuple) -> None:
        self._skip_first, self._move_square = memory

    def _always_too_far(self, move_scale: float | None, max_move: float) -> bool:
        """Whether the Gaussian's moves would exceed ``max_move`` in root mean square whatever this step's move, a zero
        one included (``_moved_too_far``'s average): it could then be sent only where the aimed noise fails, so
        ``auto`` tries the aimed noise first and computes the Gaussian only then. False without a step size or an
        average. Where the aimed noise is sent, the average takes this step's move as zero, the least it could be:
        the Gaussian is computed again once its average could fall under the limit."""
        if move_scale is None or self._move_square is None:
            return False
        return averaged_square(self._move_square, 0.0, AUTO_MOVE_STEPS) ** 0.5 > max_move

    def _moved_too_far(self, noise: float, move_scale: float | None, max_move: float = AUTO_MAX_MOVE) -> bool:
        """Whether the Gaussian's moves, this one (``noise`` × ``move_scale``) included, exceed ``max_move``
        in root mean square over the recent steps (an exponential average over AUTO_MOVE_STEPS); False
        without a step size."""
        if move_scale is None:
            return False
        self._move_square = averaged_square(self._move_square, noise * move_scale, AUTO_MOVE_STEPS)
        return self._move_square ** 0.5 > max_move


def averaged_square(previous: float | None, move: float, steps: int) -> float:
    """The exponential running mean of squared moves over ``steps`` steps with this ``move`` included (its square
    alone for the first): what ``auto``'s AUTO_MAX_MOVE and the clip level's CLIP_MAX_MOVE are compared with."""
    square = move * move
    return square if previous is None else previous + (square - previous) / steps


def _noted(outcome: Outcome, reasons: list[str]) -> Outcome:
    """``auto``'s met outcome, with why the kinds before it were not sent (``auto_reasons``)."""
    if reasons:
        outcome.info["auto_reasons"] = "; ".join(reasons)
    return outcome


def _left_out_unsolved(op: Jacobian, cfg: GuardConfig) -> torch.Tensor | None:
    """The samples left out unsolved (``SKIP_NEGLIGIBLE``: skipped by the one-run solve, restricted away by
    ``Perturber._without`` for the other kinds): the negligible ones where samples may be left out, unless
    that is all of them (the step could then certify none); None: solve every sample."""
    if not SKIP_NEGLIGIBLE or cfg.max_excluded <= 0 or base_operator(op).coupled:
        return None
    free = negligible_samples(op)
    return free if bool(free.any()) and not bool(free.all()) else None


class Hopeless(GuardFailure):
    """A direction whose floor certainly needs more noise than the caller's limit, found part-way through its solve."""


def _abandoning(rule: Sufficient | None, op: Jacobian, cfg: GuardConfig, limit: float) -> Sufficient:
    """``rule`` (the solver's early stop), raising ``Hopeless`` first wherever the solve's error bounds show that no
    scale up to c = ``limit`` (the budget's) certifies enough samples. Sample i's certified error at scale
    c is at most its exact one, ‖clip(x_i + cΔ_i) − x_i‖ (unclipped without ``input_bounds``), and that is at most
    ‖clip(x_i + cΔ̃_i) − x_i‖ + 2cη_i (clip is 1-Lipschitz) for the iterate Δ̃_i handed to the rule and its error
    bound η_i — twice it: the iterate may be the point the ball's residual was taken at rather than its centre, and
    before its check the run's own estimate of it is trusted to within ``DRIFT`` = 2; η_i is taken at the ε of the
    run's current θmax ≤ λmax, which only lengthens the shift. That bound grows with c, so a sample below τ(1 + rtol)
    there certifies at no scale up to c; where leaving every such sample out is not allowed (``max_excluded``,
    negligible samples free, as ``FloorCalibrator.meet`` counts them) the floor needs more noise than c. The
    decision, not the certificate, rests on it: a direction abandoned is not sent, and the next is verified."""
    reach = from_rmse(cfg.floor * (1 + cfg.rtol), op.dx)
    share = 0.0 if base_operator(op).coupled else cfg.max_excluded
    free = negligible_samples(op) if share > 0 else None
    box = None if cfg.bounds is None else flat64(op.x, *input_bounds(cfg.bounds, op.x))  # x, low, high

    def checked(shift: torch.Tensor, error: torch.Tensor, ask: torch.Tensor) -> torch.Tensor:
        reached = limit * shift.double().norm(dim=1) if box is None else clipped_norms(box[0], shift, *box[1:], limit)
        most = reached + 2 * limit * error.double()
        short = ~(most >= reach)  # NaN counts as short: such a sample cannot certify either
        if bool(short.any()) and not excludable(~short, share, free):
            raise Hopeless(f"the floor τ={cfg.floor:.4g} needs more noise than the budget max_rel_noise="
                           f"{cfg.max_rel_noise}: there {int(short.sum())} of {short.numel()} samples stay below it "
                           "whatever their solves' remaining error (its solve abandoned part-way)")
        return rule(shift, error, ask) if rule is not None else torch.zeros_like(ask)

    return checked


def _krylov_steps(kind: str, cfg: GuardConfig) -> int:
    """The λmax run's length at least: eigen's ``krylov_steps`` (its subspace to choose from), resolvent's
    ``run_steps()`` (its filter and its scale), else none beyond convergence."""
    if kind == "eigen":
        return cfg.krylov_steps
    return run_steps() if kind == "resolvent" else 0


def _zeros(op: Jacobian, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    zeros = torch.zeros(op.batch_size, dtype=flat.dtype, device=flat.device)
    return zeros, zeros, torch.ones(op.batch_size, dtype=torch.bool, device=flat.device)
