"""Swappable pieces of gradient-matching attacks: the model's gradient, matching losses, priors.

Every function is batched over a leading "candidate" axis where noted so restarts run together.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.nn.functional as F

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def default_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Cross-entropy with mean reduction; ``labels`` may be class indices or soft labels."""
    return F.cross_entropy(logits, labels)


def l2_matching(candidate: Sequence[torch.Tensor], target: Sequence[torch.Tensor]) -> torch.Tensor:
    """DLG's objective: ½ Σ_layers ‖∇θL(x̂) − g‖²."""
    return 0.5 * sum(((c - t) ** 2).sum() for c, t in zip(candidate, target))


def cosine_matching(candidate: Sequence[torch.Tensor], target: Sequence[torch.Tensor]) -> torch.Tensor:
    """GS's objective: 1 − cos(∇θL(x̂), g) over all parameters concatenated."""
    dot = sum((c * t).sum() for c, t in zip(candidate, target))
    norm_c = sum((c * c).sum() for c in candidate).sqrt()
    norm_t = sum((t * t).sum() for t in target).sqrt()
    return 1.0 - dot / (norm_c * norm_t).clamp_min(1e-30)


def total_variation(images: torch.Tensor) -> torch.Tensor:
    """Anisotropic total variation: mean absolute difference of neighbouring pixels, per image.

    ``images`` [..., C, H, W] -> [...]: one value per image so candidates stay separable.
    """
    dx = (images[..., :, :, 1:] - images[..., :, :, :-1]).abs().mean(dim=(-3, -2, -1))
    dy = (images[..., :, 1:, :] - images[..., :, :-1, :]).abs().mean(dim=(-3, -2, -1))
    return dx + dy
