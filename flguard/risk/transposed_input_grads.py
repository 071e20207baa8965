"""2-D convolutions whose input gradient is a transposed convolution: the reverse-over-reverse J_iᵀu without
PyTorch's costly second derivative of a convolution's input gradient.

J_iᵀu = ∇_θ⟨∇_x ℓ, u⟩ (``flguard.risk.sample_autograd``) differentiates the input gradient ∇_x ℓ with respect to
the parameters. PyTorch records a convolution's input gradient as its ``convolution_backward`` node, whose own
derivative (``_convolution_double_backward``) gets the weight's part by a convolution with batch and channels
swapped: for one sample an input of one channel and as many "samples" as the layer has channels, a slow shape on
the CPU (a 512-channel 4×4 layer of a ResNet-18: 7.8 ms where the ordinary weight gradient takes about 1), and
a result transposed in memory, whose accumulation and hand-over to forward mode are strided copies. Here, inside
``transposed_input_grads()``, a 2-D convolution's input gradient is recorded as what it equals,
``conv_transpose2d(∂ℓ/∂y, W)``, whose own derivatives are ordinary convolution gradients. Measured on ResNet-18-GN at
B = 8, one CPU thread, × a training step (docs/results.md, "Transposed input gradients"): J_iᵀu 8.01× → 6.00×, the
clipped K product 14.30× → 10.64× (the J_i after J_iᵀu gets contiguous tangents), a guarded step 48.4 → 35.9 s; the
outputs agree to 8e-7.

Only ``torch.nn.functional.conv2d`` on a batched input with numeric padding is rerouted (``nn.Conv2d`` with any
stride, padding, padding mode, dilation, groups and bias); anything else runs as PyTorch records it. The first pass
(to the input only) is told not to form the weights' gradients (``InputOnly``): the engine would discard them; the
second forms the input's and the weight's gradients in one ``convolution_backward`` call. The function has a generated
``vmap`` rule, so the cached (vmapped) Jᵀ pullback can be built through it too (``flguard.risk.operator``'s opt-in
``CACHED_TRANSPOSED_INPUT_GRADS``: on an H200 the same time per product in 27% less GPU memory).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
import torch.nn.functional as F
from torch.nn.modules.utils import _pair
from torch.overrides import TorchFunctionMode


class InputOnly:
    """Whether the backward pass under way needs only the input's gradient (``SampleAutograd.jt``'s first pass:
    ``torch.autograd.grad(loss, x)``), so the convolutions skip their weights' and biases' gradients."""

    def __init__(self) -> None:
        self.on = False

    @contextlib.contextmanager
    def __call__(self) -> Iterator[None]:
        self.on = True
        try:
            yield
        finally:
            self.on = False


class _Conv2d(torch.autograd.Function):
    """y = conv2d(x, W, b), its input gradient recorded as ``conv_transpose2d`` (differentiable again by ordinary
    convolution gradients), its weight and bias gradients as PyTorch's own."""

    generate_vmap_rule = True  # under ``torch.func`` transforms (the cached pullbacks): forward and backward vmapped

    @staticmethod
    def forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, stride: Any,
                padding: Any, dilation: Any, groups: int, input_only: InputOnly) -> torch.Tensor:
        return F.conv2d(x, weight, bias, stride, padding, dilation, groups)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
        x, weight, bias, stride, padding, dilation, groups, input_only = inputs
        ctx.save_for_backward(x, weight)
        ctx.settings = (_pair(stride), _pair(padding), _pair(dilation), groups)
        ctx.input_only, ctx.has_bias = input_only, bias is not None

    @staticmethod
    def backward(ctx: Any, grad_y: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        stride, padding, dilation, groups = ctx.settings
        need_x = ctx.needs_input_grad[0]
        need_w = ctx.needs_input_grad[1] and not ctx.input_only.on
        need_b = ctx.has_bias and ctx.needs_input_grad[2] and not ctx.input_only.on
        grad_x = grad_w = grad_b = None
        if need_x and torch.is_grad_enabled():  # the input gradient's graph is kept (create_graph): record it
            # as a transposed convolution, with the rows and columns a strided convolution never reached as its
            # output padding
            grad_x = input_gradient(grad_y, weight, x.shape, stride, padding, dilation, groups)
            need_x = False
        if need_x or need_w or need_b:  # PyTorch's own gradients in one call (not ``torch.nn.grad.conv2d_weight``,
            # which passes an expanded stand-in for the weight that the kernel then copies in full)
            gx, grad_w, grad_b = torch.ops.aten.convolution_backward(
                grad_y, x, weight, [weight.shape[0]] if need_b else None, list(stride), list(padding),
                list(dilation), False, [0, 0], groups, [need_x, need_w, need_b])
            grad_x = gx if need_x else grad_x
        return grad_x, grad_w, grad_b, None, None, None, None, None


def input_gradient(grad_y: torch.Tensor, weight: torch.Tensor, shape: Any, stride: tuple, padding: tuple,
                   dilation: tuple, groups: int = 1) -> torch.Tensor:
    """A 2-D convolution's input gradient (input of ``shape``) as ``conv_transpose2d(∂ℓ/∂y, W)``, with the rows and
    columns a strided convolution never reached as its output padding."""
    extra = tuple(shape[2 + d] - ((grad_y.shape[2 + d] - 1) * stride[d] - 2 * padding[d]
                                  + dilation[d] * (weight.shape[2 + d] - 1) + 1) for d in range(2))
    return F.conv_transpose2d(grad_y, weight, None, stride, padding, extra, groups, dilation)


def conv2d_arguments(args: tuple, kwargs: dict) -> dict[str, Any]:
    """``F.conv2d``'s arguments by name, as a function mode receives them, with its defaults filled in."""
    given = {"bias": None, "stride": 1, "padding": 0, "dilation": 1, "groups": 1}
    given.update(zip(("input", "weight", "bias", "stride", "padding", "dilation", "groups"), args))
    given.update(kwargs)
    return given


class _Reroute(TorchFunctionMode):
    def __init__(self, input_only: InputOnly) -> None:
        super().__init__()
        self.input_only = input_only

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is F.conv2d:
            given = conv2d_arguments(args, kwargs)
            if given["input"].dim() == 4 and not isinstance(given["padding"], str):
                return _Conv2d.apply(given["input"], given["weight"], given["bias"], given["stride"],
                                     given["padding"], given["dilation"], given["groups"], self.input_only)
        return func(*args, **kwargs)


@contextlib.contextmanager
def transposed_input_grads(input_only: InputOnly) -> Iterator[None]:
    """Record the forward passes run inside with every 2-D convolution's input gradient as a transposed convolution
    (module doc); ``input_only`` tells their backward passes when to skip the weights' gradients."""
    with _Reroute(input_only):
        yield
