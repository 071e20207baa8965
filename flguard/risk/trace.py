"""tr(K_i) = ‖J_i‖²_F: exact from dx products, or Hutchinson deflated by a Lanczos basis.

Exact: Σ_j ‖J_iᵀ e_j‖² over the dx unit vectors (in chunks). Estimated: with the orthonormal
Lanczos basis Q_i already built for λmax, tr(K) = tr(QᵀKQ) + tr(PKP) with P = I − QQᵀ; the first
term is Σ of the Ritz values (free), the second is estimated by Rademacher probes projected by
P. Because Q captures the dominant eigen-directions, the remainder is small and the estimate
tight (the idea of Hutch++). Without a basis the same estimator is plain Hutchinson.
"""

from __future__ import annotations

from typing import Callable

import torch

Transpose = Callable[[torch.Tensor], torch.Tensor]  # u [B, k, dx] -> J_iᵀ u [B, k, dθ]

#: The products J_iᵀz run on at most this many output floats (B × vectors × dθ) at a time: 2^26 (256 MB in
#: float32). 64 probes at once on a ResNet-18 at B = 8 were [8, 64, 11.2 M] = 23 GB, and the comparison's
#: per-class risk table went out of memory after its simulations had finished.
MAX_PRODUCT_FLOATS = 2 ** 26


def transpose_norms2(jt: Transpose, z: torch.Tensor) -> torch.Tensor:
    """‖J_iᵀz_ik‖² [B, k] for z [B, k, dim], as few vectors at a time as keep B × vectors × dθ within
    MAX_PRODUCT_FLOATS (the first vector's product tells dθ)."""
    first = jt(z[:, :1])
    batch, count, dtheta = z.shape[0], z.shape[1], first.shape[2]
    parts = [first.pow(2).sum(dim=2)]
    step = max(1, MAX_PRODUCT_FLOATS // max(1, batch * dtheta))
    for start in range(1, count, step):
        parts.append(jt(z[:, start:start + step]).pow(2).sum(dim=2))
    return torch.cat(parts, dim=1)


def exact_trace(jt: Transpose, batch: int, dim: int, *, like: torch.Tensor, chunk: int = 64) -> torch.Tensor:
    """Σ_j ‖J_iᵀ e_j‖² for every sample: [B]."""
    total = torch.zeros(batch, dtype=like.dtype, device=like.device)
    eye = torch.eye(dim, dtype=like.dtype, device=like.device)
    for start in range(0, dim, chunk):
        block = eye[start:start + chunk].unsqueeze(0).expand(batch, -1, -1)
        total += transpose_norms2(jt, block).sum(dim=1)
    return total


def hutchinson(jt: Transpose, batch: int, dim: int, *, like: torch.Tensor, basis: torch.Tensor | None = None,
               basis_trace: torch.Tensor | None = None, rtol: float = 3e-3, probes: int = 64, max_probes: int = 512,
               generator: torch.Generator | None = None, seed: int = 0) -> tuple[torch.Tensor, int, torch.Tensor]:
    """tr(K_i) ≈ tr(QᵀKQ) + mean_z ‖J_iᵀ P z‖² over Rademacher z ∈ R^dim, per sample.

    With ``basis`` Q [B, m, dim] and ``basis_trace`` tr(QᵀKQ) [B] (the Ritz values' sum) the probes
    are projected by P = I − QQᵀ (deflation); without, P = I and the estimate is plain Hutchinson
    (relative std ≤ √(2/probes) per sample). Probes are added ``probes`` at a time until the
    standard error is at most ``rtol`` of the estimate, or ``max_probes`` (``rtol=0``,
    ``max_probes=probes``: exactly ``probes``). Draws come from ``generator`` when given, else from
    a generator seeded with ``seed`` on ``like``'s device. Returns the trace [B], the probes used and
    the standard error [B] (callers flag samples whose error bar misses the target).
    """
    if basis is not None and basis.shape[1] >= dim:
        return basis_trace, 0, torch.zeros_like(basis_trace)
    if generator is None:
        generator = torch.Generator(device=like.device).manual_seed(seed)
    offset = basis_trace if basis_trace is not None else torch.zeros(batch, dtype=like.dtype, device=like.device)
    samples: list[torch.Tensor] = []
    used = 0
    while used < max_probes:
        z = torch.randint(0, 2, (batch, probes, dim), generator=generator, device=generator.device)
        z = z.to(like) * 2 - 1
        if basis is not None:
            z = z - torch.einsum("bmn,bpm->bpn", basis, torch.einsum("bmn,bpn->bpm", basis, z))
        samples.append(transpose_norms2(jt, z))
        used += probes
        values = torch.cat(samples, dim=1)
        estimate = offset + values.mean(dim=1)
        stderr = values.std(dim=1) / values.shape[1] ** 0.5
        if bool((stderr <= rtol * estimate).all()):
            break
    return estimate, used, stderr
