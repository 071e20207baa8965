"""The strongest-attack mode: run several gradient-matching attacks and keep the best by matching loss.

Why: no single preset is strongest on every data set. On an MNIST digit (B = 1, untrained sigmoid
LeNet) GS with its natural-image TV weight 0.1 stops near 15 dB, GS without TV reaches ≈ 41 dB
and DLG (L-BFGS, no prior) ≈ 80 dB; on smooth faces TV helps. A malicious server that wants to
check a privacy promise must attack as well as it can, so this mode runs GS over a TV sweep
(``flguard.attacks.gs.STRONGEST_TVS``, all weights as one batch of candidates) and DLG, and keeps
the reconstruction whose gradient (or unrolled K-step update) is closest in cosine to the upload.
The truth is never consulted: selection uses only what a real attacker sees.

Scores are comparable across methods because every candidate is re-scored with the same
distance (1 − cos, over the parameters outside ``ignore_subspace``), whatever its own objective.
"""

from __future__ import annotations

import time
from typing import Sequence

import torch
from torch import nn

from flguard.attacks.base import Reconstruction, methods, register
from flguard.attacks.gs import STRONGEST_TVS, pick_best
from flguard.attacks.objectives import LossFn, cosine_distances, project_out, project_target, subspace_basis
from flguard.attacks.unroll import make_observer

#: Methods the mode runs by default (each must accept the shared hyperparameters below).
STRONGEST_METHODS = ("gs", "dlg")
_DLG_MAX_ITER = 20


def matching_score(model: nn.Module, target: Sequence[torch.Tensor], images: torch.Tensor, labels: torch.Tensor,
                   *, loss_fn: LossFn | None, observer_kwargs: dict, basis: torch.Tensor | None) -> float:
    """1 − cos between what ``images`` would upload (gradient or unrolled update) and ``target``."""
    observer = make_observer(model, loss_fn, images.shape[0], **observer_kwargs)
    candidate = observer(images.unsqueeze(0), labels.unsqueeze(0))
    value = cosine_distances(project_out(candidate, basis), project_target(target, basis))
    value = float(value.detach().reshape(-1)[0])
    return value if value == value else float("inf")


@register("strongest")
def strongest(model: nn.Module, target: Sequence[torch.Tensor], input_shape: Sequence[int], *,
              labels: torch.Tensor, loss_fn: LossFn | None, batch_size: int, iterations: int | None,
              restarts: int, device: torch.device, generator: torch.Generator,
              attacks: Sequence[str] = STRONGEST_METHODS, tv_sweep: Sequence[float] = STRONGEST_TVS,
              mean: float | Sequence[float] = 0.0, std: float | Sequence[float] = 1.0, local_steps: int = 1,
              local_lr: float | None = None, local_batch_size: int | None = None,
              local_batches: Sequence[Sequence[int]] | None = None, observer_mode: str = "auto",
              ignore_subspace: torch.Tensor | None = None) -> Reconstruction:
    """Best of ``attacks`` (default GS over ``tv_sweep`` and DLG) by cosine matching loss.

    ``iterations``: GS's iteration count; DLG gets the same number of L-BFGS iterations
    (``iterations // 20`` step calls of 20, at least 1); ``None`` uses each method's preset.
    ``extra['candidates']`` maps each method to its matching loss; ``extra['winner']`` names
    the one kept (its own ``extra`` is under ``extra['winner_extra']``).
    """
    start = time.perf_counter()
    registry = methods()
    unknown = [m for m in attacks if m not in registry or m == "strongest"]
    if not attacks or unknown:
        raise ValueError(f"attacks={tuple(attacks)!r}: give registered gradient-matching methods (not {unknown})")
    unroll = dict(local_steps=local_steps, local_lr=local_lr, local_batch_size=local_batch_size,
                  local_batches=local_batches, mode=observer_mode)
    shared = dict(labels=labels, loss_fn=loss_fn, batch_size=batch_size, restarts=restarts, device=device,
                  generator=generator, local_steps=local_steps, local_lr=local_lr, local_batch_size=local_batch_size,
                  local_batches=local_batches, observer_mode=observer_mode, ignore_subspace=ignore_subspace,
                  mean=mean, std=std)
    basis = subspace_basis(ignore_subspace, target)
    results: list[Reconstruction] = []
    for name in attacks:
        extra: dict = {}
        count = iterations
        if name == "gs":
            extra["tv_sweep"] = tuple(tv_sweep)
        elif name == "dlg" and iterations is not None:
            count = max(1, iterations // _DLG_MAX_ITER)
        result = registry[name](model, target, input_shape, iterations=count, **shared, **extra)
        result.loss = matching_score(model, target, result.images, result.labels, loss_fn=loss_fn,
                                     observer_kwargs=unroll, basis=basis)
        result.method = name
        results.append(result)
    best = results[pick_best(torch.tensor([r.loss for r in results]))]
    return Reconstruction(images=best.images, labels=best.labels, loss=best.loss, history=best.history,
                          seconds=time.perf_counter() - start, method="strongest",
                          extra={"candidates": {r.method: r.loss for r in results}, "winner": best.method,
                                 "winner_extra": best.extra, "tv": best.extra.get("tv")})
