"""One sample's Jacobian products with plain ``torch.autograd``: the direct path's form where a chunk is one sample.

``JacobianOperator``'s direct path ``vmap``s its per-sample products over chunks of samples. Where the model is so
large that a chunk holds one sample (``flguard.risk.sizing.direct_sample_chunk`` is 1: a ResNet-18 on the CPU),
``vmap`` batches nothing and ``torch.func``'s transforms only add their wrappers around every operation. Measured on
ResNet-18-GN at B = 8, one CPU thread, × a training step of the batch (docs/results.md, "One sample at a time with
plain autograd"): J_iᵀu 10.7× vmapped, 9.5× with ``torch.func.grad`` alone, **7.4–7.7× here**; J_iv 5.9–6.2×
vmapped, **5.3× here**; the fused K product 15.3× → **12.0×**. With the convolutions' input gradients recorded as
transposed convolutions in J_iᵀu's forward pass (``TRANSPOSED_INPUT_GRADS``, ``flguard.risk.transposed_input_grads``)
J_iᵀu 8.01× → 6.00× and the clipped K product 14.30× → 10.64× (docs/results.md, "Transposed input gradients").
Where a chunk holds several samples the vmapped forms are the faster ones (ResNet-20-GN at B = 8: the K product
11.0× vmapped against 15.1× one sample at a time; the quickstart CNN at B = 32: 8.9× against 39.8×), so the operator
takes this form only for chunks of one.

The same mathematics as the vmapped forms (``JacobianOperator._jt_one``, ``_j_one``), unscaled (ℓ is one sample's
loss; the operator applies the batch loss's scale):

- J_iᵀu = ∇_θ⟨∇_x ℓ(x_i), u⟩: a backward pass to the input that keeps its graph, then one to the parameters;
- J_iv = ∇_x⟨∇_z ℓ(z), ż⟩ with z the logits and ż = (∂z/∂θ)v their forward-mode derivative along v — the derivative
  of ℓ along θ + s·v, whose input gradient is J_iv. The loss is differentiated in reverse (∇_zℓ), not forward: a
  forward-mode cross-entropy writes in place into a tensor its backward pass needs.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Sequence

import torch
import torch.autograd.forward_ad as forward_ad
from torch import nn

from flguard.risk.dropout_draws import as_one_sample
from flguard.risk.functional import functional_forward
from flguard.risk.transposed_input_grads import InputOnly, transposed_input_grads

#: Record J_iᵀu's forward pass with every 2-D convolution's input gradient as a transposed convolution
#: (``flguard.risk.transposed_input_grads``: a ResNet-18's K product a quarter faster on the CPU). False: as PyTorch
#: records it.
TRANSPOSED_INPUT_GRADS = True

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
Draws = tuple[torch.Tensor, ...]  # one sample's dropout multipliers, without the batch dimension


class SampleAutograd:
    """One sample's J_iᵀu and ∇_θℓ (one tensor per parameter) and J_iv (flat [dx]), unscaled (module doc); ``x_i``
    without its batch dimension."""

    def __init__(self, model: nn.Module, buffers: dict[str, torch.Tensor], loss_fn: LossFn,
                 params: dict[str, torch.Tensor]) -> None:
        # the model and its buffers, not the operator's bound forward: an operator holding this object would
        # otherwise sit in a reference cycle, freed only by Python's cyclic collector — with its per-sample
        # gradients (0.36 GB a step on a ResNet-18 at B = 8, measured: the RSS rose by that much per step)
        self.model, self.buffers, self.loss_fn = model, buffers, loss_fn
        self.names = list(params)
        self.values = [params[n].detach() for n in self.names]
        self.sizes = [p.numel() for p in self.values]

    def forward(self, params: dict[str, torch.Tensor], inputs: torch.Tensor, draws: Draws) -> torch.Tensor:
        """The model on one sample ``inputs`` [1, …] with its dropout multipliers ``draws``."""
        return functional_forward(self.model, (params, self.buffers), inputs, as_one_sample(draws))

    def _leaves(self) -> list[torch.Tensor]:
        """Fresh leaves that share the parameters' storage: nothing is recorded on the operator's own tensors."""
        return [p.detach().requires_grad_(True) for p in self.values]

    def _loss(self, params: list[torch.Tensor], xi: torch.Tensor, yi: torch.Tensor, di: Draws) -> torch.Tensor:
        return self.loss_fn(self.forward(dict(zip(self.names, params)), xi.unsqueeze(0), di), yi.unsqueeze(0))

    def gradient(self, xi: torch.Tensor, yi: torch.Tensor, di: Draws) -> list[torch.Tensor]:
        """∇_θ ℓ(x_i), one tensor per parameter (``di``: the sample's dropout multipliers, as everywhere here)."""
        leaves = self._leaves()
        return list(torch.autograd.grad(self._loss(leaves, xi, yi, di), leaves, allow_unused=True,
                                        materialize_grads=True))

    def jt(self, xi: torch.Tensor, yi: torch.Tensor, di: Draws, ui: torch.Tensor) -> list[torch.Tensor]:
        """J_iᵀu = ∇_θ⟨∇_x ℓ(x_i), u⟩, u [dx] → one tensor per parameter (flattening them into one vector is a copy
        of dθ floats: 40 ms a sample on a ResNet-18, a sixth of the product; the K product passes them on as they are)."""
        leaves, x = self._leaves(), xi.detach().requires_grad_(True)
        input_only = InputOnly()
        with transposed_input_grads(input_only) if TRANSPOSED_INPUT_GRADS else contextlib.nullcontext():
            loss = self._loss(leaves, x, yi, di)
        with input_only():
            (input_grad,) = torch.autograd.grad(loss, x, create_graph=True)
        dot = (input_grad * ui.reshape(input_grad.shape)).sum()
        if not dot.requires_grad:  # the input gradient does not depend on the parameters
            return [torch.zeros_like(p) for p in self.values]
        return list(torch.autograd.grad(dot, leaves, allow_unused=True, materialize_grads=True))

    def j(self, xi: torch.Tensor, yi: torch.Tensor, di: Draws,
          v: torch.Tensor | Sequence[torch.Tensor]) -> torch.Tensor:
        """J_iv = ∇_x⟨∇_z ℓ, ż⟩ (module doc), v [dθ] or one tensor per parameter → [dx]."""
        x = xi.detach().requires_grad_(True)
        pieces = torch.split(v, self.sizes) if isinstance(v, torch.Tensor) else v
        tangents = [t.reshape(p.shape) for t, p in zip(pieces, self.values)]
        with forward_ad.dual_level():
            dual = [forward_ad.make_dual(p, t) for p, t in zip(self.values, tangents)]
            logits, along = forward_ad.unpack_dual(self.forward(dict(zip(self.names, dual)), x.unsqueeze(0), di))
        if along is None:  # the logits do not move along v
            return torch.zeros_like(xi).reshape(-1)
        (loss_grad,) = torch.autograd.grad(self.loss_fn(logits, yi.unsqueeze(0)), logits, create_graph=True)
        derivative = (loss_grad * along).sum()
        if not derivative.requires_grad:
            return torch.zeros_like(xi).reshape(-1)
        (out,) = torch.autograd.grad(derivative, x, allow_unused=True, materialize_grads=True)
        return out.reshape(-1)


def flatten_into(parts: Sequence[torch.Tensor] | torch.Tensor, out: torch.Tensor) -> None:
    """Write one vector, or per-parameter tensors in order, into the flat ``out`` (one copy, no temporary)."""
    if isinstance(parts, torch.Tensor):
        out.copy_(parts)
    else:
        torch.cat([t.reshape(-1) for t in parts], out=out)
