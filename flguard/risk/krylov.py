"""Batched conjugate gradients for (K_i + ε_i I) b_i = r_i, with a guaranteed error bound.

For PSD K and ε > 0, ‖x − x*‖ ≤ ‖r‖ / ε (the smallest eigenvalue of K + εI is at least ε), so
stopping when ‖r‖/ε ≤ rtol‖x‖ bounds the solution's *relative error* by rtol — not just the
residual. With ε = 0 (only meaningful when the right-hand side lies in K's range, as J_iδ does)
the test falls back to ‖r‖ ≤ rtol‖b‖ and at most n iterations.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

Matvec = Callable[[torch.Tensor], torch.Tensor]


@dataclass
class CGResult:
    solution: torch.Tensor
    converged: torch.Tensor
    iterations: int
    matvecs: int


def conjugate_gradient(matvec: Matvec, rhs: torch.Tensor, shift: torch.Tensor, *, rtol: float = 1e-3,
                       max_iter: int | None = None) -> CGResult:
    """Solve (A_i + shift_i I) x_i = rhs_i for every sample i; ``rhs`` [B, n], ``shift`` [B]."""
    batch, dim = rhs.shape
    limit = dim if max_iter is None else max_iter
    x = torch.zeros_like(rhs)
    r = rhs.clone()
    p = r.clone()
    rr = (r * r).sum(1)
    rhs_norm = rhs.norm(dim=1)
    active = rhs_norm > 0
    converged = ~active
    tiny = torch.finfo(rhs.dtype).tiny
    iterations = 0
    for iterations in range(1, limit + 1):
        ap = matvec(p) + shift.unsqueeze(1) * p
        step = rr / (p * ap).sum(1).clamp_min(tiny)
        step = torch.where(active, step, torch.zeros_like(step))
        x = x + step.unsqueeze(1) * p
        r = r - step.unsqueeze(1) * ap
        rr_new = (r * r).sum(1)
        residual = rr_new.sqrt()
        bounded = torch.where(shift > 0, residual / shift.clamp_min(tiny) <= rtol * x.norm(dim=1),
                              residual <= rtol * rhs_norm)
        converged = converged | (active & bounded)
        active = active & ~bounded
        if not bool(active.any()):
            break
        p = r + (rr_new / rr.clamp_min(tiny)).unsqueeze(1) * p
        rr = rr_new
    return CGResult(x, converged, iterations, iterations)
