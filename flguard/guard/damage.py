"""What the noise sent does to the step that applies it: the batch loss it adds, beside the loss the step removes.

For the step s(·) that applies the update u (the clipped gradient, without left-out samples) and the noise δ, on
the step's own batch:

    progress P = L_B(θ) − L_B(θ + s(u)),        damage D = L_B(θ + s(u + δ)) − L_B(θ + s(u)),

with s(g) = −ηg for an SGD step of size η, or the change the user's optimizer would make with g from its present
state (``flguard.guard.trial_step``: Adam's step, normalised per coordinate, is not a multiple of g). Two forward
passes, no product (L_B(θ), the batch loss before the step, from the operator's first pass). ``clip_per_sample="auto"``
(``flguard.guard.clipping.AdaptiveClip``) keeps its raised clip level only while the noise sent there does not undo,
on average over the recent steps, the progress the steps make, and withholds a step whose noise would, on those
averages, both undo it and add over a quarter of the batch loss: the noise's move m = η‖δ‖/‖θ‖ says how far it takes the
weights, not what that costs the model. Aimed noise lies in the span of the samples' Jacobian rows, the directions
along which the loss is most sensitive to the inputs: measured on a trained ViT, resolvent noise at the raised level
moving the weights by 0.6–4.6% a step (within the move limit) added 2–11× the steps' progress to the loss and took
held-out accuracy from 93.6% to 54% in five steps; on a trained MobileNetV3-small the noise the floor needs added
0.94–7.8 to a batch loss of about 1.3 and two steps took it to chance; on the trained quickstart CNN the same noise
adds about a tenth of the progress (docs/results.md, "The noise's damage, measured"). The measure decides which
certified noise is sent at which clip level, or that none is; the certificate is the same for any noise sent.
"""

from __future__ import annotations

from typing import Callable

import torch

from flguard.risk.clipped import Jacobian, base_operator

#: (update [dθ], noise [dθ]) → (P, D, L_B(θ)) (module doc); +inf damage where a loss is not finite
StepEffect = Callable[[torch.Tensor, torch.Tensor], tuple[float, float, float]]
#: a flat gradient [dθ] → the change [dθ] the optimizer's next step would make to the parameters with it, s(g)
#: (module doc), its state untouched
Displacement = Callable[[torch.Tensor], torch.Tensor]


def _finite(loss: float) -> float:
    """``loss``, or +inf where it is not finite (NaN too): a loss the step cannot be judged by."""
    return loss if abs(loss) < float("inf") else float("inf")


def step_effect(op: Jacobian, step: float | Displacement) -> StepEffect:
    """(P, D, L_B(θ)) on ``op``'s whole batch and parameters for the steps ``step``: an SGD step size η, s(g) = −ηg,
    or the ``Displacement`` s (module doc). L_B(θ) is taken once: a step redone at another clip level has the same θ
    and batch."""
    base = base_operator(op)
    values = [base.params[name] for name in base.names]
    sizes = [value.numel() for value in values]
    taken: list[float] = []  # L_B(θ), once
    displacement = step if callable(step) else (lambda flat: -step * flat)  # (−(ηg): θ + s(g) is θ − ηg exactly)

    def loss_at(flat: torch.Tensor | None) -> float:
        moved = values if flat is None else [value + piece.view_as(value).to(value) for value, piece
                                             in zip(values, displacement(flat).to(flat.device).split(sizes))]
        with torch.no_grad():
            return _finite(float(base.batch_loss_fn(base._forward(dict(zip(base.names, moved)), base.x), base.y)))

    def effect(update: torch.Tensor, noise: torch.Tensor) -> tuple[float, float, float]:
        if not taken:  # the operator's first pass took it, unless the operator is a restricted copy
            known = getattr(base, "batch_loss", None)
            taken.append(loss_at(None) if known is None else _finite(known))
        before, stepped = taken[0], loss_at(update)
        damage = loss_at(update + noise) - stepped
        return before - stepped, damage if damage == damage else float("inf"), before

    return effect
