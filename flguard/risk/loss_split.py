"""How a batch loss splits into per-sample losses: loss_fn(batch) = c Σ_i ℓ(sample i), with c one number.

The per-sample operator (``flguard.risk.operator``) differentiates each sample's own loss ℓ and scales by c:

- a mean (``reduction="mean"``, PyTorch's default): ℓ = loss_fn on the sample alone, c = 1/B;
- a sum: ℓ = loss_fn on the sample alone, c = 1;
- a weighted mean — ``CrossEntropyLoss``/``NLLLoss`` with class ``weight``s, or an ``ignore_index`` that the batch
  holds, with reduction="mean": PyTorch divides by the batch's total weight Σ_j w_{y_j}, while loss_fn on one sample
  alone divides by that sample's own weight, so it is no per-sample part of the batch loss. ℓ is then the same
  criterion with reduction="sum" on the sample (w_{y_i} times its loss, 0 for an ignored one) and c = 1/Σ_j w_{y_j}:
  a number fixed by the batch's labels, which neither the parameters nor the inputs move.

``span`` is c·B, the clipped update c Σ_i clip_C(∇ℓ_i)'s largest norm per unit C — the noise budget's unit
(``flguard.guard.floor.noise_budget``; the operator keeps it as ``span``): exactly 1 for a mean, B for a sum.
Every split is checked on the batch's own logits (the batch loss against c Σ_i ℓ_i, to 1e-4) before it is used; a
loss that fits none is not separable (None), and per-sample clipping refuses it. A criterion that weighs the batch's
samples is split as the weighted mean first: class weights within 1e-4 of uniform would pass the plain mean's check,
and the guard would then send the unweighted clipped mean.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn
from torch.func import vmap

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class LossSplit:
    """loss_fn(batch) = ``scale`` × Σ_i ``per_sample``(sample i); ``span`` = scale × B (exactly 1 for a mean)."""
    per_sample: LossFn
    scale: float
    span: float


def split_loss(loss_fn: LossFn, logits: torch.Tensor, labels: torch.Tensor,
               batch_loss: float | None = None) -> LossSplit | None:
    """The split of ``loss_fn`` on this batch (module doc), or None where neither a mean, a sum nor a weighted mean
    fits. ``batch_loss``: loss_fn(logits, labels) where the caller has it already."""
    size = int(logits.shape[0])
    batch_loss = float(loss_fn(logits, labels)) if batch_loss is None else batch_loss
    if _weighted(loss_fn, labels):  # first: weights within 1e-4 of uniform would pass as a plain mean, unweighted
        return _weighted_split(loss_fn, logits, labels, batch_loss)
    total = _per_sample_total(loss_fn, logits, labels)
    if _agrees(batch_loss, total / size, total):
        return LossSplit(loss_fn, 1.0 / size, 1.0)
    if _agrees(batch_loss, total, total):
        return LossSplit(loss_fn, 1.0, float(size))
    return _weighted_split(loss_fn, logits, labels, batch_loss)


def _weighted(loss_fn: LossFn, labels: torch.Tensor) -> bool:
    """A class-index mean criterion that weighs this batch's samples: class weights, or an ignored label it holds."""
    if _summed(loss_fn) is None or labels.dtype.is_floating_point or labels.dtype == torch.bool:
        return False
    return getattr(loss_fn, "weight", None) is not None or bool((labels == loss_fn.ignore_index).any())


def _weighted_split(loss_fn: LossFn, logits: torch.Tensor, labels: torch.Tensor, batch_loss: float) -> LossSplit | None:
    """The weighted mean's split, (1/Σ_j w_{y_j}) Σ_i [w_{y_i}·ℓ_i] (module doc), checked; None where it does not
    fit."""
    summed, weight = _summed(loss_fn), _total_weight(loss_fn, labels)
    if summed is None or weight is None or weight <= 0:
        return None
    total = _per_sample_total(summed, logits, labels)
    if not _agrees(batch_loss, total / weight, total / weight):
        return None
    return LossSplit(summed, 1.0 / weight, int(logits.shape[0]) / weight)


def _per_sample_total(loss_fn: LossFn, logits: torch.Tensor, labels: torch.Tensor) -> float:
    return float(vmap(lambda z, y: loss_fn(z.unsqueeze(0), y.unsqueeze(0)))(logits, labels).sum())


def _agrees(batch_loss: float, value: float, total: float) -> bool:
    return abs(batch_loss - value) <= 1e-4 * abs(total) + 1e-12


def _summed(loss_fn: LossFn) -> LossFn | None:
    """A class-index criterion whose mean is weighted (``CrossEntropyLoss``, ``NLLLoss``) with reduction="sum"."""
    if not isinstance(loss_fn, (nn.CrossEntropyLoss, nn.NLLLoss)) or loss_fn.reduction != "mean":
        return None
    summed = copy.copy(loss_fn)  # the same weight tensor and settings
    summed.reduction = "sum"
    return summed


def _total_weight(loss_fn: LossFn, labels: torch.Tensor) -> float | None:
    """Σ_j w_{y_j} over the batch's class-index labels, an ignored label weighing 0 (None for soft targets)."""
    if labels.dtype.is_floating_point or labels.dtype == torch.bool:
        return None
    kept = labels != getattr(loss_fn, "ignore_index", -100)
    weight = getattr(loss_fn, "weight", None)
    if weight is None:
        return float(kept.sum())
    return float(weight.to(labels.device)[labels.clamp_min(0)][kept].sum())


__all__ = ["LossSplit", "split_loss"]
