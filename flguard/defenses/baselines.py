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


def gaussian_mechanism_std(sensitivity: float, epsilon: float, delta: float) -> float:
    """The Gaussian mechanism's noise std s = Δ·√(2 ln(1.25/δ))/ε for sensitivity Δ (Dwork & Roth,
    Thm A.1) — the rule of Flower's LocalDpMod. Written once: the guard's ``localdp`` defense and
    ``flguard.simulation.localdp.LocalDpConfig.std`` both call it."""
    return sensitivity * math.sqrt(2 * math.log(1.25 / delta)) / epsilon


def local_dp(ctx: DefenseContext) -> torch.Tensor:
    """Clip to ``clipping_norm`` then add N(0, s²I), s = ``gaussian_mechanism_std(sensitivity, epsilon,
    delta)`` — Flower's LocalDpMod rule with its argument names, on the step's gradient."""
    cfg, g = ctx.config, ctx.gradient
    clipped = g * min(1.0, cfg.clipping_norm / max(float(g.norm()), 1e-30))
    std = gaussian_mechanism_std(cfg.sensitivity, cfg.epsilon, cfg.delta)
    ctx.info["dp_std"] = std
    return clipped + std * torch.randn(g.shape, generator=ctx.generator, dtype=g.dtype, device=g.device)


BASELINES: dict[str, Baseline] = {"none": no_defense, "fixed-gaussian": fixed_gaussian, "pruning": pruning,
                                  "localdp": local_dp}
