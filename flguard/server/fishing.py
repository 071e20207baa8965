"""Fishing: the server changes the parameters it sends so that a batch gradient carries one sample.

Wen et al., "Fishing for User Data in Large-Batch Federated Learning via Gradient Magnification"
(ICML 2022). The server cannot change the client's architecture, only the parameters θ it sends;
both moves here rewrite the last linear layer (W ∈ R^{C×h}, b ∈ R^C) of a copy of the model:

- **class fishing** (``fish_class``): W's rows are zero except the target class t's (every entry
  ``class_multiplier``), every other bias is ``bias_multiplier``. Every sample's logits are then
  ``b_j`` (j ≠ t) and ``class_multiplier·Σh + b_t`` with b_j ≫ z_t, so softmax gives p_t = 0 to
  float precision and ∂ℓ/∂h = Wᵀ(p − e_y) = (p_t − [y = t])·W_t: zero for every sample of another
  class and −W_t for a sample of class t. Every layer before the last carries only the target-class
  samples' gradients, summed and divided by B; ∂L/∂b_t = −n_t/B counts them (``count_targets``).
- **feature fishing** (``fish_feature``): W is zero except W[t, f] = m, b_t = −m·v, the other biases
  ``non_target_logit``: z_t = m·(h_f − v). With m large, a sample of class t contributes −m·∇h_f
  when h_f < v (p_t = 0) and nothing when h_f > v (p_t = 1); a sample of another class contributes
  +m·∇h_f when h_f > v and nothing below. A threshold v below all but one target-class sample's
  feature, and above the other classes' (as a server estimates from public data), isolates one
  sample; where other classes reach above v their gradients stay mixed in — the paper's remedy,
  differencing two rounds at two thresholds on the same batch, needs the client to keep its batch
  across rounds, which a Flower client does not promise.

``attack_fished`` inverts the isolated sample(s) with the strongest attack on the fished model, the
last layer frozen (its gradient also holds every other sample's softmax terms). On a K-step upload
the isolation lasts one step — the zeroed rows get gradients (p_j − [y = j])·h and train back, and
from the second step on every sample's gradient flows — so it unrolls the client's K steps from the
fished θ0 over all K·b samples instead (``flguard.attacks.unroll``) and the class-t reconstructions
are the server's; whether fishing still buys anything there is measured, not assumed
(``benchmarks/study_fishing_multistep.py``).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from flguard.attacks import Reconstruction, reconstruct
from flguard.attacks.base import split_gradient, trainable_parameters
from flguard.server.uploads import ClientUpdate

FISHING_KINDS = ("none", "class", "feature")


def last_linear(model: nn.Module) -> tuple[str, nn.Linear]:
    """(qualified name, module) of the model's last ``nn.Linear`` — the classifier the fishing rewrites."""
    found = [(name, module) for name, module in model.named_modules() if isinstance(module, nn.Linear)]
    if not found or found[-1][1].bias is None:
        raise ValueError("fishing needs a model whose last nn.Linear (the classifier) has a bias")
    return found[-1]


def _checked_target(layer: nn.Linear, target: int) -> int:
    if not 0 <= int(target) < layer.out_features:
        raise ValueError(f"target={target} is not a class of the model's {layer.out_features} outputs")
    return int(target)


@torch.no_grad()
def fish_class(model: nn.Module, target: int, *, class_multiplier: float = 0.5,
               bias_multiplier: float = 1000.0) -> nn.Module:
    """A copy of ``model`` whose gradient, on any batch, carries only the class-``target`` samples
    before the last layer (module doc); ``model`` itself is not changed."""
    fished = copy.deepcopy(model)
    _, layer = last_linear(fished)
    target = _checked_target(layer, target)
    kept_bias = float(layer.bias[target])
    layer.weight.zero_()
    layer.weight[target] = class_multiplier
    layer.bias.fill_(bias_multiplier)
    layer.bias[target] = kept_bias
    return fished


@torch.no_grad()
def fish_feature(model: nn.Module, target: int, *, feature: int, threshold: float,
                 feature_multiplier: float = 1000.0, non_target_logit: float = 0.0) -> nn.Module:
    """A copy of ``model`` whose class-``target`` samples contribute to the gradient only where their
    ``feature``-th penultimate feature lies below ``threshold`` (module doc: samples of other classes
    above it contribute too)."""
    fished = copy.deepcopy(model)
    _, layer = last_linear(fished)
    target = _checked_target(layer, target)
    if not 0 <= int(feature) < layer.in_features:
        raise ValueError(f"feature={feature} is not one of the last layer's {layer.in_features} inputs")
    layer.weight.zero_()
    layer.weight[target, int(feature)] = feature_multiplier
    layer.bias.fill_(non_target_logit)
    layer.bias[target] = -feature_multiplier * float(threshold)
    return fished


def penultimate_features(model: nn.Module, inputs: torch.Tensor) -> torch.Tensor:
    """The inputs of the model's last linear layer for ``inputs`` [N, h] (what feature fishing thresholds)."""
    _, layer = last_linear(model)
    captured: list[torch.Tensor] = []
    handle = layer.register_forward_hook(lambda module, args, output: captured.append(args[0].detach()))
    try:
        with torch.no_grad():
            model(inputs)
    finally:
        handle.remove()
    return captured[0].flatten(1)


def _gradient_and_batch(upload: Any, model: nn.Module, batch_size: int | None) -> tuple[list[torch.Tensor], int | None]:
    if isinstance(upload, ClientUpdate):
        if upload.local_steps != 1:
            raise ValueError(f"fishing inverts one-step uploads; this one took {upload.local_steps} local steps")
        return [g.detach() for g in upload.gradient], batch_size or upload.batch_size
    return [g.detach() for g in split_gradient(model, upload)], batch_size


def _bias_gradient(model: nn.Module, gradient: Sequence[torch.Tensor]) -> torch.Tensor:
    _, layer = last_linear(model)
    for param, grad in zip(trainable_parameters(model), gradient):
        if param is layer.bias:
            return grad.double()
    raise ValueError("the classifier's bias is frozen: its gradient is not in the upload")


def count_targets(upload: Any, model: nn.Module, target: int, *, batch_size: int | None = None) -> int:
    """How many class-``target`` samples a class-fished upload holds, read off ∂L/∂b_t = −n_t/B.

    ``upload``: the decoded ``ClientUpdate`` (it knows B) or a gradient (flat or per parameter) of
    the fished ``model``; without ``batch_size``, B is the least one that makes every class's
    count whole (every other bias gradient is 1/(C−1) − n_j/B under class fishing)."""
    gradient, batch = _gradient_and_batch(upload, model, batch_size)
    bias = _bias_gradient(model, gradient)
    classes = bias.numel()
    if batch is None:
        share = torch.cat([-bias[target:target + 1], 1.0 / (classes - 1) - torch.cat([bias[:target], bias[target + 1:]])])
        batch = next((b for b in range(1, 4097) if bool(((share * b) - (share * b).round()).abs().max() < 1e-3)), None)
        if batch is None:
            raise ValueError("the batch size could not be read off the bias gradient; pass batch_size")
    return max(0, int(round(float(-bias[target]) * batch)))


def frozen_classifier(model: nn.Module) -> nn.Module:
    """A copy of ``model`` whose last linear layer is frozen (``requires_grad`` off): the attacks then
    match only the layers before it."""
    frozen = copy.deepcopy(model)
    _, layer = last_linear(frozen)
    for param in layer.parameters():
        param.requires_grad_(False)
    return frozen


def attack_fished(model: nn.Module, upload: Any, target: int, input_shape: Sequence[int], *,
                  batch_size: int | None = None, count: int | None = None,
                  labels: torch.Tensor | Sequence[int] | None = None, **attack_kwargs: Any) -> Reconstruction:
    """Invert the class-``target`` sample(s) of a fished upload.

    A multi-step upload (a ``ClientUpdate`` with ``local_steps`` K > 1) goes to ``attack_fished_unrolled``
    (``labels``: its K·b labels in step order, else recovered from the update); ``batch_size``,
    ``count`` and the frozen classifier are the one-step path's, and ``labels`` is the multi-step one's.

    ``model`` holds the fished parameters the server sent; ``upload`` the decoded ``ClientUpdate``
    (or its gradient, with ``batch_size``). The layers before the last carry Σ_{y_i = t} ∇ℓ_i / B,
    so the n target samples (``count``, default ``count_targets``; at least one) are inverted as a
    batch of n with labels t on the fished model with its classifier frozen, matching B/n times
    that gradient. ``attack_kwargs`` go to ``reconstruct`` (default ``method="strongest"``).
    ``extra['targets']`` is n, ``extra['fished_class']`` t.
    """
    if isinstance(upload, ClientUpdate) and upload.local_steps > 1:
        return attack_fished_unrolled(model, upload, target, input_shape, labels=labels, **attack_kwargs)
    gradient, batch = _gradient_and_batch(upload, model, batch_size)
    if batch is None:
        raise ValueError("attack_fished needs the upload's batch size (a ClientUpdate, or batch_size=)")
    n = count if count is not None else count_targets(gradient, model, target, batch_size=batch)
    n = max(1, int(n))
    name, _ = last_linear(model)
    kept = [g * (batch / n) for (pname, p), g in zip(
        ((pname, p) for pname, p in model.named_parameters() if p.requires_grad), gradient)
        if not pname.startswith(f"{name}.")]
    attack_kwargs.setdefault("method", "strongest")
    result = reconstruct(frozen_classifier(model), kept, input_shape, labels=[int(target)] * n, batch_size=n,
                         **attack_kwargs)
    result.extra.update(targets=n, fished_class=int(target))
    return result


def attack_fished_unrolled(model: nn.Module, upload: ClientUpdate, target: int, input_shape: Sequence[int], *,
                           labels: torch.Tensor | Sequence[int] | None = None, **attack_kwargs: Any) -> Reconstruction:
    """Invert a fished K-step upload θ_K − θ_0: the client's K SGD steps (learning rate ``upload.lr``,
    consecutive mini-batches of b = K·b / K samples) unrolled from the fished θ_0 over all K·b
    candidates (Geiping et al. 2020 §5), every parameter matched — the classifier's update is part of
    what the server sees, and it is no longer zero after the first step. ``labels``: the K·b labels in
    step order (default: recovered from the update). ``extra['targets']`` counts the candidates
    labelled ``target``; ``extra['unrolled']`` is K."""
    steps, total = upload.local_steps, upload.batch_size
    if not upload.update:
        raise ValueError("the upload carries no update θ_K − θ_0 to unroll (ClientUpdate.update is empty)")
    if total % steps:
        raise ValueError(f"a {steps}-step upload of {total} images: the steps' batches are not whole")
    _checked_target(last_linear(model)[1], target)
    attack_kwargs.setdefault("method", "strongest")
    result = reconstruct(model, upload.update, input_shape, labels=labels, batch_size=total, local_steps=steps,
                         local_lr=upload.lr, local_batch_size=total // steps, **attack_kwargs)
    result.extra.update(targets=int((result.labels == int(target)).sum()), fished_class=int(target), unrolled=steps)
    return result
