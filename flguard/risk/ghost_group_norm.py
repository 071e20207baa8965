"""GroupNorm's normalisation in the batched K product, its second derivative in closed form.

Pass 1 of ``flguard.risk.ghost_products`` records the input gradient with its graph, and passes 2 and 3 differentiate
that graph once more. Through ``F.group_norm`` the recorded backward is PyTorch's twice-differentiable composite of
GroupNorm's backward, dozens of elementwise operations a layer, each of which passes 2 and 3 then differentiate again
(on a GPU each is a kernel launch). Here the normalisation n = (x − μ)·r, r = (σ² + ε)^(-1/2), per sample and group
of M entries, runs forward and backward on PyTorch's own kernels, and the backward's derivative is written out:

    backward:  x̄ = r·P_n ḡ,   P_n = I − 11ᵀ/M − nnᵀ/M   (symmetric, per group),

so for a cotangent c on x̄ its gradient in ḡ is r·P_n c — the same kernel — and its gradient in x, from
δn = r·P_n δx and δr = −r²⟨n, δx⟩/M, is

    −r²·[(a − 3pq)·n + q·ḡ + p·c − (q·mean ḡ + p·mean c)],
    a = mean(cḡ) − mean c·mean ḡ,  p = mean(ḡn),  q = mean(cn),

a few full-size passes a layer, with μ and r the forward pass's. Where a graph of it is asked for (a third
derivative: never on the guard's passes, which differentiate pass 1's graph once) μ and r are taken again from x in
differentiable operations, so that every order stays exact. Checked against PyTorch's composite (three orders) and
finite differences in ``tests/test_ghost_group_norm.py``. Measured (``benchmarks/bench_group_norm_passes.py``, one CPU
thread; docs/results.md, "GroupNorm's and GELU's second derivatives in closed form"): ResNet-18-GN's K product at
B = 8 in 4,101 operations at PyTorch's dispatcher instead of 4,711 and 0.95× the time, its graphs' build in 1,353
instead of 2,273.
"""

from __future__ import annotations

from typing import Any

import torch


def group_normalize(x: torch.Tensor, groups: int, eps: float) -> torch.Tensor:
    """``F.group_norm(x, groups, None, None, eps)`` (no affine map) for x [B, C, …], twice differentiable with the
    second derivative in closed form (module doc)."""
    return GroupNormalize.apply(x, groups, eps)


class GroupNormalize(torch.autograd.Function):
    """n = (x − μ)·r per sample and group, by ``torch.native_group_norm``; the backward is
    ``GroupNormalizeBackward``, itself differentiable."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, groups: int, eps: float) -> torch.Tensor:
        out, mean, rstd = torch.native_group_norm(x.contiguous(), None, None, x.shape[0], x.shape[1],
                                                  _positions(x), groups, eps)
        ctx.save_for_backward(x, mean, rstd)  # x as given: pass 1's backward differentiates through it
        ctx.groups, ctx.eps = groups, eps
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        x, mean, rstd = ctx.saved_tensors
        if not ctx.needs_input_grad[0]:
            return None, None, None
        return GroupNormalizeBackward.apply(grad, x, mean, rstd, ctx.groups, ctx.eps), None, None


class GroupNormalizeBackward(torch.autograd.Function):
    """x̄ = r·P_n ḡ (module doc) by ``native_group_norm_backward``; μ and r are x's, taken as constants here and
    differentiated in closed form in ``backward``."""

    @staticmethod
    def forward(ctx: Any, grad: torch.Tensor, x: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor,
                groups: int, eps: float) -> torch.Tensor:
        ctx.save_for_backward(grad, x, mean, rstd)
        ctx.groups, ctx.eps = groups, eps
        return _input_gradient(grad, x, mean, rstd, groups)

    @staticmethod
    def backward(ctx: Any, c: torch.Tensor) -> tuple:
        grad, x, mean, rstd = ctx.saved_tensors
        groups, eps = ctx.groups, ctx.eps
        graph = torch.is_grad_enabled()  # a graph of this derivative asked for: every term differentiable in x
        d_grad = None
        if ctx.needs_input_grad[0]:
            d_grad = (GroupNormalizeBackward.apply(c, x, mean, rstd, groups, eps) if graph
                      else _input_gradient(c, x, mean, rstd, groups))
        if not ctx.needs_input_grad[1]:
            return d_grad, None, None, None, None, None
        xs, gs, cs = (t.reshape(t.shape[0], groups, -1) for t in (x, grad, c))
        if graph:  # μ and r again, as functions of x
            mean = xs.mean(-1)
            rstd = ((xs - mean.unsqueeze(-1)).square().mean(-1) + eps).rsqrt()
        r = rstd.unsqueeze(-1)
        n = (xs - mean.unsqueeze(-1)) * r
        inverse = 1.0 / xs.shape[-1]
        g_mean, c_mean = gs.sum(-1, keepdim=True) * inverse, cs.sum(-1, keepdim=True) * inverse
        p = torch.linalg.vecdot(gs, n).unsqueeze(-1) * inverse
        q = torch.linalg.vecdot(cs, n).unsqueeze(-1) * inverse
        a = torch.linalg.vecdot(cs, gs).unsqueeze(-1) * inverse - g_mean * c_mean
        r2 = r * r
        along_n, shift = -r2 * (a - 3 * p * q), r2 * (q * g_mean + p * c_mean)
        d_x = torch.addcmul(gs * (-r2 * q), cs, -r2 * p)
        d_x = torch.addcmul(d_x, n, along_n) + shift if graph else d_x.addcmul_(n, along_n).add_(shift)
        return d_grad, d_x.reshape(x.shape), None, None, None, None


def _positions(x: torch.Tensor) -> int:
    """Entries per channel and sample (1 on [B, C])."""
    return x[0, 0].numel()


def _input_gradient(grad: torch.Tensor, x: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor,
                    groups: int) -> torch.Tensor:
    """r·P_n ḡ by PyTorch's GroupNorm backward kernel (which takes ḡ and x in one, contiguous, layout)."""
    return torch.ops.aten.native_group_norm_backward(grad.contiguous(), x.contiguous(), mean, rstd, None, x.shape[0],
                                                     x.shape[1], _positions(x), groups, [True, False, False])[0]
