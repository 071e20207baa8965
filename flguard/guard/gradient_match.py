"""Whether a step's ``.grad`` is the gradient of the loss the guard measures — and, where it is not, the likely cause.

``make_guarded``'s step recomputes ∇θ criterion(model(x), y) for the recorded passes and requires ``.grad`` to be one
of those sums (``flguard.guard.training``): the guard must measure the very loss that was sent. A ``.grad`` that none
explains is refused with a ``GuardMisuse`` naming what the loop did: passes that do not add up, a gradient rescaled
after backward (a global norm clipping, a GradScaler's scale left in), or a loss with terms the guard cannot see.
"""

from __future__ import annotations

import torch

from flguard.guard.recorder import GuardMisuse
from flguard.risk.precision import AutocastState, gradient_rtol

#: ‖.grad − ∇θ criterion(model(x), y)‖ ≤ this × ‖∇θ …‖ (+ a tiny absolute slack) counts as "the same
#: loss": the recomputation runs the same operations on the same data, so only float reordering differs
#: (for a float32 gradient on a CUDA device, TF32 and cuDNN's choice of algorithm: ``gradient_rtol``).
GRADIENT_MATCH_RTOL = 1e-4
#: .grad = s × ∇θ … to this relative residual, s ≠ 1 by more than it: a gradient rescaled after ``backward`` (a
#: global norm clipping, or a GradScaler's scale left in), which the refusal then names.
RESCALED_RTOL = 1e-3


def same_gradient(sent: torch.Tensor, reference: torch.Tensor, autocast: AutocastState) -> bool:
    """Whether .grad (``sent``) is ``reference`` to what recomputing it allows (``GRADIENT_MATCH_RTOL``)."""
    gap, scale = float((sent - reference).norm()), float(reference.norm())
    slack = 1e-12 * max(reference.numel(), 1) ** 0.5
    return gap <= gradient_rtol(reference, GRADIENT_MATCH_RTOL, autocast) * scale + slack


def refuse_gradient(sent: torch.Tensor, reference: torch.Tensor, autocast: AutocastState, passes: int,
                    calls: int = 1) -> None:
    """``GuardMisuse`` for a .grad (``sent``) that no run of recorded passes explains, naming the likely cause against
    the last pass's gradient ``reference``: more criterion ``calls`` than ``passes`` (a loss made of several, as
    mixup's), passes that do not add up, a gradient rescaled after backward, or another loss."""
    gap, scale = float((sent - reference).norm()), float(reference.norm())
    found = f"‖difference‖ = {gap:.3g}, ‖gradient‖ = {scale:.3g}"
    if calls > passes:
        raise GuardMisuse(f"the guarded criterion was called {calls} times for {passes} forward pass(es) since the "
                          f"last optimizer.step(), and .grad is not the gradient of one call per pass ({found}): the "
                          "guard measures one criterion call per pass — a loss made of several on one output "
                          "(mixup, CutMix: lam·criterion(out, y) + (1 − lam)·criterion(out, y[perm])) is the same "
                          "loss as one call with the mixed targets as class probabilities: criterion(out, "
                          "lam·one_hot(y) + (1 − lam)·one_hot(y[perm])) (torch.nn.functional.one_hot(y, "
                          "classes).float())")
    if passes > 1:
        raise GuardMisuse(f"{passes} forward passes of the guarded model since the last optimizer.step(), and .grad is "
                          f"neither the last one's gradient ({found}) nor the sum of the latest ones': an extra "
                          "forward pass with gradients on between accumulated batches, or a loss the guard cannot "
                          "see — evaluate under torch.no_grad()")
    factor = float(sent @ reference) / max(scale ** 2, 1e-300)
    off_line = float((sent - factor * reference).norm())
    if abs(factor - 1.0) > RESCALED_RTOL and off_line <= RESCALED_RTOL * abs(factor) * scale:
        cause = ("a global norm clipping (torch.nn.utils.clip_grad_norm_): the guard clips each sample's gradient "
                 "itself (GuardConfig.clip_per_sample) — remove it from the guarded loop" if factor < 1 else
                 "a GradScaler's scale still in it: call scaler.update() after every scaler.step(optimizer), also "
                 "when the step raised GuardFailure")
        raise GuardMisuse(f".grad is {factor:.4g} × the gradient of criterion(model(x), y) on the recorded batch: "
                          f"{cause}")
    raise GuardMisuse(f".grad differs from the gradient of criterion(model(x), y) on the recorded batch ({found}): a "
                      "loss with terms the guard cannot see, gradients accumulated over several batches (a missing "
                      "optimizer.zero_grad()), a gradient changed after backward (clip_grad_value_), or randomness "
                      "in the forward pass that flguard.check_model cannot list (a functional dropout); the guard "
                      "must measure the exact loss that is sent. (A channels-last model on a CPU: PyTorch's oneDNN "
                      "gradient of a strided 1×1 convolution is wrong on some CPUs and differs from call to call — "
                      "train in contiguous memory, or set torch.backends.mkldnn.enabled = False.)")


__all__ = ["GRADIENT_MATCH_RTOL", "RESCALED_RTOL", "same_gradient", "refuse_gradient"]
