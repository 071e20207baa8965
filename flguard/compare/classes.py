"""Per-class risk of the comparison's task: which classes leak most before any defense.

The task's initial model (the same seed every run starts from) is assessed on a few samples per
class: gradient norm, λmax (exact, Lanczos) and ‖J‖_F (Hutchinson, deflated by that Lanczos basis). ``sigma_for_tau`` is the homogeneous Gaussian σ that puts
the class's median sample exactly at the floor τ in a one-sample update, by the lower-bound closed form
(E[I_lb²] = σ²‖J‖²_F/λmax², RMSE = I/√dx): classes that need a larger σ leak more, and a single
σ for everybody protects them unequally (I²F §5.2) — the guard's per-sample floor does not.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

import torch

from flguard.compare.config import CompareConfig
from flguard.compare.tables import tau_of, write_csv
from flguard.simulation import task
from flguard.risk.closed_forms import sigma_for_i2f_lb, unit_noise_i2f_lb
from flguard.risk.lanczos import LanczosResult
from flguard.risk.operator import JacobianOperator
from flguard.risk.regularised import RegularisedK
from flguard.risk.trace import hutchinson

CLASS_COLUMNS = ("class", "label", "samples", "grad_norm", "lambda_max", "i2f_lb_unit", "sigma_for_tau")


def hutchinson_fro2(op: JacobianOperator, probes: int, generator: torch.Generator,
                   spectrum: LanczosResult | None = None) -> torch.Tensor:
    """‖J_i‖²_F = E‖J_iᵀz‖², Hutchinson (``flguard.risk.trace.hutchinson``) with exactly ``probes``
    Rademacher draws from ``generator``; with ``spectrum`` (a Lanczos run of K_i with its basis Q) the
    probes are deflated by Q and tr(QᵀKQ), the Ritz values' sum, is added exactly.

    An estimate (relative std ≤ √(2/probes) per sample without deflation, far less with it: the basis
    holds K's dominant directions); the exact trace needs dx products, too slow for a report's side figure.
    """
    basis = None if spectrum is None else spectrum.basis
    basis_trace = None if spectrum is None else spectrum.ritz_values.sum(dim=1)
    return hutchinson(op.jt, op.batch_size, op.dx, like=op.x, basis=basis, basis_trace=basis_trace, rtol=0.0,
                      probes=probes, max_probes=probes, generator=generator)[0]


def class_risk(config: CompareConfig, *, per_class: int = 4, batch_size: int = 8,
               probes: int = 16) -> list[dict[str, Any]]:
    """Median risk metrics per class at the initial model (``per_class`` samples each)."""
    settings = task.TaskSettings.from_config(config.run_config(config.defenses[0]))
    data = task.load_dataset(settings.dataset)
    model = task.make_model(settings).eval()
    generator = torch.Generator().manual_seed(config.seed)
    picks = torch.cat([torch.nonzero(data.labels == c).view(-1)[
        torch.randperm(int((data.labels == c).sum()), generator=generator)[:per_class]]
        for c in range(data.num_classes)])
    dx = data.images[0].numel()
    values: dict[int, list[tuple[float, float, float]]] = {}
    for start in range(0, len(picks), batch_size):
        index = picks[start:start + batch_size]
        x, y = data.normalize(data.images[index]), data.labels[index]
        op = JacobianOperator(model, x, y)
        spectrum = RegularisedK(op).lanczos(rtol=1e-3, ends="max", seed=config.seed)  # λmax and the deflation basis
        grad_norm, lambda_max = op.per_sample_gradients().norm(dim=1), spectrum.lambda_max
        fro2 = hutchinson_fro2(op, probes, generator, spectrum)
        # J_i of a mean loss over B samples is J̃_i/B, so λmax = λ̃max/B² and ‖J‖_F/λmax = B·‖J̃‖_F/λ̃max:
        # undo it to get each sample's one-sample-update figures (the demo's victims upload one sample).
        unit = unit_noise_i2f_lb(fro2, lambda_max) / len(index)
        for k, sample in enumerate(index.tolist()):
            values.setdefault(int(data.labels[sample]), []).append(
                (float(grad_norm[k]), float(lambda_max[k]) * len(index) ** 2, float(unit[k])))
    tau = max((tau_of(config, d.name) or 0.0) for d in config.defenses) or None
    rows = []
    for label in sorted(values):
        grad, lam, unit = (statistics.median(v) for v in zip(*values[label]))
        rows.append({"class": data.classes[label] if label < len(data.classes) else str(label), "label": label,
                     "samples": len(values[label]), "grad_norm": grad, "lambda_max": lam, "i2f_lb_unit": unit,
                     "sigma_for_tau": sigma_for_i2f_lb(tau, unit, dx) if tau and unit > 0 else None})
    return rows


def write_class_risk(config: CompareConfig, out: Path, **kwargs: Any) -> Path:
    """Write ``classes.csv`` (see ``class_risk``)."""
    return write_csv(Path(out) / "classes.csv", CLASS_COLUMNS, class_risk(config, **kwargs))
