"""Which parameters a guarded step measures: the model's trainable parameters that the optimizer holds.

What the optimizer's step applies is what the server receives, so that is what the guard clips, perturbs and
certifies — the certificate is about the update sent, not about a gradient of which only a part is applied.
Fine-tuning puts the two apart in two ways a practitioner meets at once:

* a backbone **frozen** (``requires_grad_(False)``) while the optimizer was built over ``model.parameters()``: torch's
  optimizers skip a parameter without ``.grad``, so it is accepted; a stale ``.grad`` left on it (from before it was
  frozen) is cleared at every step, never applied;
* an optimizer over the **head only** while the backbone stays trainable: the guard measures the head's parameters
  alone (the backbone's products are not part of the update), and every step clears the backbone's gradients, which
  nothing guards, so that no other optimizer applies them; ``make_guarded`` warns, naming them.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Iterator

import torch
from torch import nn


def held_parameters(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[list[nn.Parameter],
                                                                                  list[nn.Parameter]]:
    """(measured, idle): the model's trainable parameters (``requires_grad``, in ``model.parameters()`` order) that
    the optimizer holds — what its step applies, so what the guard measures, clips, perturbs and certifies — and
    those it does not hold (a head-only optimizer over a backbone left trainable), whose gradients nothing guards.
    Frozen parameters in the optimizer are neither: torch's optimizers skip a parameter without ``.grad``."""
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    trainable = [p for p in model.parameters() if p.requires_grad]
    return [p for p in trainable if id(p) in held], [p for p in trainable if id(p) not in held]


@contextlib.contextmanager
def measuring_only(idle: list[nn.Parameter]) -> Iterator[None]:
    """Within the block the ``idle`` parameters are frozen (the guard measures the trainable ones), restored after."""
    for p in idle:
        p.requires_grad_(False)
    try:
        yield
    finally:
        for p in idle:
            p.requires_grad_(True)


def require_own(model: nn.Module, params: list[torch.Tensor], caller: str) -> None:
    """A ValueError where ``params`` holds a tensor that is not one of the model's parameters."""
    own = {id(p) for p in model.parameters()}
    if any(id(p) not in own for p in params):
        raise ValueError(f"{caller}: the optimizer holds a parameter that is not one of the model's; the guard can "
                         "only cover the model's own gradients")


def check_held(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """``make_guarded``'s check of what the optimizer holds: only the model's parameters (a ValueError otherwise);
    a warning naming the trainable ones it does not hold, whose gradients the step clears unsent."""
    require_own(model, [p for group in optimizer.param_groups for p in group["params"]], "make_guarded")
    measured, idle = held_parameters(model, optimizer)
    if not measured:
        raise ValueError("make_guarded: the optimizer holds none of the model's trainable parameters "
                         "(requires_grad=True): there is no update to guard")
    if idle:
        idle_ids = {id(p) for p in idle}
        names = [name for name, p in model.named_parameters() if id(p) in idle_ids]
        warnings.warn(f"make_guarded: {len(idle)} trainable parameters of the model are not in the optimizer "
                      f"({', '.join(names[:3])}{', …' if len(names) > 3 else ''}): the guard measures and sends only "
                      "the optimizer's, and each step clears the others' gradients; freeze them "
                      "(requires_grad_(False)) to skip their backward pass", UserWarning, stacklevel=3)


def clear_unmeasured(optimizer: torch.optim.Optimizer, measured: list[nn.Parameter], idle: list[nn.Parameter]) -> None:
    """Drop every gradient a guarded step does not send: those of the optimizer's parameters it does not measure
    (frozen ones) and those of the ``idle`` trainable parameters the optimizer does not hold."""
    sent = {id(p) for p in measured}
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in sent:
                p.grad = None
    for p in idle:
        p.grad = None


__all__ = ["held_parameters", "measuring_only", "check_held", "clear_unmeasured", "require_own"]
