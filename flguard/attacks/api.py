"""``reconstruct``: the one entry point to every gradient-inversion attack.

It normalises what callers pass (flat or per-layer gradient, device, seed, labels) and dispatches
to the attack registered under ``method`` (``flguard.attacks.base.register``), so attacks written
elsewhere (R-GAP, hybrid) plug in by registering themselves.
"""

from __future__ import annotations

import copy
import inspect
from typing import Any, Sequence

import torch
from torch import nn

from flguard.attacks.base import Reconstruction, methods, split_gradient, trainable_parameters
from flguard.attacks.labels import recover_labels
from flguard.attacks.objectives import LossFn

# Arguments every registered attack receives from ``reconstruct`` (not hyperparameters).
_COMMON = ("labels", "loss_fn", "batch_size", "iterations", "restarts", "device", "generator")


def hyperparameters_of(method: str) -> dict[str, Any]:
    """The hyperparameters ``method`` accepts, with their defaults."""
    fn = _lookup(method)
    params = inspect.signature(fn).parameters.values()
    return {p.name: p.default for p in params
            if p.kind == p.KEYWORD_ONLY and p.name not in _COMMON}


def _lookup(method: str):
    registry = methods()
    if method not in registry:
        raise ValueError(f"method={method!r} is not a registered attack; choose one of {', '.join(sorted(registry))}")
    return registry[method]


def _check_hyperparameters(method: str, fn, given: dict[str, Any]) -> None:
    params = inspect.signature(fn).parameters
    if any(p.kind == p.VAR_KEYWORD for p in params.values()):
        return
    known = hyperparameters_of(method)
    unknown = sorted(set(given) - set(known))
    if unknown:
        raise ValueError(f"method {method!r} has no hyperparameter {', '.join(map(repr, unknown))}; "
                         f"it accepts: {', '.join(sorted(known)) or 'none'}")


def _positive_int(name: str, value: Any, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive integer")


def reconstruct(model: nn.Module, gradient: torch.Tensor | Sequence[torch.Tensor], input_shape: Sequence[int], *,
                method: str = "gs", labels: torch.Tensor | Sequence[int] | None = None,
                loss_fn: LossFn | None = None, batch_size: int = 1, iterations: int | None = None,
                restarts: int = 1, device: torch.device | str | None = None, seed: int | None = None,
                **hyperparameters: Any) -> Reconstruction:
    """Invert an uploaded gradient (or K-step update) into ``batch_size`` inputs.

    ``gradient``: flat [dθ] in ``model.parameters()`` order (trainable parameters only) or a list
    of per-parameter tensors. ``labels=None``: recovered from the last layer (iDLG for one
    sample, the bias-corrected count method for a batch); DLG can instead optimise them jointly
    with ``joint_labels=True``. ``iterations=None`` uses the method's published preset;
    ``restarts`` candidates are optimised together as one batch and the best by matching loss
    wins. ``device`` defaults to the model's; ``seed`` makes the random start reproducible.
    ``hyperparameters`` go to the method (``hyperparameters_of(method)`` lists them); an unknown
    one is a ``ValueError``. The returned images are in the model's input space,
    [batch_size, *input_shape], on ``device``.
    """
    fn = _lookup(method)
    _check_hyperparameters(method, fn, hyperparameters)
    _positive_int("batch_size", batch_size)
    _positive_int("restarts", restarts)
    _positive_int("iterations", iterations, allow_none=True)
    input_shape = tuple(int(s) for s in input_shape)
    if not input_shape or any(s < 1 for s in input_shape):
        raise ValueError(f"input_shape={input_shape} must be a non-empty tuple of positive sizes")

    params = trainable_parameters(model)
    if not params:
        raise ValueError("the model has no trainable parameters: there is no gradient to invert")
    device = torch.device(device) if device is not None else params[0].device
    if params[0].device != device:
        model = copy.deepcopy(model).to(device)
        params = trainable_parameters(model)
    dtype = params[0].dtype
    target = [g.detach().to(device=device, dtype=dtype) for g in split_gradient(model, gradient)]

    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(int(seed))

    joint = bool(hyperparameters.get("joint_labels", False))
    recovered = labels is None and not joint
    if labels is not None:
        labels = torch.as_tensor(labels, device=device).reshape(-1).long()
        if labels.numel() != batch_size:
            raise ValueError(f"labels has {labels.numel()} entries; batch_size={batch_size}")
    elif not joint:
        # A K-step update is −lr·Σ(gradients): its negation carries the gradient's signs.
        signs = [-t for t in target] if hyperparameters.get("local_steps", 1) > 1 else target
        labels = recover_labels(model, signs, batch_size, input_shape, generator=generator)

    result = fn(model, target, input_shape, labels=labels, loss_fn=loss_fn, batch_size=batch_size,
                iterations=iterations, restarts=restarts, device=device, generator=generator, **hyperparameters)
    result.method = result.method or method
    result.extra.setdefault("labels_recovered", recovered)
    return result
