"""The per-layer linear algebra of R-GAP and the hybrid attack, on any device.

- activations: α⁻¹ and α' for the invertible activations R-GAP supports (tanh, sigmoid,
  LeakyReLU, identity);
- ``layer_gradients``: the uploaded gradient split per weighted layer (weight, bias);
- ``min_norm_lstsq``: the minimum-norm least-squares solution of the sparse system u x = v
  (what R-GAP's pseudo-inverse computes), via the Gram matrix of u's smaller side.

The matrices themselves are built in ``flguard.risk.architecture`` (shared with c(M)).

Why the Gram route: u is tall and sparse for most first layers (e.g. 13,744 × 3,072 for
cnn4_v2), so a dense SVD/QR costs O(m n²) while the sparse Gram product plus one n × n
factorisation is several times cheaper, and it runs unchanged on CUDA. Rows are scaled to unit
norm first: the gradient rows carry ∂L/∂z (often 10⁻³–10⁻⁶) and would otherwise vanish next to
the forward rows once squared. Scaling rows re-weights an *inconsistent* system's residual but
leaves the solution of a consistent one (and the minimum-norm choice within it) unchanged.
"""

from __future__ import annotations

import warnings
from typing import Sequence

import torch
from torch import nn

from flguard.attacks.base import trainable_parameters
from flguard.risk.architecture import Stage


def invert_activation(activation: nn.Module | None, x: torch.Tensor, margin: float = 1e-10) -> torch.Tensor:
    """z = α⁻¹(x); saturating activations are clamped ``margin`` inside their range first."""
    if activation is None or isinstance(activation, nn.Identity):
        return x
    if isinstance(activation, nn.Tanh):
        return torch.atanh(x.clamp(-1 + margin, 1 - margin))
    if isinstance(activation, nn.Sigmoid):
        return torch.logit(x.clamp(margin, 1 - margin))
    if isinstance(activation, nn.LeakyReLU):
        return torch.where(x >= 0, x, x / activation.negative_slope)
    raise ValueError(f"activation {activation} is not invertible")


def activation_derivative(activation: nn.Module | None, z: torch.Tensor) -> torch.Tensor:
    """α'(z) elementwise."""
    if activation is None or isinstance(activation, nn.Identity):
        return torch.ones_like(z)
    if isinstance(activation, nn.Tanh):
        return 1 - torch.tanh(z) ** 2
    if isinstance(activation, nn.Sigmoid):
        s = torch.sigmoid(z)
        return s * (1 - s)
    if isinstance(activation, nn.LeakyReLU):
        return torch.where(z >= 0, torch.ones_like(z), torch.full_like(z, activation.negative_slope))
    raise ValueError(f"activation {activation} is not differentiable here")


def layer_gradients(model: nn.Module, stages: Sequence[Stage], gradients: Sequence[torch.Tensor],
                    ) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """(∂L/∂W, ∂L/∂b or None) for every stage, from gradients in ``model.parameters()`` order."""
    params = trainable_parameters(model)
    if len(params) != len(gradients):
        raise ValueError("gradients do not match the model's trainable parameters")
    by_id = {id(p): g for p, g in zip(params, gradients)}
    out = []
    for stage in stages:
        module = stage.module
        if id(module.weight) not in by_id:
            raise ValueError(f"{module}: its weight is frozen, so its gradient is not uploaded")
        bias = None if module.bias is None else by_id.get(id(module.bias))
        out.append((by_id[id(module.weight)], bias))
    return out


def _scaled(u: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of sparse ``u`` and entries of ``v`` divided by the row norms of ``u``."""
    u = u.coalesce()
    rows = u.indices()[0]
    norms = torch.zeros(u.shape[0], dtype=u.dtype, device=u.device).index_add_(0, rows, u.values() ** 2).sqrt()
    norms = torch.where(norms > 0, norms, torch.ones_like(norms))
    scaled = torch.sparse_coo_tensor(u.indices(), u.values() / norms[rows], u.shape,
                                     is_coalesced=True, check_invariants=False)
    return scaled, v / norms


def _pinv_apply(h: torch.Tensor, b: torch.Tensor, rtol: float) -> torch.Tensor:
    """H⁺ b for symmetric PSD ``h``: Cholesky when clearly definite, else eigenvalues above rtol·λmax."""
    factor, info = torch.linalg.cholesky_ex(h)
    if int(info) == 0:
        pivots = torch.diagonal(factor) ** 2
        if float(pivots.min()) > 1e3 * rtol * float(torch.diagonal(h).max()):
            return torch.cholesky_solve(b.unsqueeze(1), factor).squeeze(1)
    values, vectors = torch.linalg.eigh(h)
    keep = values > rtol * values.max()
    inverse = torch.where(keep, 1.0 / torch.where(keep, values, torch.ones_like(values)), torch.zeros_like(values))
    return vectors @ (inverse * (vectors.T @ b))


def min_norm_lstsq(u: torch.Tensor, v: torch.Tensor, rtol: float | None = None) -> torch.Tensor:
    """argmin ‖x‖ over argmin ‖D(u x − v)‖, D the inverse row norms of sparse ``u`` [m, n].

    Tall (m ≥ n): x = (uᵀu)⁺ uᵀv; wide: x = uᵀ (u uᵀ)⁺ v. Eigenvalues of the Gram matrix below
    ``rtol``·λ_max (default 100·size·ε) count as zero, i.e. singular values of u below
    √rtol·σ_max, like a pseudo-inverse cut-off.
    """
    u, v = _scaled(u, v)
    with warnings.catch_warnings():  # "sparse CSR support is in beta"
        warnings.simplefilter("ignore", UserWarning)
        csr, csr_t = u.to_sparse_csr(), u.t().coalesce().to_sparse_csr()
    m, n = u.shape
    size = min(m, n)
    rtol = rtol if rtol is not None else 100 * size * torch.finfo(u.dtype).eps
    if m >= n:
        h = (csr_t @ csr).to_dense()
        return _pinv_apply(h, (csr_t @ v.unsqueeze(1)).squeeze(1), rtol)
    h = (csr @ csr_t).to_dense()
    return (csr_t @ _pinv_apply(h, v, rtol).unsqueeze(1)).squeeze(1)
