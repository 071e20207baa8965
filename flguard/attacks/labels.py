"""Label recovery from the last layer's gradient (the server does not need to guess labels).

With softmax cross-entropy and mean reduction the last layer z = W h + b has

    ∇b_j = (1/B) Σ_i (p_ij − y_ij),        ∇W_j = (1/B) Σ_i (p_ij − y_ij) h_iᵀ,

where p_i = softmax(z_i) and y_i is one-hot. Since 0 < p_ij < 1:

- **iDLG** (Zhao et al. 2020), one sample: p_j − y_j is negative exactly at the true class, so the
  label is the index of the negative bias-gradient entry; without a bias, of the negative row
  sum of ∇W (valid when h ≥ 0, e.g. after sigmoid/ReLU), or for K > 2 the row whose sign
  disagrees with all the others (any h).
- **batch count** (the "bias-corrected" estimate of Geng et al. 2021 / LLG, Wainakh et al.):
  the number of samples of class j is n_j = B·(p̄_j − ∇b_j), with p̄_j the mean softmax output,
  estimated from the model on probe inputs (for untrained models p barely depends on x). Every
  class with a negative ∇b_j occurs at least once; counts are rounded so that they sum to B.
  Without a bias, ∇W_j's row sum divided by the mean feature sum stands in for ∇b_j.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from flguard.attacks.base import trainable_parameters


def last_layer_gradients(model: nn.Module, gradients: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(∇W [K, D], ∇b [K] or None) of the last 2-D trainable parameter and the bias after it."""
    params = trainable_parameters(model)
    if len(params) != len(gradients):
        raise ValueError("gradients do not match the model's trainable parameters")
    matrices = [i for i, p in enumerate(params) if p.ndim == 2]
    if not matrices:
        raise ValueError("label recovery needs a final fully-connected layer (a 2-D weight)")
    w = matrices[-1]
    weight = gradients[w]
    bias = None
    if w + 1 < len(params) and params[w + 1].ndim == 1 and params[w + 1].shape[0] == weight.shape[0]:
        bias = gradients[w + 1]
    return weight, bias


def _row_signal(weight: torch.Tensor) -> torch.Tensor:
    """Per-class coefficient proportional to (p_j − y_j) from the rank-one(ish) ∇W."""
    return weight.sum(dim=1)


def idlg(model: nn.Module, gradients: Sequence[torch.Tensor]) -> torch.Tensor:
    """The label of a single sample, [1] long (iDLG)."""
    weight, bias = last_layer_gradients(model, gradients)
    if bias is not None:
        return bias.argmin().reshape(1)
    signal = _row_signal(weight)
    if signal.numel() > 2:
        # Rows are (p_j − y_j)·h: the true class's row points the other way than all the rest.
        reference = weight[weight.norm(dim=1).argmax()]
        coeff = weight @ reference
        positive = coeff > 0
        minority = positive if int(positive.sum()) * 2 < coeff.numel() else ~positive
        if int(minority.sum()) == 1:
            return minority.nonzero().reshape(1)
    return signal.argmin().reshape(1)


@torch.no_grad()
def _probe_statistics(model: nn.Module, probe: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean softmax output p̄ [K] and mean feature sum s̄ of the last linear layer's input."""
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    features: list[torch.Tensor] = []
    handle = linears[-1].register_forward_hook(lambda m, inp, out: features.append(inp[0])) if linears else None
    was_training = model.training
    model.eval()
    try:
        probs = model(probe).softmax(dim=-1).mean(dim=0)
    finally:
        model.train(was_training)
        if handle is not None:
            handle.remove()
    feature_sum = features[0].flatten(1).sum(dim=1).mean() if features else torch.tensor(1.0)
    return probs, feature_sum


def _allocate(estimate: torch.Tensor, required: torch.Tensor, total: int) -> torch.Tensor:
    """Integer counts ≥ ``required`` summing to ``total``, closest to ``estimate`` (largest remainder)."""
    counts = required.long().clone()
    if int(counts.sum()) > total:  # more classes look present than samples: keep the strongest
        keep = (estimate * required).topk(total).indices
        counts = torch.zeros_like(counts)
        counts[keep] = 1
        return counts
    remaining = total - int(counts.sum())
    want = (estimate - counts).clamp_min(0)
    if remaining == 0:
        return counts
    if float(want.sum()) <= 0:
        want = torch.ones_like(want, dtype=estimate.dtype)
    share = want * (remaining / want.sum())
    whole = share.floor().long()
    counts += whole
    leftover = remaining - int(whole.sum())
    if leftover > 0:
        counts[(share - whole).topk(leftover).indices] += 1
    return counts


def batch_counts(model: nn.Module, gradients: Sequence[torch.Tensor], batch_size: int,
                 probe: torch.Tensor) -> torch.Tensor:
    """Labels of a batch, sorted ascending, [B] long (bias-corrected count estimate)."""
    weight, bias = last_layer_gradients(model, gradients)
    probs, feature_sum = _probe_statistics(model, probe)
    signal = bias if bias is not None else _row_signal(weight) / feature_sum.clamp_min(1e-12)
    estimate = batch_size * (probs.to(signal) - signal)
    counts = _allocate(estimate, signal < 0, batch_size)
    return torch.repeat_interleave(torch.arange(counts.numel(), device=counts.device), counts)


def recover_labels(model: nn.Module, gradients: Sequence[torch.Tensor], batch_size: int,
                   input_shape: Sequence[int], *, probe: torch.Tensor | None = None,
                   generator: torch.Generator | None = None) -> torch.Tensor:
    """iDLG for one sample, the batch count method for more. ``gradients`` must be the gradient
    of the mean batch loss (for a K-step update Δ pass −Δ: the signs are what matter)."""
    if batch_size == 1:
        return idlg(model, gradients)
    if probe is None:
        device = gradients[0].device
        probe = torch.randn((64, *input_shape), generator=generator, device=device, dtype=gradients[0].dtype)
    return batch_counts(model, gradients, batch_size, probe)
