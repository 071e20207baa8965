"""``GuardConfig``: everything a user sets on the leakage guard, validated with clear errors."""

from __future__ import annotations

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
    """

    defense: Literal["none", "gaussian", "eigen", "fixed-gaussian", "pruning", "localdp"] = "gaussian"
    min_rmse: float = Field(0.05, ge=0.0, description="τ: per-sample floor on predicted RMSE (model-input units)")
    eps_mode: Literal["relative", "absolute"] = "relative"
    eps: float = Field(DEFAULT_EPS_RELATIVE, ge=0.0, description="Tikhonov ε: × λmax per sample, or absolute")
    max_rel_noise: float = Field(10.0, gt=0.0, description="noise budget: ‖noise‖ / ‖gradient‖ at most this")
    on_unmet: Literal["drop", "max-noise", "send"] = "drop"
    acknowledge_unguarded: bool = Field(False, description="required with on_unmet='send'")
    seed: int | None = Field(None, description="None: noise from OS entropy; an int only for tests/benchmarks")
    subspace_size: int = Field(8, ge=1, description="eigen: weak directions mixed per sample")
    krylov_steps: int = Field(32, ge=4, description="eigen: Lanczos steps used to find weak directions")
    rtol: float = Field(1e-3, gt=0.0, lt=0.1, description="solver tolerance")
    sigma: float = Field(1e-2, gt=0.0, description="fixed-gaussian: noise standard deviation")
    keep_ratio: float = Field(0.1, gt=0.0, le=1.0, description="pruning: share of largest-magnitude entries kept")
    clip_norm: float = Field(1.0, gt=0.0, description="localdp: clipping norm (sensitivity)")
    dp_epsilon: float = Field(1.0, gt=0.0, description="localdp: ε of the Gaussian mechanism")
    dp_delta: float = Field(1e-5, gt=0.0, lt=1.0, description="localdp: δ of the Gaussian mechanism")

    @model_validator(mode="after")
    def _send_needs_acknowledgement(self) -> "GuardConfig":
        if self.on_unmet == "send" and not self.acknowledge_unguarded:
            raise ValueError("on_unmet='send' lets an update that misses min_rmse leave the client; "
                             "set acknowledge_unguarded=True to confirm")
        return self
