"""tr(K_i) = ‖J_i‖²_F: exact from dx products, or Hutchinson deflated by a Lanczos basis.

Exact: Σ_j ‖J_iᵀ e_j‖² over the dx unit vectors (in chunks). Estimated: with the orthonormal
Lanczos basis Q_i already built for λmax, tr(K) = tr(QᵀKQ) + tr(PKP) with P = I − QQᵀ; the first
term is Σ of the Ritz values (free), the second is estimated by Rademacher probes projected by
P. Because Q captures the dominant eigen-directions, the remainder is small and the estimate
tight (the idea of Hutch++).
"""

from __future__ import annotations

from typing import Callable

import torch

Transpose = Callable[[torch.Tensor], torch.Tensor]  # u [B, k, dx] -> J_iᵀ u [B, k, dθ]


def exact_trace(jt: Transpose, batch: int, dim: int, *, like: torch.Tensor, chunk: int = 64) -> torch.Tensor:
    """Σ_j ‖J_iᵀ e_j‖² for every sample: [B]."""
    total = torch.zeros(batch, dtype=like.dtype, device=like.device)
    eye = torch.eye(dim, dtype=like.dtype, device=like.device)
    for start in range(0, dim, chunk):
        block = eye[start:start + chunk].unsqueeze(0).expand(batch, -1, -1)
        total += jt(block).pow(2).sum(dim=(1, 2))
    return total


def deflated_hutchinson(jt: Transpose, basis: torch.Tensor, basis_trace: torch.Tensor, *, rtol: float = 3e-3,
                        probes: int = 64, max_probes: int = 512, seed: int = 0
                        ) -> tuple[torch.Tensor, int, torch.Tensor]:
    """tr(K_i) ≈ tr(QᵀKQ) + mean_z ‖J_iᵀ P z‖², adding probes until the standard error of the
    estimate is at most ``rtol`` of it (or ``max_probes``). Returns the trace [B], the probes used
    and the standard error [B] (callers flag samples whose error bar misses the target)."""
    batch, rank, dim = basis.shape
    if rank >= dim:
        return basis_trace, 0, torch.zeros_like(basis_trace)
    generator = torch.Generator(device=basis.device).manual_seed(seed)
    samples: list[torch.Tensor] = []
    used = 0
    while used < max_probes:
        z = torch.randint(0, 2, (batch, probes, dim), generator=generator, device=basis.device).to(basis.dtype) * 2 - 1
        z = z - torch.einsum("bmn,bpm->bpn", basis, torch.einsum("bmn,bpn->bpm", basis, z))
        samples.append(jt(z).pow(2).sum(dim=2))
        used += probes
        values = torch.cat(samples, dim=1)
        estimate = basis_trace + values.mean(dim=1)
        stderr = values.std(dim=1) / values.shape[1] ** 0.5
        if bool((stderr <= rtol * estimate).all()):
            break
    return estimate, used, stderr
