"""Scoring and saving what the malicious server reconstructs: pixel maps, image grids, batch scores.

Kept apart from the strategy wrapper (``flguard.flower.malicious``) because reports and tests
use them on their own: ``score_batch`` matches a reconstructed batch to the true one (Hungarian)
and returns PSNR/SSIM/MSE/RMSE in pixels and the RMSE in model-input units (the guard's τ units).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch


def pixel_map(normalization: tuple[Sequence[float], Sequence[float]] | None
               ) -> Callable[[torch.Tensor], torch.Tensor]:
    """Model input space -> pixels in [0, 1] (identity without a normalisation)."""
    if normalization is None:
        return lambda x: x
    mean, std = (torch.tensor([float(v) for v in values]).view(-1, 1, 1) for values in normalization)
    return lambda x: x * std.to(x) + mean.to(x)


def finite_or_none(value: float) -> float | None:
    return value if value is not None and math.isfinite(value) else None


def save_grid(rows: Sequence[torch.Tensor], path: str | Path, min_side: int = 96) -> Path:
    """Save image rows (pixels in [0, 1], [N, C, H, W] each) as one PNG grid, one row each.

    Small images (MNIST 28 px, LFW 25 px) are enlarged by an integer factor (nearest neighbour)
    so that each is at least ``min_side`` pixels: the grid stays faithful but readable.
    """
    from torchvision.utils import save_image

    images = torch.cat([r.detach().cpu().float() for r in rows]).clamp(0, 1)
    factor = max(1, -(-min_side // max(images.shape[-2:])))
    if factor > 1:
        images = torch.nn.functional.interpolate(images, scale_factor=factor, mode="nearest")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_image(images, path, nrow=rows[0].shape[0], padding=2, pad_value=1.0)
    return path


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
