"""GELU and SiLU in the batched K product, their second derivatives in closed form and kept from pass 1.

Passes 2 and 3 of ``flguard.risk.ghost_products`` differentiate pass 1's recorded input gradient once more. Through
PyTorch's kernels an activation's recorded backward is ``gelu_backward`` / ``silu_backward``, whose derivative
(``GeluBackwardBackward0``) evaluates the error function and the exponential again at every pass: about a fifth of a
small ViT's K product on a CPU. Here pass 1 takes σ''(x) once, from

    GELU:   σ'' = φ(x)·(2 − x²)                          (φ the standard normal density),
    GELU, tanh approximation:  y = ½x(1 + t), t = tanh(u), u = k(x + 0.044715x³), k = √(2/π):
            σ'' = (1 − t²)·u' + ½x·(1 − t²)·(u'' − 2t·u'²),  u' = k(1 + 3·0.044715x²),  u'' = 6k·0.044715x,
    SiLU:   σ'' = s(1 − s)·(2 + x(1 − 2s)),  s = sigmoid(x),

and the backward ḡ·σ'(x) is differentiated as c·σ'(x) in ḡ (PyTorch's own backward kernel) and c·ḡ·σ''(x) in x.
Where a graph of that derivative is asked for (a third derivative: never on the guard's passes) σ'' is taken again
from x in differentiable operations and ḡ's term through this same function, so every order stays exact. An in-place
SiLU (``inplace=True``) is left to PyTorch. Checked against PyTorch's kernels (three orders) and finite differences in
``tests/test_ghost_activations.py``; measured on torchvision's ViT (docs/results.md, "GroupNorm's and GELU's second
derivatives in closed form").
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch
import torch.nn.functional as F

_DENSITY = 1.0 / math.sqrt(2.0 * math.pi)
_TANH_SCALE = math.sqrt(2.0 / math.pi)
_CUBIC = 0.044715


def _gelu_second(x: torch.Tensor) -> torch.Tensor:
    return torch.exp(-0.5 * x * x) * _DENSITY * (2.0 - x * x)


def _gelu_tanh_second(x: torch.Tensor) -> torch.Tensor:
    du = _TANH_SCALE * (1.0 + 3.0 * _CUBIC * x * x)
    t = torch.tanh(_TANH_SCALE * (x + _CUBIC * x * x * x))
    sech2 = 1.0 - t * t
    return sech2 * du + 0.5 * x * sech2 * (6.0 * _TANH_SCALE * _CUBIC * x - 2.0 * t * du * du)


def _silu_second(x: torch.Tensor) -> torch.Tensor:
    s = torch.sigmoid(x)
    return s * (1.0 - s) * (2.0 + x * (1.0 - 2.0 * s))


#: kind: (σ, ∂σ·ḡ by PyTorch's backward kernel, σ'')
_KINDS: dict[str, tuple[Callable, Callable, Callable]] = {
    "gelu": (F.gelu, lambda g, x: torch.ops.aten.gelu_backward(g, x), _gelu_second),
    "gelu_tanh": (lambda x: F.gelu(x, approximate="tanh"),
                  lambda g, x: torch.ops.aten.gelu_backward(g, x, approximate="tanh"), _gelu_tanh_second),
    "silu": (F.silu, lambda g, x: torch.ops.aten.silu_backward(g, x), _silu_second),
}


def closed_form_activation(func: Callable, args: tuple, kwargs: dict) -> torch.Tensor | None:
    """``func(*args, **kwargs)`` through this module where it is ``F.gelu`` or an out-of-place ``F.silu``, else
    None (the caller runs it as it is)."""
    if func is F.gelu:
        approximate = args[1] if len(args) > 1 else kwargs.get("approximate", "none")
        return Activation.apply(args[0], "gelu" if approximate == "none" else "gelu_tanh")
    if func is F.silu and not (args[1] if len(args) > 1 else kwargs.get("inplace", False)):
        return Activation.apply(args[0], "silu")
    return None


class Activation(torch.autograd.Function):
    """y = σ(x) by PyTorch's kernel; its backward, where a graph of it is recorded (pass 1), ``ActivationBackward``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, kind: str) -> torch.Tensor:
        ctx.save_for_backward(x)
        ctx.kind = kind
        return _KINDS[kind][0](x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        (x,) = ctx.saved_tensors
        if torch.is_grad_enabled():
            return ActivationBackward.apply(grad, x, ctx.kind), None
        return _KINDS[ctx.kind][1](grad, x), None


class ActivationBackward(torch.autograd.Function):
    """x̄ = ḡ·σ'(x), with σ''(x) taken once for the passes that differentiate it (module doc)."""

    @staticmethod
    def forward(ctx: Any, grad: torch.Tensor, x: torch.Tensor, kind: str) -> torch.Tensor:
        ctx.save_for_backward(grad, x, _KINDS[kind][2](x))
        ctx.kind = kind
        return _KINDS[kind][1](grad, x)

    @staticmethod
    def backward(ctx: Any, c: torch.Tensor) -> tuple:
        grad, x, second = ctx.saved_tensors
        if torch.is_grad_enabled():  # a graph of this derivative asked for: σ'' again as a function of x
            d_grad = ActivationBackward.apply(c, x, ctx.kind) if ctx.needs_input_grad[0] else None
            d_x = c * grad * _KINDS[ctx.kind][2](x) if ctx.needs_input_grad[1] else None
            return d_grad, d_x, None
        d_grad = _KINDS[ctx.kind][1](c, x) if ctx.needs_input_grad[0] else None
        d_x = (c * grad).mul_(second) if ctx.needs_input_grad[1] else None
        return d_grad, d_x, None
