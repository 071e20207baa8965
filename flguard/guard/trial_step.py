"""The change a user's optimizer would make to the parameters with a given gradient, without making it.

``clip_per_sample="auto"`` judges what the noise it sends does to the step that applies it (``flguard.guard.damage``).
For plain SGD that step is −η·g; for Adam (and RMSprop, Adagrad, …) it is not a multiple of g: Adam divides each
coordinate by the root of its running second moment, so the noise's share of the step depends on the optimizer's
state. ``trial_displacement`` measures the step itself: it deep-copies the optimizer once per guarded step, with
copies of the parameters in place of the model's, and steps a fresh copy of that for each gradient asked about —
whatever the optimizer, its hyperparameters (the learning rate a scheduler set) and its state as they stand, the
user's optimizer and model untouched.

What is judged is this step's gradient's own share of the step, over the life of the optimizer's momentum: the trial
step with g less the trial step with a zero gradient (the momentum of earlier steps, their noise included, is not
this step's progress), times the root mean square of the momentum's later response to it relative to its first
(``lifetime_gain``) — as ``make_guarded`` judges momentum SGD at lr × ``momentum_gain``. On a trained
MobileNetV3-small with Adam the whole trial step showed P < 0 from the fourth guarded step on (the earlier steps'
noise in Adam's first moment), and at β1 = 0.9 a gradient enters its own step with a tenth of the weight it has over
the first moment's life (docs/results.md, "Adam's own step, measured on a copy").
"""

from __future__ import annotations

import copy

import torch

from flguard.guard.damage import Displacement

__all__ = ["adam_gain", "lifetime_gain", "momentum_gain", "trial_displacement"]


def momentum_gain(momentum: float, dampening: float = 0.0, nesterov: bool = False) -> float:
    """The stationary root mean square of ``torch.optim.SGD``'s step (÷ lr) when its gradients are
    independent noise of unit root mean square: with v ← μv + (1 − d)·g the step is v, RMS
    (1 − d)/√(1 − μ²) (2.3× at μ = 0.9); with Nesterov (d = 0) it is g + μv = (1 + μ)g + μ²v₋, RMS
    √((1 + μ)² + μ⁴/(1 − μ²)) (2.7× at μ = 0.9). 1 without momentum. ``tests/test_make_guarded.py`` checks
    both against torch's optimizer."""
    if momentum == 0.0:
        return 1.0
    if nesterov:
        return ((1.0 + momentum) ** 2 + momentum ** 4 / (1.0 - momentum ** 2)) ** 0.5
    return (1.0 - dampening) / (1.0 - momentum ** 2) ** 0.5


def adam_gain(beta1: float, step: int, terms: int = 10_000) -> float:
    """For the Adam family's bias-corrected first moment m̂ = m/(1 − β1ᵗ), m ← β1·m + (1 − β1)·g: the root mean square
    of a gradient's shares of the steps from ``step`` (t) on, ÷ its share in step t. Its share k steps later is
    (1 − β1)·β1ᵏ/(1 − β1^(t+k)): at t = 1 it is the whole step (1, then 0.47, 0.30, … at β1 = 0.9), so the gain is
    about 1.2; once the bias correction has faded, 1/√(1 − β1²) (2.29 at β1 = 0.9), the gain of SGD's momentum."""
    if beta1 <= 0.0:
        return 1.0
    shares, share, k = 0.0, 1.0, 0
    first = (1.0 - beta1) / (1.0 - beta1 ** step)
    while k < terms and share > 1e-12:
        share = (1.0 - beta1) * beta1 ** k / (1.0 - beta1 ** (step + k)) / first
        shares += share * share
        k += 1
    return shares ** 0.5


def lifetime_gain(optimizer: torch.optim.Optimizer) -> float:
    """The largest over ``optimizer``'s groups of the root mean square of a gradient's later shares of the steps ÷ its
    share in the next one (module doc): ``adam_gain`` where the group has Adam's ``betas`` (at the next step's count),
    SGD's or RMSprop's ``momentum`` μ its stationary ``momentum_gain`` ÷ the first step's share (1 − d, or 1 + μ with
    Nesterov); 1 for optimizers without momentum (Adagrad)."""
    gains = [1.0]
    for group in optimizer.param_groups:
        if "betas" in group:
            counts = [optimizer.state.get(param, {}).get("step", 0) for param in group["params"]]
            gains.append(adam_gain(float(group["betas"][0]), int(max(float(count) for count in counts)) + 1))
        elif float(group.get("momentum", 0.0) or 0.0) > 0.0:
            momentum, nesterov = float(group["momentum"]), bool(group.get("nesterov", False))
            first = 1.0 + momentum if nesterov else 1.0 - float(group.get("dampening", 0.0))
            if 0.0 < first and momentum < 1.0:
                gains.append(momentum_gain(momentum, float(group.get("dampening", 0.0)), nesterov) / first)
    return max(gains)


def trial_displacement(optimizer: torch.optim.Optimizer, params: list[torch.Tensor]) -> Displacement | None:
    """s(g) for ``optimizer``'s next step (module doc): a flat gradient over ``params`` (the model's trainable
    parameters in order; those the optimizer does not hold do not move) → ``lifetime_gain`` × (the flat change its
    ``step()`` would make with g − the change it would make with a zero gradient). None where the optimizer cannot be
    deep-copied (then nothing is judged by its step)."""
    with torch.no_grad():
        start = [param.detach().clone() for param in params]
    try:  # the optimizer's params (and its state's keys) become the copies
        template = copy.deepcopy(optimizer, {id(param): copied for param, copied in zip(params, start)})
    except Exception:  # (an optimizer holding something that cannot be copied)
        return None
    sizes = [param.numel() for param in params]

    def stepped(flat: torch.Tensor) -> torch.Tensor:  # the change step() makes with the gradient ``flat``
        with torch.no_grad():
            moved = [value.clone() for value in start]
        trial = copy.deepcopy(template, {id(value): copied for value, copied in zip(start, moved)})
        for value, piece in zip(moved, flat.split(sizes)):
            value.grad = piece.detach().view_as(value).to(value).clone()
        trial.step()
        with torch.no_grad():
            return torch.cat([(after - before).reshape(-1) for after, before in zip(moved, start)])

    gain = lifetime_gain(optimizer)
    momentum: list[torch.Tensor] = []  # the step with a zero gradient, taken once

    def displacement(flat: torch.Tensor) -> torch.Tensor:
        if not momentum:
            momentum.append(stepped(torch.zeros_like(flat)))
        return gain * (stepped(flat) - momentum[0].to(flat.device))

    return displacement
