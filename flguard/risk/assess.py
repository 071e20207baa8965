"""``assess``: every per-sample leakage metric of one batch from one Jacobian operator.

Work is shared: a single Lanczos run on K_i = J_iJ_iᵀ gives λmax and λmin (and the basis the
trace estimator deflates with); one on LAVP's H_cos,i gives both of its ends; I2F is one batched
CG solve. Only what the requested ``metrics`` need is computed.
"""

from __future__ import annotations

import time
from typing import Iterable

import torch
from torch import nn

from flguard.risk.closed_forms import i2f_lower_bound, to_rmse
from flguard.risk.defaults import DEFAULT_EPS_RELATIVE
from flguard.risk.lanczos import LanczosResult, lanczos
from flguard.risk.krylov import Sufficient
from flguard.risk.clipped import Jacobian
from flguard.risk.operator import JacobianOperator, LossFn
from flguard.risk.regularised import RegularisedK
from flguard.risk.report import DELTA_METRICS, METRIC_NAMES, RiskReport
from flguard.risk.trace import exact_trace, hutchinson
#: Input dimension up to which tr(K_i) is computed exactly (dx products, in blocks of 64); above
#: it, deflated Hutchinson. Measured on LeNet/MNIST (dx = 784): exact took less time than the 256
#: probes Hutchinson needed for ~0.3% error, because blocks of unit vectors batch well.
EXACT_TRACE_MAX_DIM = 1024
#: Target standard error of the Hutchinson trace, relative (≈ 3σ ≤ 1%); a sample that misses it is
#: reported as not converged.
TRACE_RTOL = 3e-3

_NEEDS_K = {"lambda_max", "lambda_min", "lavp_fusion", "i2f_lb", "rmse_i2f_lb", "jacobian_fro2"}
_NEEDS_COS = {"lavp_cos_max", "lavp_cos_min", "lavp_fusion"}


def _resolve_metrics(metrics: Iterable[str] | None, delta: torch.Tensor | None) -> set[str]:
    if metrics is None:
        wanted = set(METRIC_NAMES) - (set() if delta is not None else set(DELTA_METRICS))
    else:
        wanted = set(metrics)
        unknown = wanted - set(METRIC_NAMES)
        if unknown:
            raise ValueError(f"metrics={sorted(unknown)} are unknown; choose from {', '.join(METRIC_NAMES)}")
        if wanted & set(DELTA_METRICS) and delta is None:
            raise ValueError(f"metrics {sorted(wanted & set(DELTA_METRICS))} need delta (a perturbation of the gradient)")
    return wanted


def _k_operator_lanczos(op: JacobianOperator, wanted: set[str], rtol: float, seed: int) -> LanczosResult:
    ends = "both" if "lambda_min" in wanted else "max"
    return RegularisedK(op).lanczos(rtol=rtol, ends=ends, seed=seed)


def _cos_hessian_lanczos(op: JacobianOperator, rtol: float, seed: int) -> LanczosResult:
    """Both ends of H_cos,i = J_i (I − ĝĝᵀ) J_iᵀ / ‖g‖² (LAVP Thm. 4), g the batch gradient."""
    g = op.batch_gradient()
    g_norm2 = (g * g).sum().clamp_min(torch.finfo(g.dtype).tiny)
    g_hat = g / g_norm2.sqrt()

    def matvec(q: torch.Tensor) -> torch.Tensor:
        w = op.jt(q.unsqueeze(1)).squeeze(1)
        w = w - (w @ g_hat).unsqueeze(1) * g_hat
        return op.j(w.unsqueeze(1)).squeeze(1) / g_norm2

    return lanczos(matvec, op.batch_size, op.dx, like=op.x, rtol=rtol, ends="both", seed=seed + 1)


def resolve_eps(eps: float | torch.Tensor | None, lambda_max: torch.Tensor | None, batch: int,
                like: torch.Tensor) -> torch.Tensor:
    """The absolute ε per sample: given (scalar or [B]) or DEFAULT_EPS_RELATIVE · λmax."""
    if eps is None:
        if lambda_max is None:
            raise ValueError("eps=None needs lambda_max (the default ε is relative to it)")
        return DEFAULT_EPS_RELATIVE * lambda_max
    value = torch.as_tensor(eps, dtype=like.dtype, device=like.device)
    if value.ndim == 0:
        value = value.expand(batch)
    if value.shape != (batch,) or bool((value < 0).any()) or not bool(torch.isfinite(value).all()):
        raise ValueError(f"eps must be a non-negative finite scalar or a tensor of shape [{batch}]")
    return value.clone()


def assess(model: nn.Module, x: torch.Tensor, y: torch.Tensor, *, loss_fn: LossFn | None = None,
           delta: torch.Tensor | None = None, eps: float | torch.Tensor | None = None, rtol: float = 1e-3,
           metrics: Iterable[str] | None = None, seed: int = 0, coupled: bool | None = None) -> RiskReport:
    """Per-sample leakage metrics of batch ``(x, y)`` under ``model`` (see ``RiskReport``).

    ``delta`` [dθ] is a perturbation of the shared gradient (trainable parameters in
    ``model.parameters()`` order); with it, I2F ‖(K_i+εI)⁻¹J_iδ‖ and its lower bound
    ‖J_iδ‖/λmax are reported, and their RMSEs (divided by √dx). ``eps`` is the absolute Tikhonov ε
    (scalar or [B]); ``None`` means DEFAULT_EPS_RELATIVE · λmax per sample.
    """
    start = time.perf_counter()
    wanted = _resolve_metrics(metrics, delta)
    op = JacobianOperator(model, x, y, loss_fn, coupled=coupled)
    if delta is not None and (delta.ndim != 1 or delta.numel() != op.dtheta):
        raise ValueError(f"delta must be a flat tensor of {op.dtheta} entries (the trainable parameters), "
                         f"got shape {tuple(delta.shape)}")
    need_k = bool(wanted & _NEEDS_K) or ({"i2f", "rmse_i2f"} & wanted and eps is None)
    report = RiskReport(path="coupled" if op.coupled else "per-sample")
    converged = torch.ones(op.batch_size, dtype=torch.bool, device=op.device)
    if "grad_norm" in wanted:
        report.grad_norm = op.per_sample_gradients().norm(dim=1)
    k_result = _k_operator_lanczos(op, wanted, rtol, seed) if need_k else None
    if k_result is not None:
        converged &= k_result.converged
        report.lambda_max = k_result.lambda_max
        report.details["lanczos_iterations"] = k_result.iterations
        if "lambda_min" in wanted:
            report.lambda_min = k_result.lambda_min.clamp_min(0)
    if wanted & _NEEDS_COS:
        cos_result = _cos_hessian_lanczos(op, rtol, seed)
        converged &= cos_result.converged
        report.lavp_cos_max = cos_result.lambda_max
        report.lavp_cos_min = cos_result.lambda_min.clamp_min(0)
        if "lavp_fusion" in wanted:
            report.lavp_fusion = (k_result.lambda_max * report.lavp_cos_min).sqrt()
        report.lavp_cos_max = report.lavp_cos_max if "lavp_cos_max" in wanted else None
        report.lavp_cos_min = report.lavp_cos_min if "lavp_cos_min" in wanted else None
    if "jacobian_fro2" in wanted:
        if op.dx <= EXACT_TRACE_MAX_DIM:
            report.jacobian_fro2 = exact_trace(op.jt, op.batch_size, op.dx, like=op.x)
        else:
            basis_trace = k_result.ritz_values.sum(dim=1)
            report.jacobian_fro2, probes, stderr = hutchinson(op.jt, op.batch_size, op.dx, like=op.x,
                                                              basis=k_result.basis, basis_trace=basis_trace,
                                                              rtol=TRACE_RTOL, seed=seed + 2)
            converged &= stderr <= TRACE_RTOL * report.jacobian_fro2
            report.details.update(hutchinson_probes=probes, jacobian_fro2_stderr=stderr)
    if delta is not None:
        _i2f(op, report, wanted, delta.to(op.x), eps, rtol, converged)
    if "lambda_max" not in wanted:
        report.lambda_max = None
    report.converged = converged
    report.matvecs = op.applications
    report.seconds = time.perf_counter() - start
    return report


def jacobian_product(op: Jacobian, delta: torch.Tensor) -> torch.Tensor:
    """J_iδ per sample [B, dx] for a shared ``delta`` [dθ] or one per sample [B, dθ]: the input-space
    image of a perturbation (its norm is the numerator of I2F's lower bound)."""
    per_sample = delta.expand(op.batch_size, -1) if delta.ndim == 1 else delta
    return op.j(per_sample.unsqueeze(1)).squeeze(1)


def i2f_solve(op: Jacobian, delta: torch.Tensor, eps: torch.Tensor, rtol: float,
              ritz: tuple[torch.Tensor, torch.Tensor] | None = None,
              max_iter: int | None = None, sufficient: Sufficient | None = None,
              start: LanczosResult | None = None, deflate: bool = True) -> tuple[torch.Tensor, ...]:
    """((K_i+ε_iI)⁻¹J_iδ [B, dx], ‖J_iδ‖, converged, error bound) per sample — I2F's definition, written once.

    The solution is the predicted shift of sample i's best reconstruction (model-input units); the
    error bound is the solver's: with ``ritz`` the radius ‖r‖/(2ε) of the ball around the solution that the true
    residual of PCG's iterate gives (``flguard.risk.krylov.residual_ball``); otherwise plain CG's ‖r‖/ε on its
    recurrence residual, which its converged samples keep ≤ rtol‖x‖.
    ``delta`` is shared [dθ] or per sample [B, dθ]; the CG stops on the error bound ‖r‖/ε.
    ``ritz``: Ritz pairs of K_i (values [B, k], vectors [B, k, dx]) to precondition with; the stop
    is then on the true residual (``flguard.risk.krylov.preconditioned_cg``). ``max_iter`` caps each
    sample's iterations (default: the input size); a sample that reaches it is not converged.
    ``sufficient``: the caller's early stop with ``ritz`` (``flguard.risk.krylov.Sufficient``); ``start``: with
    ``ritz``, a Lanczos run on K_i to start from and, with ``deflate``, to deflate (``RegularisedK.solve``).
    """
    b = jacobian_product(op, delta)
    solved = RegularisedK(op, eps).solve(b, rtol=rtol, ritz=ritz, max_iter=max_iter, sufficient=sufficient,
                                         start=start, deflate=deflate)
    bound = solved.error_bound if solved.error_bound is not None else rtol * solved.solution.norm(dim=1)
    return solved.solution, b.norm(dim=1), solved.converged, bound


def i2f_solve_with_lambda_max(op: Jacobian, delta: torch.Tensor, eps: float, relative: bool, rtol: float,
                              seed: int = 0, max_iter: int | None = None,
                              skip: torch.Tensor | None = None,
                              sufficient: Sufficient | None = None) -> tuple[torch.Tensor, ...]:
    """``i2f_solve`` with ε_i = eps·λmax_i (``relative``) or eps set by the same run: one Lanczos run
    per sample started at J_iδ gives λmax and the solve (``flguard.risk.lanczos_solve``) — for a δ
    that does not depend on K's spectrum. Returns (shift [B, dx], ‖J_iδ‖, converged, λmax, ε,
    λmax converged, error bound ‖r‖/(2ε) on the true residual, ``residual_ball``); converged: λmax's test
    and that bound ≤ rtol‖shift‖. ``skip``: samples left unsolved (shift 0, not converged); ``sufficient``:
    the caller's early stop (``flguard.risk.krylov.Sufficient``)."""
    b = jacobian_product(op, delta)
    run = RegularisedK(op).solve_with_lambda_max(b, eps, relative=relative, rtol=rtol, seed=seed, max_iter=max_iter,
                                                 skip=skip, sufficient=sufficient)
    return run.solution, b.norm(dim=1), run.converged, run.lambda_max, run.eps, run.lambda_converged, run.error_bound


def i2f_norms(op: Jacobian, delta: torch.Tensor, eps: torch.Tensor, rtol: float) -> tuple[torch.Tensor, ...]:
    """(‖(K_i+ε_iI)⁻¹J_iδ‖, ‖J_iδ‖, converged) per sample (see ``i2f_solve``)."""
    shift, jd_norm, converged, _ = i2f_solve(op, delta, eps, rtol)
    return shift.norm(dim=1), jd_norm, converged


def _i2f(op: JacobianOperator, report: RiskReport, wanted: set[str], delta: torch.Tensor,
         eps: float | torch.Tensor | None, rtol: float, converged: torch.Tensor) -> None:
    """I2F = ‖(K_i+εI)⁻¹ J_iδ‖ by CG, and the bound ‖J_iδ‖/λmax; RMSEs divide by √dx."""
    if {"i2f", "rmse_i2f"} & wanted:
        report.eps = resolve_eps(eps, report.lambda_max, op.batch_size, op.x)
        report.i2f, jd_norm, solved = i2f_norms(op, delta, report.eps, rtol)
        converged &= solved
        report.rmse_i2f = to_rmse(report.i2f, op.dx)
    else:
        jd_norm = jacobian_product(op, delta).norm(dim=1)
    if {"i2f_lb", "rmse_i2f_lb"} & wanted:
        report.i2f_lb = i2f_lower_bound(jd_norm, report.lambda_max)
        report.rmse_i2f_lb = to_rmse(report.i2f_lb, op.dx)
    for name in DELTA_METRICS:
        if name not in wanted:
            setattr(report, name, None)
