"""The model's forward pass as the guard and the attacks differentiate it: a function of the parameters.

``functional_forward`` is ``torch.func.functional_call`` with one difference: attention
(``F.scaled_dot_product_attention``, which ``nn.MultiheadAttention`` and torchvision's ViT call) runs on PyTorch's
composite "math" kernel. The fused kernels PyTorch picks by default (flash attention on a CPU; flash and
memory-efficient ones on a GPU) have a first derivative only: no derivative of their backward, no forward-mode
rule, no ``vmap`` batching — and every product of the guard (J_iᵀu is a derivative of the input gradient; K
products, ``jvp``, per-sample ``vmap``) and every gradient-matching attack differentiates twice. On them a
transformer's every step failed, and was withheld ("derivative for aten::_scaled_dot_product_flash_attention_for_cpu
_backward is not implemented"). The math kernel computes the same attention (softmax(QKᵀ/√d)V, as the fused
kernels do, to float rounding) from ordinary operators that autograd, forward mode and ``vmap`` all know; the
user's own training keeps its kernel. The guard's check that its recomputed gradient is the one in ``.grad``
(``flguard.guard.training``) compares the two to float32 rounding.

The same function mode (``_TwiceDifferentiable``) writes three more layers in plain operators, each the same
function: ``F.hardsigmoid`` (MobileNetV3's squeeze-and-excitation gate) as ``relu6(x + 3) / 6``, its kernel having no
derivative of its backward either; and ``F.layer_norm`` (ViTs, ConvNeXts) and ``F.instance_norm`` without running
statistics as (x − mean)/√(var + ε)·w + b, because PyTorch's kernels give *wrong* numbers where the products compose
their derivatives: the tangent that forward mode carries through them (J_iv on the direct path) has a wrong derivative
in the input, and their derivatives under ``vmap`` (the cached path) are off too — measured on small float64 nets
against dense Jacobians from plain double backward (which is right): K products off by 2–33% on the direct path and
0.1–0.3% on the cached one (PyTorch 2.14; ``tests/test_guard_layers.py``). A certificate computed on such numbers
would not be one. GroupNorm's kernel is right in every composition and keeps its speed. Global average pooling
(``F.adaptive_avg_pool2d`` to 1×1) runs as a mean over the spatial dimensions: the same numbers, while the kernel's
double backward on a channels-last gradient (a ConvNeXt's, after its permuted LayerNorm) goes through an
``as_strided_`` that ``vmap`` has no batching rule for — a per-sample loop and a warning (a ConvNeXt's cached K
product 47 → 43 ms; a ResNet's products 1.5–2.5% faster, bit-identical). The mode sees every torch
function of the forward pass (a few microseconds each, within the noise of a ResNet-18's products); every other
activation, pooling, normalisation, padding and resampling layer of PyTorch's that an image model uses runs as it
is, checked in the same test.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.overrides import TorchFunctionMode


def _normalised(x: torch.Tensor, dims: tuple[int, ...], eps: float) -> torch.Tensor:
    """(x − mean) / √(var + eps) over ``dims`` (the biased variance, as PyTorch's normalisations), in plain operators."""
    centred = x - x.mean(dims, keepdim=True)
    return centred * torch.rsqrt(centred.pow(2).mean(dims, keepdim=True) + eps)


def _layer_norm(input: torch.Tensor, normalized_shape: Any, weight: torch.Tensor | None = None,
                bias: torch.Tensor | None = None, eps: float = 1e-5, *_: Any) -> torch.Tensor:
    out = _normalised(input, tuple(range(input.dim() - len(tuple(normalized_shape)), input.dim())), eps)
    out = out * weight if weight is not None else out
    return out + bias if bias is not None else out


def _instance_norm(input: torch.Tensor, running_mean: torch.Tensor | None = None,
                   running_var: torch.Tensor | None = None, weight: torch.Tensor | None = None,
                   bias: torch.Tensor | None = None, use_input_stats: bool = True, momentum: float = 0.1,
                   eps: float = 1e-5) -> torch.Tensor | None:
    if not use_input_stats or running_mean is not None:  # running statistics: the model check refuses those
        return None
    out = _normalised(input, tuple(range(2, input.dim())), eps)
    shape = (1, -1) + (1,) * (input.dim() - 2)
    out = out * weight.view(shape) if weight is not None else out
    return out + bias.view(shape) if bias is not None else out


class _TwiceDifferentiable(TorchFunctionMode):
    """``F.hardsigmoid``, ``F.layer_norm``, ``F.instance_norm`` and global average pooling in plain operators (module
    doc); every other function as it is."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is F.hardsigmoid:
            given = {**dict(zip(("input", "inplace"), args)), **kwargs}
            value = F.relu6(given["input"] + 3) / 6
            return given["input"].copy_(value) if given.get("inplace", False) else value
        if func is F.layer_norm or func is torch.layer_norm:
            return _layer_norm(*args, **kwargs)
        if func is F.instance_norm:
            value = _instance_norm(*args, **kwargs)
            if value is not None:
                return value
        if func is F.adaptive_avg_pool2d:
            given = {**dict(zip(("input", "output_size"), args)), **kwargs}
            if given["output_size"] in (1, (1, 1), [1, 1]):  # global average pooling
                return given["input"].mean((-2, -1), keepdim=True)
        return func(*args, **kwargs)


def functional_forward(model: nn.Module, tensors: Any, inputs: torch.Tensor) -> torch.Tensor:
    """``model(inputs)`` with its parameters and buffers taken from ``tensors`` (a dict, or a tuple of dicts, as
    ``functional_call`` takes them), every layer in a twice-differentiable, vmappable form (module doc)."""
    with sdpa_kernel(SDPBackend.MATH), _TwiceDifferentiable():
        return functional_call(model, tensors, (inputs,))


__all__ = ["functional_forward"]
