"""What the guard returns: the gradient to upload (or None) and a per-sample report."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

#: Numeric keys every guarded train reply carries, every round (FedAvg refuses inconsistent keys).
#: The one list of them: ``summarise`` builds every metrics dict from it, in this order.
METRIC_KEYS = ("guard_met", "guard_dropped", "guard_min_rmse_after", "guard_median_rmse_after",
               "guard_min_rmse_lb_after", "guard_noise_norm", "guard_rel_noise", "guard_matvecs", "guard_seconds",
               "guard_excluded", "guard_samples", "guard_steps", "guard_aimed_steps")

#: The defenses whose noise is aimed at each sample's weak directions (the others' is isotropic): what
#: ``guard_aimed_steps`` counts, by the kind each sent step used (``auto`` names it in ``details["defense_used"]``).
AIMED_DEFENSES = ("rowspace", "resolvent", "eigen")


@dataclass
class GuardReport:
    """Per-sample tensors [B] and per-update scalars.

    ``rmse_after`` is ``assess``'s ``rmse_i2f`` with δ = the noise actually added (NaN when
    measurement failed; without noise it is 0: a perfect attacker recovers the sample);
    ``rmse_lb_after`` the lower bound's RMSE for the same δ; ``met`` is true only when every
    sample's ``rmse_after`` ≥ ``min_rmse``; ``reason`` says why not. A sample left out of the step
    (``max_excluded``; counted in ``details["excluded"]``) has +inf: its gradient is not sent.
    ``rmse_error`` (threshold defenses): per sample, |rmse_after − the exact value| is at most this —
    the noise scale × the solver's verified error bound, ÷√dx (clip is 1-Lipschitz, so it holds for
    the box-clipped RMSE too). The solve stops each sample once it certifies, so a sample far above
    the floor is reported to that accuracy, not to rtol (``flguard.guard.floor.FloorCalibrator.sufficient``).
    """

    rmse_after: torch.Tensor
    rmse_lb_after: torch.Tensor
    eps: torch.Tensor
    noise_norm: float
    rel_noise: float
    met: bool
    defense: str
    reason: str
    matvecs: float  # Jacobian applications per sample, in whole-batch products (see JacobianOperator.applications)
    seconds: float
    min_rmse: float = 0.0
    details: dict = field(default_factory=dict)
    rmse_error: torch.Tensor | None = None

    def metrics(self, dropped: bool = False) -> dict[str, float]:
        """The fixed numeric summary sent with a Flower reply (no noise seed, no direction)."""
        return summarise([self], dropped)


def _worst(values: torch.Tensor) -> float:
    """The smallest finite entry, or -1 when nothing was measured."""
    finite = values[torch.isfinite(values)]
    return float(finite.min()) if len(finite) else -1.0


def summarise(reports: Sequence[GuardReport], dropped: bool = False) -> dict[str, float]:
    """METRIC_KEYS over one or more guarded steps: the worst sample over all steps.

    ``met`` only if every step met the floor; the smallest RMSE (and lower bound) over the steps,
    -1 when some step measured nothing (its RMSEs are NaN); the median over every finite sample
    RMSE; the largest noise; the total cost; the samples left out (``max_excluded``) and the samples
    guarded, over all steps; the steps, and those that met the floor with aimed noise (``AIMED_DEFENSES``: with
    ``auto``, the steps it did not send the Gaussian on). One report gives that step's own summary.
    """
    after = torch.cat([r.rmse_after for r in reports])
    after = after[torch.isfinite(after)]
    values = (
        float(min(float(r.met) for r in reports)), float(dropped),
        min(_worst(r.rmse_after) for r in reports),
        float(after.median()) if len(after) else -1.0,
        min(_worst(r.rmse_lb_after) for r in reports),
        max(r.noise_norm for r in reports), max(r.rel_noise for r in reports),
        sum(float(r.matvecs) for r in reports), sum(r.seconds for r in reports),
        float(sum(int(r.details.get("excluded", 0)) for r in reports)), float(sum(len(r.rmse_after) for r in reports)),
        float(len(reports)),
        float(sum(r.met and r.details.get("defense_used", r.defense) in AIMED_DEFENSES for r in reports)),
    )
    return dict(zip(METRIC_KEYS, values, strict=True))


@dataclass
class GuardOutput:
    """``gradient``: what may be uploaded, or None when the update must not leave the client."""

    gradient: torch.Tensor | None
    report: GuardReport
