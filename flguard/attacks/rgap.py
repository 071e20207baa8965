"""R-GAP — Recursive Gradient Attack on Privacy (Zhu & Blaschko, ICLR 2021), one sample.

From the last layer back:

1. the final fully-connected layer z = W h + b has ∂L/∂W = δ hᵀ and ∂L/∂b = δ, so its input is
   h = δᵀ(∂L/∂W)/‖δ‖² in closed form (seed 002 Lemma 3.1; least squares over all rows instead
   of one row, which is the same for an exact gradient and more robust otherwise), and
   ∂L/∂h = Wᵀδ;
2. for every earlier layer with input x and output α(z): z = α⁻¹(next input), δ = ∂L/∂h ⊙ α'(z),
   and x solves u x = v with u = [unfolded W; gradient rows of δ], v = [z − b; ∂L/∂W]
   (seed 002 eq. (6)-(7)) in the minimum-norm least-squares sense; ∂L/∂x = Wᵀδ (a transposed
   convolution). A fully-connected layer in the middle is solved like step 1 from δ.

Assumptions (checked, ``ValueError`` otherwise): batch size 1 (the gradient of one sample —
averaged gradients of a batch do not factor into per-sample constraints); a plain
``nn.Sequential`` of Conv2d/Linear layers with invertible activations (tanh, sigmoid, LeakyReLU,
identity), no pooling or normalisation; the last layer fully connected with a bias. Labels are
not needed: the last layer's bias gradient *is* ∂L/∂z (they are still reported, from iDLG).
Everything runs in float64 (``dtype``) on the model's device; there is no iteration or restart.
"""

from __future__ import annotations

import copy
import time
from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from flguard.attacks.base import Reconstruction, register
from flguard.attacks.conv_system import activation_derivative, invert_activation, layer_gradients, min_norm_lstsq
from flguard.attacks.objectives import LossFn, cosine_matching
from flguard.risk.architecture import Stage, conv_system, layer_stages

# correct(position, stage, x_ls, δ = ∂L/∂z, v) -> (x, ∂L/∂x or None): the hybrid attack's hook.
Corrector = Callable[[int, Stage, torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor | None]]


def prepare(model: nn.Module, target: Sequence[torch.Tensor], input_shape: Sequence[int], batch_size: int,
            device: torch.device, dtype: torch.dtype,
            ) -> tuple[nn.Module, list[Stage], list[tuple[torch.Tensor, torch.Tensor | None]]]:
    """A float64 copy of ``model`` on ``device``, its stages and the per-stage target gradients."""
    if batch_size != 1:
        raise ValueError(f"R-GAP and the hybrid attack reconstruct one sample (batch_size=1), got {batch_size}: "
                         "a batch-averaged gradient does not split into per-sample linear constraints")
    layer_stages(model, input_shape)  # validate before copying
    grads = layer_gradients(model, layer_stages(model, input_shape), target)
    work = copy.deepcopy(model).to(device=device, dtype=dtype)
    stages = layer_stages(work, input_shape)
    grads = [(w.to(device=device, dtype=dtype), None if b is None else b.to(device=device, dtype=dtype))
             for w, b in grads]
    return work, stages, grads


def _closed_form_linear(dweight: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """h with ∂L/∂W = δ hᵀ, least squares over the rows."""
    norm = (delta * delta).sum()
    if float(norm) == 0.0:
        raise ValueError("the fully-connected layer's output gradient is zero: its input cannot be recovered")
    return delta @ dweight / norm


def recursive_inversion(work: nn.Module, stages: list[Stage], grads: list[tuple[torch.Tensor, torch.Tensor | None]],
                        correct: Corrector | None = None) -> tuple[torch.Tensor, list[float]]:
    """Run R-GAP's backward recursion; ``correct`` may refine each conv layer's solution.

    Returns the reconstructed input [1, *input shape] and the relative residual ‖ux − v‖/‖v‖ of
    every conv layer's least-squares solution (last layer first).
    """
    last = stages[-1]
    dweight, dbias = grads[-1]
    if dbias is None:
        raise ValueError("R-GAP's closed form needs the last fully-connected layer's bias gradient "
                         "(∂L/∂b = ∂L/∂z); this model's last layer has no bias")
    delta = dbias.reshape(-1)
    x = _closed_form_linear(dweight, delta)
    grad_x = last.module.weight.detach().T @ delta
    residuals: list[float] = []
    for position in range(len(stages) - 2, -1, -1):
        stage = stages[position]
        module = stage.module
        z = invert_activation(stage.activation, x.reshape(stage.out_shape))
        delta = grad_x.reshape(stage.out_shape) * activation_derivative(stage.activation, z)
        dweight, _ = grads[position]
        weight = module.weight.detach()
        if not stage.is_conv:
            x = _closed_form_linear(dweight, delta.reshape(-1))
            grad_x = weight.T @ delta.reshape(-1)
            continue
        bias = module.bias.detach().reshape(-1, 1, 1) if module.bias is not None else 0.0
        u = conv_system(module, stage.in_shape, weight, delta)
        v = torch.cat([(z - bias).reshape(-1), dweight.reshape(-1)])
        x = min_norm_lstsq(u, v)
        residuals.append(float(torch.linalg.vector_norm(torch.sparse.mm(u, x.unsqueeze(1)).squeeze(1) - v)
                               / torch.linalg.vector_norm(v).clamp_min(1e-300)))
        new_grad = None
        if correct is not None:
            x, new_grad = correct(position, stage, x.reshape(stage.in_shape), delta, v)
            x = x.reshape(-1)
        if new_grad is None:
            padding = 0 if isinstance(module.padding, str) else module.padding
            new_grad = torch.nn.grad.conv2d_input((1, *stage.in_shape), weight, delta.unsqueeze(0), module.stride,
                                                  padding, module.dilation)
        grad_x = new_grad.reshape(-1)
    return x.reshape(1, *stages[0].in_shape), residuals


def matching_loss(work: nn.Module, x: torch.Tensor, labels: torch.Tensor, target: Sequence[torch.Tensor],
                  loss_fn: LossFn | None) -> float:
    """1 − cos between the reconstruction's gradient and the upload (the score all attacks share)."""
    params = [p for p in work.parameters() if p.requires_grad]
    with torch.enable_grad():
        loss = (loss_fn or F.cross_entropy)(work(x), labels)
        grads = torch.autograd.grad(loss, params)
    return float(cosine_matching(grads, [t.to(g) for t, g in zip(target, grads)]))


@register("rgap")
def rgap(model: nn.Module, target: Sequence[torch.Tensor], input_shape: Sequence[int], *,
         labels: torch.Tensor, loss_fn: LossFn | None, batch_size: int, iterations: int | None,
         restarts: int, device: torch.device, generator: torch.Generator,
         dtype: torch.dtype = torch.float64) -> Reconstruction:
    """R-GAP for one sample; ``iterations``/``restarts`` are ignored (closed form + least squares).

    ``extra['residuals']`` holds the relative residual of each conv layer's system (last first).
    """
    start = time.perf_counter()
    work, stages, grads = prepare(model, target, input_shape, batch_size, device, dtype)
    with torch.no_grad():
        x, residuals = recursive_inversion(work, stages, grads)
    labels = labels.to(device).reshape(-1)
    loss = matching_loss(work, x, labels, target, loss_fn)
    param_dtype = next(model.parameters()).dtype
    return Reconstruction(images=x.to(param_dtype), labels=labels, loss=loss, history=residuals,
                          seconds=time.perf_counter() - start, method="rgap", extra={"residuals": residuals})
