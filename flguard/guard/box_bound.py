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
breakpoints r_p = e_p²/(|e_p|+s_p)², so its maximum is found exactly segment by segment. With no
saturated pixel F's maximum is (‖e‖ − R)², the 1-Lipschitz bound; saturation only raises it.

Every scale at once (``BoxProfile``): pixel p saturates at t_p = d_p/|Δ̃_p| (d_p its room in the box on the
side Δ̃_p points to); at scale c a pixel with t_p < c has |e_p| = d_p and |e_p| + s_p = c|Δ̃_p|, the others
|e_p| = |e_p| + s_p = c|Δ̃_p|. So r_p = min((t_p/c)², 1) keeps the order of t_p at every scale, and one sort
of the t's per sample gives every scale's segments: on the segment after the j first-saturating pixels
F(w) = D_j + w·c²S_j − R²w/(1 − w), D_j their Σd², S_j the others' ΣΔ̃², stationary at w = 1 − η/√S_j.
The guard asks this for dozens of scales per step (the solver's early stop, the fit's search, the
exclusion's grid): each is then a few elementwise passes, not a sort.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from flguard.risk.closed_forms import to_rmse

#: The dual's w stays at or below this (the largest float64 below 1): F(w)'s penalty R²w/(1 − w) stays finite.
_BELOW_ONE = 1.0 - 2.0 ** -53


class BoxProfile:
    """Samples' shifts ``shift`` [B, dx] from x in the box (``low``/``high`` broadcastable to x, which they
    contain) in the order their pixels saturate (module docstring), float64: each scale's clipped error,
    its certified lower bound and each sample's least reaching scale in a few elementwise passes."""

    def __init__(self, x: torch.Tensor, shift: torch.Tensor, low: torch.Tensor, high: torch.Tensor) -> None:
        x64, low64, high64 = flat64(x, low, high)
        step = shift.double()
        room = torch.where(step > 0, high64 - x64, x64 - low64)  # d_p ≥ 0: the box contains x
        size = step.abs()
        moving = size > 0
        saturates = torch.where(moving, room / torch.where(moving, size, torch.ones_like(size)),
                                torch.full_like(size, float("inf")))  # t_p; a still pixel never errs
        saturates, order = _sorted_rows(saturates)
        room2 = torch.where(torch.isfinite(saturates), room.gather(1, order).square(), torch.zeros_like(room))
        zero = room2.new_zeros(room2.shape[0], 1)
        self.saturates = saturates  # t_p ascending [B, dx]
        self.saturated = torch.cat([zero, room2.cumsum(1)], dim=1)  # [B, dx + 1]: D_j, Σd² of the first j
        self.free = torch.cat([size.gather(1, order).square().flip(1).cumsum(1).flip(1), zero], dim=1)  # S_j
        self.dx = shift.shape[1]
        self.inverse_root = 1.0 / self.free.sqrt().clamp_min(torch.finfo(self.free.dtype).tiny)  # 1/√S_j

    @classmethod
    def _of(cls, *tensors: torch.Tensor) -> BoxProfile:
        profile = cls.__new__(cls)
        profile.saturates, profile.saturated, profile.free, profile.inverse_root = tensors
        profile.dx = profile.saturates.shape[1]
        return profile

    def _tensors(self) -> tuple[torch.Tensor, ...]:
        return self.saturates, self.saturated, self.free, self.inverse_root

    def rows(self, index: torch.Tensor) -> BoxProfile:
        """The profile of the samples ``index`` (indices or a [B] mask)."""
        return BoxProfile._of(*(t[index] for t in self._tensors()))

    def replace(self, index: torch.Tensor, other: BoxProfile) -> None:
        """Rows ``index`` become ``other``'s (in order): the samples whose shift moved."""
        for mine, theirs in zip(self._tensors(), other._tensors()):
            mine[index] = theirs

    def certified_norms(self, scale: float | Sequence[float], radius: torch.Tensor) -> torch.Tensor:
        """[B] float64: √max_w F(w), a lower bound on ‖clip(x_i + scale·Δ_i) − x_i‖ over every exact shift Δ_i
        with ‖Δ_i − shift_i‖ ≤ ``radius`` [B] (per unit scale); [S, B] for a sequence of S scales, in one pass
        (the solver's early stop asks two at a time). The w's stay below 1 by an ulp (``_BELOW_ONE``): any w < 1
        bounds rigorously, and without a radius F(1) = ‖e‖² is lost only in the 16th digit."""
        batch, dx = self.saturates.shape
        scales = torch.as_tensor(scale, dtype=self.saturates.dtype, device=self.saturates.device)
        single, scales = scales.ndim == 0, scales.reshape(-1, 1, 1)  # [S, 1, 1]
        positive = scales > 0  # no noise: no error to certify
        scales = torch.where(positive, scales, torch.ones_like(scales))
        eta = radius.double().clamp_min(0.0).unsqueeze(1)
        ends = self.saturates.new_empty(scales.shape[0], batch, dx + 2)  # r_p in t_p's order between 0 and (almost) 1
        ends[..., 0], ends[..., -1] = 0.0, _BELOW_ONE
        ratio = torch.mul(self.saturates, 1.0 / scales, out=ends[..., 1:-1]).square_().clamp_max_(_BELOW_ONE)
        start, end = ends[..., :-1], ends[..., 1:]
        w = torch.clamp(1.0 - eta * self.inverse_root, min=start, max=end)  # the stationary point, clamped
        square = scales * scales
        value = self.saturated + w * (square * self.free - square * eta.square() / (1.0 - w))
        # after the first unsaturated pixel a segment's start is 1: no longer F (the last valid segment ends there)
        value[..., 1:].masked_fill_(ratio >= _BELOW_ONE, -float("inf"))
        norms = torch.where(positive.squeeze(2), value.max(dim=2).values.clamp_min(0.0).sqrt(), 0.0)
        return norms[0] if single else norms

    def certifies(self, scale: float | Sequence[float], radius: torch.Tensor, target: float) -> torch.Tensor:
        """[B] bool ([S, B] for S scales): whether ``certified_norms``' RMSE (÷√dx) reaches ``target``."""
        return to_rmse(self.certified_norms(scale, radius), self.dx) >= target

    def least_scales(self, target: float, limit: float) -> torch.Tensor:
        """[B] float64: per sample the least scale c ≤ ``limit`` at which ‖clip(x_i + c·shift_i) − x_i‖ (÷√dx)
        reaches ``target`` — the shift taken as exact (no radius); +inf where ``limit`` does not reach it.

        Exact: pixel p's clipped error is min(c·|s_p|, d_p), so between consecutive sorted t's the squared
        error is D + c²S: the segment where it first reaches the target is found from its values at the t's
        (nondecreasing), and c there in closed form."""
        dx, saturates = self.dx, self.saturates
        saturated, free = self.saturated[:, :-1], self.free[:, :-1]  # D before and S from each t_p
        need = target * target * dx
        at_breaks = saturated + torch.where(torch.isfinite(saturates), saturates.square() * free,
                                            torch.zeros_like(free))
        before = (at_breaks < need).sum(dim=1, keepdim=True)  # the first t_p where it is reached; dx: none is
        segment = before.clamp_max(dx - 1)
        scale = ((need - saturated.gather(1, segment)).clamp_min(0.0) / free.gather(1, segment)).sqrt().squeeze(1)
        inf = torch.full_like(scale, float("inf"))
        return torch.where((before.squeeze(1) < dx) & (scale <= limit), scale, inf)


def _sorted_rows(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(each row of ``values`` [B, n] ascending, the order taken): on a CPU by NumPy's ``argsort``, about 2.5× faster
    than ``torch.sort`` on the guard's [B, dx] float64 rows (x86-simd-sort; docs/results.md, "Patch gradients folded
    by one index_add"). Tied values may come in another order than ``torch.sort``'s: the profile is the same function
    (a tied pixel moved from S to D changes D + t²S by d² − t²Δ̃² = 0 at its own t)."""
    if values.device.type != "cpu":
        return values.sort(dim=1)
    order = torch.from_numpy(np.argsort(values.detach().numpy(), axis=1))
    return values.gather(1, order), order


def clipped_error_bound(x: torch.Tensor, shift: torch.Tensor, low: torch.Tensor, high: torch.Tensor,
                        scale: float, radius: torch.Tensor) -> torch.Tensor:
    """[B]: a lower bound on ‖clip(x_i + scale·Δ_i, low, high) − x_i‖ over every exact shift Δ_i with
    ‖Δ_i − shift_i‖ ≤ radius_i (``shift`` [B, dx], ``radius`` [B] per unit scale; ``low``/``high``
    broadcastable to x, which they contain). Computed in float64."""
    return BoxProfile(x, shift, low, high).certified_norms(scale, radius)


def certifies(x: torch.Tensor, shift: torch.Tensor, low: torch.Tensor, high: torch.Tensor, scale: float,
              radius: torch.Tensor, target: float) -> torch.Tensor:
    """[B] bool: whether ``clipped_error_bound``'s RMSE (÷√dx) reaches ``target`` — decided by the
    cheap bounds where they settle it (r̃ − R reaches it: yes; r̃ itself does not: no), the profile's
    sort run only on the other samples (a scale asked once; ``BoxProfile`` for many)."""
    dx = shift.shape[1]
    x64, low64, high64 = flat64(x, low, high)
    nominal = clipped_norms(x64, shift, low64, high64, scale)
    r = scale * radius.double().clamp_min(0.0)
    out = to_rmse(nominal - r, dx) >= target
    undecided = ~out & (to_rmse(nominal, dx) >= target)
    if bool(undecided.any()):
        rows = undecided.nonzero().squeeze(1)
        profile = BoxProfile(x64[rows], shift[rows], low64[rows], high64[rows])
        out[rows] = profile.certifies(scale, radius[rows], target)
    return out


def least_scales(x: torch.Tensor, shift: torch.Tensor, low: torch.Tensor, high: torch.Tensor, target: float,
                 limit: float) -> torch.Tensor:
    """[B] float64: ``BoxProfile.least_scales`` of these shifts."""
    return BoxProfile(x, shift, low, high).least_scales(target, limit)


def clipped_norms(x64: torch.Tensor, shift: torch.Tensor, low64: torch.Tensor, high64: torch.Tensor,
                  scale: float) -> torch.Tensor:
    """[B] float64: ‖clip(x_i + scale·shift_i, low, high) − x_i‖, the solved shift's clipped error itself, for x and
    the box as float64 rows [B, dx] (``flat64``)."""
    moved = x64 + scale * shift.double()
    return (torch.minimum(torch.maximum(moved, low64), high64) - x64).norm(dim=1)


def flat64(x: torch.Tensor, low: torch.Tensor, high: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """x and the box (broadcastable to x) as float64 rows [B, dx]."""
    batch = x.shape[0]
    return tuple(t.double().expand_as(x).reshape(batch, -1) for t in (x, low, high))
