"""What the guard returns: the gradient to upload (or None) and a per-sample report."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

#: Numeric keys every guarded train reply carries, every round (FedAvg refuses inconsistent keys).
METRIC_KEYS = ("guard_met", "guard_dropped", "guard_min_rmse_after", "guard_median_rmse_after",
               "guard_min_rmse_lb_after", "guard_noise_norm", "guard_rel_noise", "guard_matvecs", "guard_seconds")


@dataclass
class GuardReport:
    """Per-sample tensors [B] and per-update scalars.

    ``rmse_before`` is the predicted recovery RMSE of the update as computed (0: without noise a
    perfect attacker recovers the sample); ``rmse_after`` is ``assess``'s ``rmse_i2f`` with δ = the
    noise actually added (NaN when measurement failed); ``met`` is true only when every sample's
    ``rmse_after`` ≥ ``min_rmse``; ``reason`` says why not.
    """

    rmse_before: torch.Tensor
    rmse_after: torch.Tensor
    rmse_lb_after: torch.Tensor
    eps: torch.Tensor
    noise_norm: float
    rel_noise: float
    met: bool
    defense: str
    reason: str
    matvecs: int
    seconds: float
    min_rmse: float = 0.0
    details: dict = field(default_factory=dict)

    def metrics(self, dropped: bool = False) -> dict[str, float]:
        """The fixed numeric summary sent with a Flower reply (no noise seed, no direction)."""
        finite = self.rmse_after[torch.isfinite(self.rmse_after)]
        finite_lb = self.rmse_lb_after[torch.isfinite(self.rmse_lb_after)]
        return {
            "guard_met": float(self.met), "guard_dropped": float(dropped),
            "guard_min_rmse_after": float(finite.min()) if len(finite) else -1.0,
            "guard_median_rmse_after": float(finite.median()) if len(finite) else -1.0,
            "guard_min_rmse_lb_after": float(finite_lb.min()) if len(finite_lb) else -1.0,
            "guard_noise_norm": self.noise_norm, "guard_rel_noise": self.rel_noise,
            "guard_matvecs": float(self.matvecs), "guard_seconds": self.seconds,
        }


@dataclass
class GuardOutput:
    """``gradient``: what may be uploaded, or None when the update must not leave the client."""

    gradient: torch.Tensor | None
    report: GuardReport
