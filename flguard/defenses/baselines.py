"""Baselines through the same API: they return the gradient to send, scored like the rest."""

from __future__ import annotations

import math
from typing import Callable

import torch

from flguard.defenses.base import DefenseContext

Baseline = Callable[[DefenseContext], torch.Tensor]


def no_defense(ctx: DefenseContext) -> torch.Tensor:
    return ctx.gradient.clone()


def fixed_gaussian(ctx: DefenseContext) -> torch.Tensor:
    """g + N(0, σ²I) with the configured σ."""
    g = ctx.gradient
    return g + ctx.config.sigma * torch.randn(g.shape, generator=ctx.generator, dtype=g.dtype, device=g.device)


def pruning(ctx: DefenseContext) -> torch.Tensor:
    """Keep the ``keep_ratio`` largest-magnitude entries, zero the rest (DLG's pruning defense)."""
    g = ctx.gradient
    keep = max(1, math.ceil(ctx.config.keep_ratio * g.numel()))
    mask = torch.zeros_like(g, dtype=torch.bool)
    mask[g.abs().topk(keep).indices] = True
    return torch.where(mask, g, torch.zeros_like(g))


def local_dp(ctx: DefenseContext) -> torch.Tensor:
    """Clip to ``clip_norm`` then add N(0, s²I), s = C√(2 ln(1.25/δ))/ε — Flower's LocalDpMod rule
    (sensitivity = clipping norm)."""
    cfg, g = ctx.config, ctx.gradient
    clipped = g * min(1.0, cfg.clip_norm / max(float(g.norm()), 1e-30))
    std = cfg.clip_norm * math.sqrt(2 * math.log(1.25 / cfg.dp_delta)) / cfg.dp_epsilon
    ctx.info["dp_std"] = std
    return clipped + std * torch.randn(g.shape, generator=ctx.generator, dtype=g.dtype, device=g.device)


BASELINES: dict[str, Baseline] = {"none": no_defense, "fixed-gaussian": fixed_gaussian, "pruning": pruning,
                                  "localdp": local_dp}
