"""``GuardConfig``: everything a user sets on the leakage guard, validated with clear errors."""

from __future__ import annotations

import math
from typing import Literal

from pydantic import Field, model_validator

from flguard.config import StrictModel
from flguard.risk.assess import DEFAULT_EPS_RELATIVE

DEFENSES = ("none", "gaussian", "eigen", "fixed-gaussian", "pruning", "localdp")
#: Defenses that promise a per-sample floor (the others are baselines reported honestly).
THRESHOLD_DEFENSES = ("gaussian", "eigen")


class GuardConfig(StrictModel):
    """Guard settings.

    ``min_rmse`` (τ) is the floor on each sample's predicted recovery RMSE, in the model's input
    units: for inputs normalised as (pixel − mean)/std, a pixel-space RMSE r is ``r / std``.
    ``input_bounds`` (low, high), scalars or one value per channel in model-input units (pixels
    [0, 1] are ((0 − mean)/std, (1 − mean)/std)), or ``"batch"`` (each channel's min and max over
    the batch itself: the tightest box holding the data, so a conservative stand-in for any box an
    attacker may know): when set, the floor is verified for an attacker that clips its
    reconstruction to this box — the predicted error is clip(x + Δx) − x instead of Δx — a promise
    never weaker than without it, which closes the gap to box-constrained attacks (GS).
    """

    defense: Literal["none", "gaussian", "eigen", "fixed-gaussian", "pruning", "localdp"] = "gaussian"
    min_rmse: float = Field(0.05, ge=0.0, description="τ: per-sample floor on predicted RMSE (model-input units)")
    eps_mode: Literal["relative", "absolute"] = "relative"
    eps: float = Field(DEFAULT_EPS_RELATIVE, ge=0.0, description="Tikhonov ε: × λmax per sample, or absolute")
    max_rel_noise: float = Field(10.0, gt=0.0, description="noise budget: ‖noise‖ / ‖gradient‖ at most this")
    on_unmet: Literal["drop", "max-noise", "send"] = "drop"
    acknowledge_unguarded: bool = Field(False, description="required with on_unmet='send'")
    seed: int | None = Field(None, description="None: noise from OS entropy; an int only for tests/benchmarks")
    subspace_size: int = Field(32, ge=1, description="eigen: weak directions mixed per sample")
    krylov_steps: int = Field(64, ge=4, description="eigen: Lanczos steps used to find weak directions")
    gaussian_floor: float = Field(0.0, ge=0.0, le=1.0, description="eigen: share of min_rmse an isotropic "
                                  "noise part must meet on its own (robustness to subspace-aware attackers)")
    rtol: float = Field(1e-3, gt=0.0, lt=0.1, description="solver tolerance")
    input_bounds: tuple[float | tuple[float, ...], float | tuple[float, ...]] | Literal["batch"] | None = Field(
        None, description="(low, high) box of valid inputs in model-input units (scalar or per channel), or 'batch'")
    sigma: float = Field(1e-2, gt=0.0, description="fixed-gaussian: noise standard deviation")
    keep_ratio: float = Field(0.1, gt=0.0, le=1.0, description="pruning: share of largest-magnitude entries kept")
    clip_norm: float = Field(1.0, gt=0.0, description="localdp: clipping norm (sensitivity)")
    dp_epsilon: float = Field(1.0, gt=0.0, description="localdp: ε of the Gaussian mechanism")
    dp_delta: float = Field(1e-5, gt=0.0, lt=1.0, description="localdp: δ of the Gaussian mechanism")

    @model_validator(mode="after")
    def _bounds_are_a_box(self) -> "GuardConfig":
        if self.input_bounds is not None and self.input_bounds != "batch":
            low, high = (v if isinstance(v, tuple) else (v,) for v in self.input_bounds)
            channels = max(len(low), len(high))
            if {len(low), len(high)} - {1, channels}:
                raise ValueError("input_bounds: low and high need one value each or one per channel")
            low, high = low * (channels // len(low)), high * (channels // len(high))
            if not all(math.isfinite(lo) and math.isfinite(hi) and lo < hi for lo, hi in zip(low, high)):
                raise ValueError(f"input_bounds={self.input_bounds}: every low must be finite and below its high")
        return self

    @model_validator(mode="after")
    def _send_needs_acknowledgement(self) -> "GuardConfig":
        if self.on_unmet == "send" and not self.acknowledge_unguarded:
            raise ValueError("on_unmet='send' lets an update that misses min_rmse leave the client; "
                             "set acknowledge_unguarded=True to confirm")
        return self
