"""The clip level C of per-sample clipping (``clip_per_sample``), one step after another.

A number is C itself. The strings need no tuning: C comes from the batch's own per-sample gradient norms
(``clip_level``), so C and the noise budget max_rel_noise·C scale with the model's gradients. ``"auto"``
chooses between two of them across steps (``AdaptiveClip``): ``"retention"``, which keeps the step along the
batch gradient, while the noise the guard sends keeps the parameters' moves small and does not undo the steps'
progress; the median otherwise, or a fraction of it where the median's noise itself does harm.
"""

from __future__ import annotations

import torch

from flguard.guard.config import DEFAULT_CLIP_RETENTION
from flguard.guard.failure import GuardFailure
from flguard.guard.perturb import AUTO_MAX_MOVE, averaged_square
from flguard.risk.operator import JacobianOperator
from flguard.risk.sample_gradients import SampleGradients

__all__ = ["AdaptiveClip", "CLIP_MAX_DAMAGE", "CLIP_MAX_MOVE", "WITHHOLD_LOSS_SHARE", "clip_level", "lower_quantile",
           "retained_clip_level"]


def clip_level(setting: float | str, op: JacobianOperator, quantile: float = 0.5,
               retention: float = DEFAULT_CLIP_RETENTION) -> float:
    """This step's clipping norm C: ``clip_per_sample`` itself, or for ``"median"`` the median of the
    batch's unscaled per-sample gradient norms ‖g_i‖ (the lower median for an even batch, so C is
    one sample's norm; that sample is measured unclipped, the derivative of clip_C from below), for
    ``"quantile"`` their ``quantile`` quantile (the lower one, again a sample's norm; 0.5 is the median),
    for ``"retention"`` the smallest sample norm from the lower median up whose clipped sum keeps
    ``retention`` of the batch gradient's length along it (``retained_clip_level``). (``"auto"`` is one
    of the last two at each step: ``AdaptiveClip`` says which.)

    These need no tuning: C and the budget max_rel_noise·C scale with the model's gradients, from one
    step to the next and from a small CNN to a ResNet; the median clips half the batch, a higher
    quantile fewer. C is a statistic of the batch; the guard's threat model takes it as known to the
    attacker (it is part of "everything but sample i"), and each block is measured at that C."""
    if not isinstance(setting, str):
        return float(setting)
    gradients = op.sample_gradient_set()  # the [B, dθ] matrix, or never formed (flguard.risk.sample_gradients)
    share = quantile if setting == "quantile" else 0.5
    norms = gradients.norms()
    level = lower_quantile(norms, share)
    if not level > 0:
        raise GuardFailure(f"clip_per_sample={setting!r}: the batch's {share:g} quantile of per-sample gradient "
                           "norms is 0 (that share of the batch has a zero gradient); set a numeric clip_per_sample")
    return retained_clip_level(gradients, level, retention, norms) if setting == "retention" else level


def lower_quantile(norms: torch.Tensor, share: float) -> float:
    """The batch's ``share`` quantile of per-sample gradient norms, the lower one (a sample's own norm):
    ``clip_level``'s C for ``"median"`` (0.5) and ``"quantile"``."""
    return float(torch.quantile(norms.double(), share, interpolation="lower"))


def retained_clip_level(gradients: torch.Tensor | SampleGradients, lowest: float, retention: float,
                        norms: torch.Tensor | None = None) -> float:
    """The smallest per-sample norm C ≥ ``lowest`` with ⟨Σ_i clip_C(g_i), g⟩ ≥ ``retention``·‖g‖², g = Σ_i g_i
    (``gradients`` [B, dθ], unscaled, or as ``flguard.risk.sample_gradients`` reads them): clipping may shorten the
    step along the batch gradient to that share, no further. Why: on a trained model the few samples it still gets
    wrong carry most of the gradient, and the median clips them hardest (measured on the trained quickstart CNN: the
    median keeps 0.5–1.6% of the step along g, and a round clipped so barely learns; on the ResNet-20-GN 39%). A
    larger C needs larger noise, which training from scratch does not survive: ``"auto"`` (``AdaptiveClip``) bounds
    that; "retention" alone does not (docs/results.md, "A clip level that keeps the step"). ⟨clip_C(g_i), g⟩ =
    min(1, C/‖g_i‖)·a_i with a_i = ⟨g_i, g⟩, one pass over the gradients (``SampleGradients.along_sum``); C = max
    ‖g_i‖ clips nothing and keeps all of g, so a C always qualifies. A zero batch gradient (‖g‖ = 0) keeps
    ``lowest``. ``norms``: the ‖g_i‖ when the caller has them (``clip_level``: those it took the median of), else
    taken here."""
    if isinstance(gradients, torch.Tensor):
        gradients = SampleGradients(gradients)
    # as lower_quantile took them, so ``lowest`` is among them
    norms = (gradients.norms() if norms is None else norms).double()
    along = gradients.along_sum()  # a_i = ⟨g_i, g⟩, Σ_i a_i = ‖g‖²
    total = float(along.sum())
    if not total > 0:
        return lowest
    candidates = torch.sort(norms[norms >= lowest]).values  # the lower median's own norm first
    factors = torch.clamp(candidates[:, None] / norms.clamp_min(1e-300)[None, :], max=1.0)  # [candidate, sample]
    kept = (factors * along).sum(dim=1)
    ok = torch.nonzero(kept >= retention * total).flatten()
    return float(candidates[ok[0]]) if len(ok) else float(norms.max())


#: ``clip_per_sample="auto"`` keeps the retention level only while the noise sent moves the parameters by at
#: most this share of their norm per step, in root mean square over the recent steps (an exponential average
#: over CLIP_MOVE_STEPS, this step's included); beyond it the step is redone at the median and the next
#: CLIP_MEDIAN_STEPS steps take the median directly. At the retention level ``auto`` sends the Gaussian only
#: within this limit too, else its aimed noise, which moves the weights far less. Half of ``auto``'s limit on the
#: Gaussian at the median (``flguard.guard.perturb.AUTO_MAX_MOVE``): a raised C is worth its noise only where
#: that noise is clearly small beside the weights. Measured (docs/results.md, "A clip level for both regimes";
#: ``benchmarks/study_gaussian_move.py --guard defense=auto clip_per_sample=…``): on the trained quickstart CNN
#: (lr 0.01) the retention level's aimed noise moved the weights 0.2–1.0% a step (root mean square 0.5%); on the
#: CNN trained from scratch (lr 0.1) 8.4% after 150 unguarded steps and 24% after 400 (4.5% and 7.5% in a rerun), where
#: a federated run with "retention" collapsed to 10.6%; with the limit at 10% (the Gaussian's) one still collapsed, at 11.0%.
#: Halved to 2.5%, six from-scratch runs averaged 59.2% against 5%'s 60.1% over nine: not better, so 5% stays
#: (docs/results.md, "A stricter move limit for the clip level, from scratch").
CLIP_MAX_MOVE = AUTO_MAX_MOVE / 2
CLIP_MOVE_STEPS = 8
CLIP_MEDIAN_STEPS = 8
#: ``"auto"`` also drops the retention level where its noise undoes the steps' progress: the batch loss the sent
#: noise adds to the SGD step (D, ``flguard.guard.damage``), exponentially averaged over CLIP_MOVE_STEPS steps this
#: one included, above CLIP_MAX_DAMAGE × the loss the clipped step itself removes (P, averaged alike). The move
#: says how far the noise takes the weights, not what that costs: on a trained ViT the retention level's resolvent
#: noise moved them 0.6–4.6% a step, within CLIP_MAX_MOVE, while adding 2–11× the steps' progress to the batch loss,
#: and five steps took held-out accuracy from 93.6% to 54%; on the trained quickstart CNN the same noise adds about
#: a tenth of the progress (docs/results.md, "The noise's damage, measured").
CLIP_MAX_DAMAGE = 1.0
#: At any level, a step whose noise would, on average over the recent steps (withheld steps not counted) or alone,
#: both undo the steps' progress (D > P) and add more than WITHHOLD_LOSS_SHARE of the batch loss before the step
#: (D > share·L) is withheld: the floor then needs more noise than the model can take, and sending it would undo
#: training rather than guard it. Measured on a trained MobileNetV3-small (GroupNorm, 55% on held-out photos): its
#: noise added 0.94–7.8 to a batch loss of about 1.3, and one such step took the model to 28.6%, the next to chance;
#: at a 20 dB floor one step sent at D = 0.43·L (the share was 0.5) doubled the batch loss, and four took it to 7.8%;
#: at an eighth of its median one draw with D = 0.97·L passed on averages of 0.14·L and the loss doubled. Where the
#: model trains under the guard the rule stays far off: on the trained CNN D̄/L̄ at most 0.08 and single steps 0.19;
#: on a trained ViT, where D̄ > P̄, D̄/L̄ at most 0.16 over 60 steps (docs/results.md, "The noise's damage, measured"
#: and "Damage that builds up slowly").
WITHHOLD_LOSS_SHARE = 0.25
#: Below the median. With the noise the floor needs proportional to C, the damage D ≈ ½η²δᵀHδ grows as C² and the
#: progress P as C, so D/P ∝ C: where the noise sent at the median damages the step, a lower C does less harm for the
#: progress it keeps. At the median, an averaged damage over CLIP_LOWER_DAMAGE × the averaged progress, or a step
#: withheld there (``ruinous``), halves C's factor of the median for the next steps, down to CLIP_LOWEST_FACTOR, for
#: the rest of the guard's life (the raised level is not tried again). A new factor starts its averages afresh and is
#: kept CLIP_FACTOR_HOLD steps before the averages may lower it again (a withheld step lowers it at once). Measured on
#: a trained ViT (lr 0.01, B = 32): at the median its Gaussian noise kept D̄ near P̄, the median C grew with the loss
#: (4 → 12) and the noise with it, and 60 steps ended at 77.6–79.6% (96.4% unguarded); at C = 1, a quarter of its
#: median, 95.0%; with this rule 94.6–95.0% (docs/results.md, "Damage that builds up slowly"). At the median or under
#: it a step whose noise undoes the steps' progress on the averages is withheld: a trained MobileNetV3-small sent five
#: such steps at a sixteenth of its median (D̄ = 3–5 P̄, under a quarter of the loss) and fell from 55% to 32%.
#: Doubling the factor back where the damage fell under an eighth of the progress was tried: a few lucky draws took
#: the ViT back to the raised level, whose noise took it from 92.6% to 88.6% in ten steps with D under P on each.
CLIP_LOWER_DAMAGE = 0.5
CLIP_LOWEST_FACTOR = 1 / 16
CLIP_FACTOR_HOLD = 4


def _undoes(progress: float, damage: float, ratio: float = 1.0) -> bool:
    """Whether the noise's damage exceeds ``ratio`` × the step's progress (none where the step makes none); a
    non-finite damage does."""
    return not damage <= ratio * max(progress, 0.0)


class AdaptiveClip:
    """``clip_per_sample="auto"`` across steps: which level a step starts from (``setting``), and whether the
    noise that level needed moves the parameters too far (``too_far``), from the sent noises' recent moves
    m = step size·‖noise‖/‖θ‖, or undoes the steps' progress (``harmful``, from their recent effect on the batch
    loss), and at the median whether a fraction of it does less harm (``adjust``, ``factor``). Without a step size
    there is nothing to judge either by: the median."""

    def __init__(self) -> None:
        self._square: float | None = None  # the sent noises' mean square move, exponentially averaged
        self._effect: tuple[float, ...] | None = None  # the steps' progress, their noise's damage, their loss: averaged
        self._median_steps = 0  # steps left that take the median directly (CLIP_MEDIAN_STEPS)
        self.factor = 1.0  # the median's multiplier where the median's noise does harm (CLIP_LOWER_DAMAGE)
        self._hold = 0  # steps the factor is kept before the averages may change it (CLIP_FACTOR_HOLD)

    def setting(self, move_scale: float | None) -> str:
        """``"retention"`` or ``"median"`` for this step (``move_scale``: step size ÷ ‖θ‖, or None)."""
        if move_scale is None:
            return "median"
        if self._median_steps > 0:
            self._median_steps -= 1
            return "median"
        return "median" if self.factor < 1 else "retention"

    def adjust(self, effect: tuple[float, float, float], withheld: bool = False) -> str:
        """After a step at the median level whose ``effect`` was measured, sent (and ``record``-ed) or ``withheld``
        (by ``ruinous``, not recorded): the factor of the median the next steps take (CLIP_LOWER_DAMAGE), on the
        recent averages. Returns why it changed ("" where it did not)."""
        if not withheld and self._hold > 0:
            self._hold -= 1
            return ""
        progress, damage, _ = self._averaged_effect(effect) if withheld or self._effect is None else self._effect
        if not withheld and not _undoes(progress, damage, CLIP_LOWER_DAMAGE):
            return ""
        factor = max(self.factor / 2, CLIP_LOWEST_FACTOR)
        if factor == self.factor:
            if withheld:  # withheld at the lowest level: the next step there is judged on its own
                self._effect = None
            return ""
        why = (f"C lowered to {factor:g}× the median: the noise adds {damage:.3g} to the batch loss against the "
               f"{progress:.3g} the steps remove (recent averages)")
        self.factor, self._hold, self._effect = factor, CLIP_FACTOR_HOLD, None  # a new level: its own averages
        return why

    def too_far(self, move: float) -> bool:
        """Whether a step sent with this ``move`` would lift the recent moves' root mean square over
        CLIP_MAX_MOVE (nothing is recorded: ``record`` the move actually sent)."""
        return self._averaged(move) ** 0.5 > CLIP_MAX_MOVE

    def harmful(self, effect: tuple[float, float, float]) -> bool:
        """Whether a step sent with this ``effect`` (its progress P, its noise's damage D and the batch loss L before
        it, ``flguard.guard.damage``) would lift the recent damage over CLIP_MAX_DAMAGE × the recent progress
        (averages as ``record`` keeps them; nothing is recorded). A non-finite damage is harmful."""
        progress, damage, _ = self._averaged_effect(effect)
        return _undoes(progress, damage, CLIP_MAX_DAMAGE)

    def ruinous(self, effect: tuple[float, float, float], at_median: bool = False) -> bool:
        """Whether a step sent with this ``effect`` would, on the recent averages or alone, both undo the steps'
        progress and add over WITHHOLD_LOSS_SHARE of the batch loss (the engine then withholds it): the averages
        would let one draw through that adds the whole batch loss. ``at_median``: the step is at the median or a
        fraction of it, where undoing the progress on the averages is enough (``adjust`` then lowers C, which lowers
        the damage for the progress kept). A non-finite damage is ruinous."""
        progress, damage, _ = averaged = self._averaged_effect(effect)
        return (at_median and _undoes(progress, damage)) or any(
            _undoes(progress, damage) and not damage <= WITHHOLD_LOSS_SHARE * loss
            for progress, damage, loss in (averaged, effect))

    def fall_back(self) -> None:
        """The retention level moved too far or did harm: the next CLIP_MEDIAN_STEPS steps take the median."""
        self._median_steps = CLIP_MEDIAN_STEPS

    def record(self, move: float | None, effect: tuple[float, float, float] | None = None) -> None:
        """The move of the noise sent this step, and its ``effect``, each where measured (zero noise, a withheld step:
        not recorded; no move without a step size)."""
        if move is not None:
            self._square = self._averaged(move)
        if effect is not None:
            self._effect = self._averaged_effect(effect)

    @property
    def recent_effect(self) -> tuple[float, ...] | None:
        """The recent steps' averaged progress, damage and batch loss (None before the first)."""
        return self._effect

    def _averaged_effect(self, effect: tuple[float, ...]) -> tuple[float, ...]:
        if self._effect is None:
            return effect
        return tuple(old + (new - old) / CLIP_MOVE_STEPS for old, new in zip(self._effect, effect))  # type: ignore

    @property
    def recent_move(self) -> float | None:
        """The recent moves' root mean square (None before the first)."""
        return None if self._square is None else self._square ** 0.5

    def _averaged(self, move: float) -> float:
        return averaged_square(self._square, move, CLIP_MOVE_STEPS)
