"""What every attack shares: the ``Reconstruction`` result, the method registry, gradient plumbing.

Attack modules register a function ``fn(model, target_gradients, input_shape, *, labels, loss_fn,
batch_size, iterations, restarts, device, generator, **hyperparameters) -> Reconstruction`` under
a method name with ``@register("name")``; ``flguard.attacks.reconstruct`` dispatches to it.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
from torch import nn

# Modules that hold registered attacks; imported on first use of the registry.
METHOD_MODULES = ("flguard.attacks.dlg", "flguard.attacks.gs", "flguard.attacks.rgap", "flguard.attacks.hybrid",
                  "flguard.attacks.adaptive", "flguard.attacks.strongest")


@dataclass
class Reconstruction:
    """An attack's output. ``images`` are in the model's input space, [batch_size, *input_shape]."""

    images: torch.Tensor
    labels: torch.Tensor
    loss: float
    history: list[float] = field(default_factory=list)
    seconds: float = 0.0
    method: str = ""
    extra: dict = field(default_factory=dict)


AttackFn = Callable[..., Reconstruction]
_METHODS: dict[str, AttackFn] = {}


def register(name: str) -> Callable[[AttackFn], AttackFn]:
    """Decorator: make ``fn`` available as ``reconstruct(..., method=name)``."""

    def decorate(fn: AttackFn) -> AttackFn:
        _METHODS[name] = fn
        return fn

    return decorate


def methods() -> dict[str, AttackFn]:
    """All registered attacks, importing the attack modules that exist."""
    for module in METHOD_MODULES:
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as error:
            if error.name != module:
                raise
    return dict(_METHODS)


def trainable_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters a client's gradient covers, in ``model.parameters()`` order."""
    return [p for p in model.parameters() if p.requires_grad]


def split_gradient(model: nn.Module, gradient: torch.Tensor | Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """A flat [d_theta] gradient (or a list of per-parameter tensors) as per-parameter tensors."""
    params = trainable_parameters(model)
    if isinstance(gradient, torch.Tensor):
        total = sum(p.numel() for p in params)
        if gradient.ndim != 1 or gradient.numel() != total:
            raise ValueError(f"gradient has shape {tuple(gradient.shape)}; expected a flat tensor of {total} "
                             "entries (the model's trainable parameters in model.parameters() order)")
        return [chunk.view_as(p) for chunk, p in zip(gradient.split([p.numel() for p in params]), params)]
    parts = list(gradient)
    if len(parts) != len(params) or any(g.shape != p.shape for g, p in zip(parts, params)):
        raise ValueError("gradient list does not match the model's trainable parameters in shape and order")
    return parts
