"""A certified lower bound on the box-clipped recovery error when the predicted shift is known only
within a radius: the guard's certificate with ``input_bounds``.

The attacker's predicted error for sample i at noise scale c is e(Δ) = clip(x + cΔ, low, high) − x,
with Δ = (K_i+εI)⁻¹J_iδ I²F's exact shift. The solver gives Δ̃ with ‖Δ̃ − Δ‖ ≤ η (its verified error
bound), so the exact shift is c·Δ̃ + d for some unknown d with ‖d‖ ≤ R = c·η. Clip being 1-Lipschitz
gives ‖e(Δ)‖ ≥ ‖e(Δ̃)‖ − R; that is tight only if every pixel can absorb the perturbation. A pixel
whose predicted value lies a distance s_p outside the box is saturated: moving it back by up to s_p
changes nothing, and reducing its error by a_p costs |d_p| ≥ s_p + a_p. So the exact error is at least

    min Σ_p (|e_p| − a_p)²   over   0 ≤ a_p ≤ |e_p|,   Σ_{p: a_p > 0} (s_p + a_p)² ≤ R²,

and for every λ ≥ 0 weak duality bounds that from below, pixel by pixel (the inner minimum over a_p
taken unconstrained, which can only lower it), with w = λ/(1+λ) ∈ [0, 1):

    F(w) = Σ_p min(e_p², w·(|e_p| + s_p)²) − R²·w/(1 − w).

Any w gives a rigorous bound; F is concave (a dual function), and piecewise smooth between the
breakpoints r_p = e_p²/(|e_p|+s_p)², so its maximum is found exactly from one sort per sample. With
no saturated pixel F's maximum is (‖e‖ − R)², the 1-Lipschitz bound; saturation only raises it.
"""

from __future__ import annotations

import torch

from flguard.risk.closed_forms import to_rmse


def clipped_error_bound(x: torch.Tensor, shift: torch.Tensor, low: torch.Tensor, high: torch.Tensor,
                        scale: float, radius: torch.Tensor) -> torch.Tensor:
    """[B]: a lower bound on ‖clip(x_i + scale·Δ_i, low, high) − x_i‖ over every exact shift Δ_i with
    ‖Δ_i − shift_i‖ ≤ radius_i (``shift`` [B, dx], ``radius`` [B] per unit scale; ``low``/``high``
    broadcastable to x, which they contain). Computed in float64."""
    error, beyond = _errors(x, shift, low, high, scale)
    return error_bound_from_saturation(error, beyond, scale * radius.double().clamp_min(0.0))


def certifies(x: torch.Tensor, shift: torch.Tensor, low: torch.Tensor, high: torch.Tensor, scale: float,
              radius: torch.Tensor, target: float) -> torch.Tensor:
    """[B] bool: whether ``clipped_error_bound``'s RMSE (÷√dx) reaches ``target`` — decided by the
    cheap bounds where they settle it (r̃ − R reaches it: yes; r̃ itself does not: no), the dual's
    sort run only on the other samples (the floor asks this for dozens of scales per step)."""
    dx = shift.shape[1]
    error, beyond = _errors(x, shift, low, high, scale)
    r = scale * radius.double().clamp_min(0.0)
    nominal = error.norm(dim=1)
    out = to_rmse(nominal - r, dx) >= target
    undecided = ~out & (to_rmse(nominal, dx) >= target)
    if bool(undecided.any()):
        out[undecided] = to_rmse(error_bound_from_saturation(error[undecided], beyond[undecided], r[undecided]), dx) >= target
    return out


def least_scales(x: torch.Tensor, shift: torch.Tensor, low: torch.Tensor, high: torch.Tensor, target: float,
                 limit: float) -> torch.Tensor:
    """[B] float64: per sample the least scale c ≤ ``limit`` at which ‖clip(x_i + c·shift_i) − x_i‖ (÷√dx)
    reaches ``target`` — the shift taken as exact (no radius); +inf where ``limit`` does not reach it.

    Exact, from one sort per sample: pixel p's clipped error is min(c·|s_p|, d_p), d_p the distance from x_p to
    the box's side that s_p points to, so it saturates at t_p = d_p/|s_p|, and between consecutive sorted t's
    the squared error is D + c²S (D the saturated pixels' d², S the others' s²): the segment where it first
    reaches the target is found from its values at the t's (nondecreasing), and c there in closed form."""
    dx = shift.shape[1]
    x64, low64, high64 = _flat64(x, low, high)
    step = shift.double()
    room = torch.where(step > 0, high64 - x64, x64 - low64)  # d_p ≥ 0: the box contains x
    size = step.abs()
    moving = size > 0
    saturates = torch.where(moving, room / torch.where(moving, size, torch.ones_like(size)),
                            torch.full_like(size, float("inf")))  # t_p; a still pixel never errs
    saturates, order = saturates.sort(dim=1)
    room2, size2 = room.gather(1, order).square(), size.gather(1, order).square()
    room2 = torch.where(torch.isfinite(saturates), room2, torch.zeros_like(room2))
    saturated = torch.cumsum(room2, dim=1) - room2  # D before each t_p: the pixels that saturate below it
    free = size2.flip(1).cumsum(1).flip(1)  # S from each t_p on: the pixels that saturate at or above it
    need = target * target * dx
    at_breaks = saturated + torch.where(torch.isfinite(saturates), saturates.square() * free, torch.zeros_like(free))
    before = (at_breaks < need).sum(dim=1, keepdim=True)  # the first t_p where it is reached; dx: none is
    segment = before.clamp_max(dx - 1)
    scale = ((need - saturated.gather(1, segment)).clamp_min(0.0) / free.gather(1, segment)).sqrt().squeeze(1)
    inf = torch.full_like(scale, float("inf"))
    return torch.where((before.squeeze(1) < dx) & (scale <= limit), scale, inf)


def _errors(x: torch.Tensor, shift: torch.Tensor, low: torch.Tensor, high: torch.Tensor,
            scale: float | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(|clip(x + scale·shift) − x|, the distance of x + scale·shift outside the box) per pixel [B, dx], float64;
    ``scale`` one number or one per sample [B, 1]."""
    x64, low64, high64 = _flat64(x, low, high)
    moved = x64 + scale * shift.double()
    inside = torch.minimum(torch.maximum(moved, low64), high64)
    return (inside - x64).abs(), (moved - inside).abs()


def _flat64(x: torch.Tensor, low: torch.Tensor, high: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """x and the box (broadcastable to x) as float64 rows [B, dx]."""
    batch = x.shape[0]
    return tuple(t.double().expand_as(x).reshape(batch, -1) for t in (x, low, high))


def error_bound_from_saturation(error: torch.Tensor, beyond: torch.Tensor, radius: torch.Tensor) -> torch.Tensor:
    """[B]: √max_w F(w) (module docstring) for per-pixel errors |e_p| = ``error`` [B, n], distances
    outside the box s_p = ``beyond`` [B, n] and perturbation radii R = ``radius`` [B]."""
    a = error.square()
    k = (error + beyond).square()
    ratio = torch.where(k > 0, a / k.clamp_min(torch.finfo(k.dtype).tiny), torch.ones_like(k))  # r_p ∈ [0, 1]
    ratio, order = ratio.sort(dim=1)
    a, k = a.gather(1, order), k.gather(1, order)
    zero = a.new_zeros(a.shape[0], 1)
    below = torch.cat([zero, a.cumsum(1)], dim=1)  # Σ a_p over the j pixels with the smallest r_p
    above = torch.cat([k.flip(1).cumsum(1).flip(1), zero], dim=1)  # Σ k_p over the others
    start = torch.cat([zero, ratio], dim=1)  # segment j: w ∈ [r_(j), r_(j+1)], r_(0) = 0, r_(n+1) = 1
    end = torch.cat([ratio, torch.ones_like(zero)], dim=1)
    rad = radius.unsqueeze(1)
    # F' = S_j − R²/(1 − w)² on segment j: stationary at w = 1 − R/√S_j, clamped to the segment
    stationary = 1.0 - rad / above.sqrt().clamp_min(torch.finfo(a.dtype).tiny)
    w = torch.minimum(torch.maximum(stationary, start), end)
    penalty = torch.where(w < 1.0, rad.square() * w / (1.0 - w).clamp_min(torch.finfo(a.dtype).tiny),
                          torch.where(rad > 0, torch.full_like(w, float("inf")), torch.zeros_like(w)))
    value = w * above + below - penalty
    return value.max(dim=1).values.clamp_min(0.0).sqrt()
