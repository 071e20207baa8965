"""The scorer: how close a reconstruction came to the client's true batch.

``Scorer(normalization)`` holds the map from model-input space to pixels; ``Scorer.score`` (and
``score_batch``, which reports and tests use on their own) matches a reconstructed batch to the
true one (Hungarian) and returns PSNR/SSIM/MSE/RMSE in pixels and the RMSE in model-input units
(the guard's τ units), per batch and per sample. Scoring needs the true batch, which only the
simulation-only channel provides (``flguard.server.truth``): it is the part of the malicious
server a real attacker cannot run, so it is kept apart from the attack runner.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from flguard.server.truth import TrueBatch


def pixel_map(normalization: tuple[Sequence[float], Sequence[float]] | None
               ) -> Callable[[torch.Tensor], torch.Tensor]:
    """Model input space -> pixels in [0, 1] (identity without a normalisation)."""
    if normalization is None:
        return lambda x: x
    mean, std = (torch.tensor([float(v) for v in values]).view(-1, 1, 1) for values in normalization)
    return lambda x: x * std.to(x) + mean.to(x)


def finite_or_none(value: float | None) -> float | None:
    """``value``, or None for NaN/±inf (JSON and CSV rows hold no infinities)."""
    return value if value is not None and math.isfinite(value) else None


def score_batch(truth: torch.Tensor, images: torch.Tensor, to_pixels: Callable[[torch.Tensor], torch.Tensor],
                true_labels: torch.Tensor | None = None, labels: torch.Tensor | None = None) -> dict[str, Any]:
    """Batch means of PSNR, SSIM, MSE, RMSE in pixels (clamped to [0, 1]) after Hungarian matching.

    ``rmse_input`` is the RMSE in model-input units (the unit of the guard's ``min_rmse``), averaged
    over the samples; ``rmse_input_samples`` lists each sample's (space-separated, true-batch order),
    because the promise is per sample: the share of samples reconstructed no closer than τ;
    ``permutation`` puts the reconstructions in the true batch's order.
    """
    from flguard.attacks import metrics

    if truth.shape != images.shape:
        raise ValueError(f"reconstruction {tuple(images.shape)} and true batch {tuple(truth.shape)} differ in shape")
    scores = metrics.score(to_pixels(images).clamp(0, 1), to_pixels(truth).clamp(0, 1), data_range=1.0)
    permutation = scores["permutation"].cpu()
    aligned = images[permutation]
    per_sample = (aligned - truth).flatten(1).pow(2).mean(1).sqrt()
    out: dict[str, Any] = {
        "psnr": float(scores["psnr"].double().mean()),  # +inf: an exact reconstruction
        "ssim": finite_or_none(float(scores["ssim"].double().mean())),
        "mse": float(scores["mse"].double().mean()),
        "rmse": float(scores["mse"].double().sqrt().mean()),
        "rmse_input": float(per_sample.mean()),
        "rmse_input_samples": " ".join(f"{float(v):.6g}" for v in per_sample),
        "label_accuracy": None,
        "permutation": permutation,
    }
    if "lpips" in scores:
        out["lpips"] = float(scores["lpips"].double().mean())
    if true_labels is not None and labels is not None and labels.numel() == true_labels.numel():
        out["label_accuracy"] = float((labels.cpu().view(-1)[permutation] == true_labels.view(-1)).double().mean())
    return out


class Scorer:
    """Scores reconstructions in one task's units (``normalization``: the inputs' (mean, std), or
    None for inputs that already are pixels in [0, 1])."""

    def __init__(self, normalization: tuple[Sequence[float], Sequence[float]] | None = None) -> None:
        self.normalization = normalization
        self.to_pixels = pixel_map(normalization)

    def score(self, truth: TrueBatch, images: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, Any]:
        """``score_batch`` of ``images`` against the true batch (see there), ``labels`` the recovered ones."""
        return score_batch(truth.inputs, images, self.to_pixels, truth.labels, labels)
