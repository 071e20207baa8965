"""Dataset audits: per-sample leakage risk of a model on real data, per class and per initialisation.

The numbers a user needs before choosing a defense: who leaks most (λmax), what homogeneous
Gaussian noise of scale σ would leave of each sample's protection (the I2F lower-bound closed
form), and how unequal that protection is across classes (I2F §5.2) and initialisations (§5.3).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

import torch

from flguard.data import load
from flguard.models import create
from flguard.risk import assess
from flguard.risk.closed_forms import to_rmse, unit_noise_i2f_lb

AUDIT_METRICS = ("grad_norm", "lambda_max", "lambda_min", "jacobian_fro2", "lavp_cos_max", "lavp_cos_min",
                 "lavp_fusion")


@dataclass
class AuditRow:
    init: str
    index: int
    label: str
    values: dict[str, float]


def audit(model_name: str, dataset: str, *, samples: int = 64, inits: Iterable[str] = ("uniform",),
          sigma: float = 1e-2, batch_size: int = 16, seed: int = 0, rtol: float = 1e-3,
          on_batch: Callable[[int], None] | None = None) -> list[AuditRow]:
    """Assess ``samples`` random samples of ``dataset`` under ``model_name`` for each init.

    Adds to every row ``i2f_lb_unit`` (‖J‖_F/λmax) and ``pred_rmse`` — the lower-bound RMSE
    σ‖J‖_F/(λmax√dx) that homogeneous Gaussian noise of scale ``sigma`` would give, in model-input
    units (multiply by the dataset's std for pixels). ``on_batch(n)`` reports progress.
    """
    data = load(dataset)
    channels, size, _ = data.shape
    order = torch.randperm(len(data), generator=torch.Generator().manual_seed(seed))[:samples]
    rows: list[AuditRow] = []
    for init in inits:
        torch.manual_seed(seed)
        model = create(model_name, in_channels=channels, num_classes=data.num_classes, image_size=size,
                       init=init).eval()
        for start in range(0, len(order), batch_size):
            index = order[start:start + batch_size]
            rep = assess(model, data.normalize(data.images[index]), data.labels[index], metrics=AUDIT_METRICS,
                         rtol=rtol, seed=seed)
            unit = unit_noise_i2f_lb(rep.jacobian_fro2, rep.lambda_max)
            extra = {"i2f_lb_unit": unit, "pred_rmse": to_rmse(sigma * unit, data.images[0].numel())}
            for k, sample in enumerate(index.tolist()):
                values = {name: float(v[k]) for name, v in {**rep.metrics(), **extra}.items()}
                rows.append(AuditRow(init, sample, data.classes[int(data.labels[sample])], values))
            if on_batch:
                on_batch(len(index))
    return rows


def summarize(rows: list[AuditRow], key: Callable[[AuditRow], str]) -> list[dict[str, float | str]]:
    """Per-group medians and the spread of predicted protection (max/min predicted RMSE)."""
    groups: dict[str, list[AuditRow]] = {}
    for row in rows:
        groups.setdefault(key(row), []).append(row)
    table = []
    for name, members in groups.items():
        def column(metric: str) -> torch.Tensor:
            return torch.tensor([m.values[metric] for m in members])
        rmse = column("pred_rmse")
        table.append({"group": name, "n": len(members), "lambda_max_median": float(column("lambda_max").median()),
                      "grad_norm_median": float(column("grad_norm").median()),
                      "pred_rmse_median": float(rmse.median()), "pred_rmse_min": float(rmse.min()),
                      "pred_rmse_spread": float(rmse.max() / rmse.min().clamp_min(1e-30))})
    return table
