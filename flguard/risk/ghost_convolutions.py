"""A convolution's part in the ghost K product (``flguard.risk.ghost_products``): the autograd functions that record
its input gradient as a transposed convolution and leave pass 2's weight gradient as pairs (a, b), w = Σ wgrad(a, b),
and the inner product of such a w with the sample's own weight gradient wgrad(δ, x) — by two P×P Gram matrices per
sample, or by the formed weight where that is cheaper.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from flguard.risk.transposed_input_grads import input_gradient


@dataclass(eq=False)
class Convolution:
    """One convolution call of the forward pass: its weight and settings, the scalar leaf that makes pass 2 run its
    backward, pass 1's (δ, x) with their graphs, and pass 2's pairs."""
    weight: torch.Tensor
    name: str
    settings: tuple
    token: torch.Tensor
    first: tuple[torch.Tensor, torch.Tensor] | None = None
    pairs: list = field(default_factory=list)
    collecting: list = field(default_factory=lambda: [False])  # shared by one graph's convolutions

    def convolve(self, x: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        stride, padding, dilation = self.settings
        return F.conv2d(x, self.weight if weight is None else weight, None, stride, padding, dilation)

    def transposed(self, g: torch.Tensor, shape: torch.Size, weight: torch.Tensor | None = None) -> torch.Tensor:
        """The convolution's input gradient for output gradient ``g`` (input of ``shape``), a transposed convolution
        with the rows and columns a strided convolution never reached as its output padding."""
        return input_gradient(g, self.weight if weight is None else weight, shape, *self.settings)

    def weight_gradient(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """wgrad(a, b) summed over the batch: the gradient in the weight of ⟨a, conv(b, W)⟩ (contiguous operands:
        oneDNN's channels-last strided 1×1 weight gradient is wrong on some CPUs, tests/conftest.py)."""
        stride, padding, dilation = self.settings
        return torch.nn.grad.conv2d_weight(b.contiguous(), self.weight.shape, a.contiguous(), stride, padding, dilation)

    def patches(self, x: torch.Tensor) -> torch.Tensor:
        """[B, I·k², P]: the input's patches in the weight's order."""
        stride, padding, dilation = self.settings
        return F.unfold(x, self.weight.shape[2:], dilation=dilation, padding=padding, stride=stride)


class GhostConv2d(torch.autograd.Function):
    """y = conv2d(x, W) with W the layer's shared weight; its backward keeps pass 1's (δ, x) and records the input
    gradient as ``GhostConvTranspose2d``, and in pass 2 hands the weight's gradient over as the pair (δ, x)."""

    @staticmethod
    def forward(x: torch.Tensor, token: torch.Tensor, layer: Convolution) -> torch.Tensor:
        return layer.convolve(x)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
        ctx.save_for_backward(inputs[0])
        ctx.layer = weakref.ref(inputs[2])  # the layer holds δ, whose graph holds this node: no cycle through C++

    @staticmethod
    def backward(ctx: Any, gy: torch.Tensor) -> tuple:
        (x,) = ctx.saved_tensors
        layer = ctx.layer()
        if torch.is_grad_enabled():  # pass 1 (create_graph)
            layer.first = (gy, x)
            gx = GhostConvTranspose2d.apply(gy, layer.token, layer, x.shape) if ctx.needs_input_grad[0] else None
            return gx, torch.zeros_like(layer.token), None
        if layer.collecting[0]:
            layer.pairs.append((gy, None))  # b = pass 1's x: its patches are the ones pair_dot unfolds anyway
        gx = layer.transposed(gy, x.shape) if ctx.needs_input_grad[0] else None
        return gx, torch.zeros_like(layer.token), None


class GhostConvTranspose2d(torch.autograd.Function):
    """The input gradient of ``GhostConv2d``: ⟨ȳ, convᵀ(g, W)⟩ = ⟨conv(ȳ, W), g⟩, so its weight gradient is the pair
    (g, ȳ) and its gradient in g the convolution of ȳ."""

    @staticmethod
    def forward(g: torch.Tensor, token: torch.Tensor, layer: Convolution, shape: torch.Size) -> torch.Tensor:
        return layer.transposed(g, shape)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
        ctx.save_for_backward(inputs[0])
        ctx.layer = weakref.ref(inputs[2])

    @staticmethod
    def backward(ctx: Any, gbar: torch.Tensor) -> tuple:
        (g,) = ctx.saved_tensors
        layer = ctx.layer()
        if layer.collecting[0]:
            layer.pairs.append((g.detach(), gbar))
        dg = layer.convolve(gbar) if ctx.needs_input_grad[0] else None
        return dg, torch.zeros_like(layer.token), None, None


def ghost_cheaper(layer: Convolution) -> bool:
    """Whether the Gram matrices (P·(O + I·k²) per pair and sample) cost less than forming the weight (2·O·I·k²)."""
    positions = layer.first[0][0, 0].numel()
    outputs, inputs = layer.weight.shape[0], layer.weight[0].numel()
    return positions * (outputs + inputs) < 2 * outputs * inputs


def pair_dot(layer: Convolution, ghost: bool) -> torch.Tensor:
    """Σ_j ⟨wgrad(δ_j, x_j), w_j⟩ with w_j = Σ_pairs wgrad(a_j, b_j) (``flguard.risk.ghost_products``), δ and x
    carrying pass 1's graph: through Gram matrices (``ghost``) or the formed weight. A pair's b of None is pass 1's x
    (the forward convolution's pair): its patches are x's, unfolded once."""
    delta, x = layer.first
    batch = delta.shape[0]
    deltas = delta.reshape(batch, delta.shape[1], -1)  # [B, O, P]
    patches = layer.patches(x)  # [B, I·k², P]
    fixed = patches.detach()
    if ghost:
        total = delta.new_zeros(())
        for a, b in layer.pairs:
            outputs = torch.bmm(deltas.transpose(1, 2), a.reshape(batch, a.shape[1], -1))
            inputs = torch.bmm(patches.transpose(1, 2), fixed if b is None else layer.patches(b))
            total = total + (outputs * inputs).sum()
        return total
    weight = None
    for a, b in layer.pairs:
        part = torch.bmm(a.reshape(batch, a.shape[1], -1),
                         (fixed if b is None else layer.patches(b)).transpose(1, 2))  # [B, O, I·k²]
        weight = part if weight is None else weight + part
    return (torch.bmm(weight, patches) * deltas).sum()
