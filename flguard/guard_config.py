"""``GuardConfig``: everything a user sets on the leakage guard, validated with clear errors."""

from __future__ import annotations

import math
from typing import Literal

from pydantic import Field, model_validator

from flguard.config import StrictModel
from flguard.risk.defaults import DEFAULT_EPS_RELATIVE

DEFENSES = ("none", "gaussian", "eigen", "fixed-gaussian", "pruning", "localdp")
#: Defenses that promise a per-sample floor (the others are baselines reported honestly).
THRESHOLD_DEFENSES = ("gaussian", "eigen")
#: τ in model-input units when neither ``min_rmse`` nor ``max_psnr`` is given.
DEFAULT_MIN_RMSE = 0.05

Channels = float | tuple[float, ...]


def _per_channel(value: Channels) -> tuple[float, ...]:
    return value if isinstance(value, tuple) else (value,)


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

    ``max_psnr`` (dB, pixels in [0, 1]) states the floor in pixel space instead, with the inputs'
    normalisation ``pixel_mean``/``pixel_std`` (scalar or per channel): no sample's predicted
    reconstruction may be closer than this PSNR, i.e. its pixel RMSE must be ≥ 10^(−max_psnr/20).
    A pixel error is the input error times its channel's std, so the pixel RMSE is at least
    min(std) × the input RMSE, and τ = 10^(−max_psnr/20) / min(std) in input units guarantees the
    pixel floor on every channel mix (``floor``). ``input_bounds`` then defaults to the pixel box
    [0, 1] mapped through the normalisation (``bounds``). Give ``min_rmse`` or ``max_psnr``, not
    both; with neither, τ = DEFAULT_MIN_RMSE input units.
    """

    defense: Literal["none", "gaussian", "eigen", "fixed-gaussian", "pruning", "localdp"] = "gaussian"
    min_rmse: float | None = Field(None, ge=0.0, description="τ: per-sample floor on predicted RMSE (model-input "
                                   f"units); None: from max_psnr, else {DEFAULT_MIN_RMSE}")
    max_psnr: float | None = Field(None, description="floor in pixel PSNR (dB, pixels in [0, 1]): no predicted "
                                   "reconstruction closer; needs pixel_mean and pixel_std; excludes min_rmse")
    pixel_mean: Channels | None = Field(None, description="max_psnr: the inputs' normalisation mean (pixels in [0, 1])")
    pixel_std: Channels | None = Field(None, description="max_psnr: the inputs' normalisation std, scalar or per channel")
    eps_mode: Literal["relative", "absolute"] = "relative"
    eps: float = Field(DEFAULT_EPS_RELATIVE, ge=0.0, description="Tikhonov ε: × λmax per sample, or absolute")
    max_rel_noise: float = Field(10.0, gt=0.0, description="noise budget: ‖noise‖ / ‖gradient‖ (or / C with "
                                 "clip_per_sample) at most this")
    clip_per_sample: float | None = Field(None, gt=0.0, description="C: clip each sample's gradient to norm C "
                                          "before the floor (the guard measures the clipped map); max_rel_noise is "
                                          "then relative to C")
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
    def _one_floor(self) -> "GuardConfig":
        if self.max_psnr is None:
            if self.min_rmse is None:  # neither given (or max_psnr unset by assignment): the default floor
                object.__setattr__(self, "min_rmse", DEFAULT_MIN_RMSE)
            return self
        if self.min_rmse is not None:
            if "min_rmse" in self.model_fields_set:
                raise ValueError(f"min_rmse={self.min_rmse} and max_psnr={self.max_psnr} both set a floor; "
                                 "give one: max_psnr in pixel PSNR (with pixel_mean, pixel_std) or min_rmse in "
                                 "model-input units")
            object.__setattr__(self, "min_rmse", None)  # the default yields to max_psnr set by assignment
        if not math.isfinite(self.max_psnr):
            raise ValueError(f"max_psnr={self.max_psnr} must be finite")
        if self.pixel_mean is None or self.pixel_std is None:
            raise ValueError("max_psnr needs pixel_mean and pixel_std (the normalisation the model inputs went "
                             "through; 0 and 1 for raw [0, 1] pixels)")
        mean, std = _per_channel(self.pixel_mean), _per_channel(self.pixel_std)
        if len(mean) != len(std) and 1 not in (len(mean), len(std)):
            raise ValueError(f"pixel_mean has {len(mean)} channels and pixel_std {len(std)}: give one value or "
                             "one per channel each")
        if not all(math.isfinite(v) and v > 0 for v in std) or not all(math.isfinite(v) for v in mean):
            raise ValueError(f"pixel_std={self.pixel_std} must be positive and finite, pixel_mean finite")
        return self

    @property
    def floor(self) -> float:
        """τ in model-input units: ``min_rmse``, or 10^(−max_psnr/20) / min(pixel_std)."""
        if self.max_psnr is None:
            return float(self.min_rmse)
        return 10 ** (-self.max_psnr / 20) / min(_per_channel(self.pixel_std))

    @property
    def bounds(self) -> tuple | str | None:
        """``input_bounds``, or with ``max_psnr`` and none given the pixel box [0, 1] in input units."""
        if self.input_bounds is not None or self.max_psnr is None:
            return self.input_bounds
        mean, std = _per_channel(self.pixel_mean), _per_channel(self.pixel_std)
        channels = max(len(mean), len(std))
        mean, std = mean * (channels // len(mean)), std * (channels // len(std))
        low = tuple((0 - m) / s for m, s in zip(mean, std))
        high = tuple((1 - m) / s for m, s in zip(mean, std))
        return (low, high) if channels > 1 else (low[0], high[0])

    @model_validator(mode="after")
    def _send_needs_acknowledgement(self) -> "GuardConfig":
        if self.on_unmet == "send" and not self.acknowledge_unguarded:
            raise ValueError("on_unmet='send' lets an update that misses min_rmse leave the client; "
                             "set acknowledge_unguarded=True to confirm")
        return self
