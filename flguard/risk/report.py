"""``RiskReport``: per-sample leakage metrics, one tensor of shape [B] per field."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import torch

# Field names a caller may request through ``assess(metrics=...)``.
METRIC_NAMES = ("grad_norm", "lambda_max", "lambda_min", "jacobian_fro2", "lavp_cos_max", "lavp_cos_min",
                "lavp_fusion", "i2f", "i2f_lb", "rmse_i2f", "rmse_i2f_lb")
DELTA_METRICS = ("i2f", "i2f_lb", "rmse_i2f", "rmse_i2f_lb")


@dataclass
class RiskReport:
    """Per-sample worst-case leakage of one batch (see docs/risk.md for each number's meaning).

    Unrequested or inapplicable fields are ``None``. ``converged`` is False for a sample whose
    solver hit its iteration limit before its tolerance; ``matvecs`` counts Jacobian
    applications per sample (products on part of the batch count their share of it); ``path`` says which operator path ran (``per-sample``/``coupled``).
    """

    grad_norm: torch.Tensor | None = None
    lambda_max: torch.Tensor | None = None
    lambda_min: torch.Tensor | None = None
    jacobian_fro2: torch.Tensor | None = None
    lavp_cos_max: torch.Tensor | None = None
    lavp_cos_min: torch.Tensor | None = None
    lavp_fusion: torch.Tensor | None = None
    i2f: torch.Tensor | None = None
    i2f_lb: torch.Tensor | None = None
    rmse_i2f: torch.Tensor | None = None
    rmse_i2f_lb: torch.Tensor | None = None
    eps: torch.Tensor | None = None
    converged: torch.Tensor | None = None
    matvecs: float = 0
    seconds: float = 0.0
    path: str = ""
    details: dict = field(default_factory=dict)

    def metrics(self) -> dict[str, torch.Tensor]:
        """The computed per-sample fields, by name."""
        return {f.name: getattr(self, f.name) for f in fields(self)
                if f.name in METRIC_NAMES + ("eps",) and getattr(self, f.name) is not None}

    def rows(self) -> list[dict[str, float]]:
        """One dict per sample (for tables and CSV)."""
        columns = {name: value.detach().cpu().tolist() for name, value in self.metrics().items()}
        size = len(next(iter(columns.values()))) if columns else 0
        return [{name: values[i] for name, values in columns.items()} for i in range(size)]
