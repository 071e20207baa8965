"""The adaptive attacker against dense references: its weak subspace, its projection, its gain.

A tiny sigmoid MLP (float64, dx = 6) has a K = J Jᵀ small enough to build densely with
``torch.autograd.functional.jacobian`` and diagonalise with ``torch.linalg.eigh``. Noise placed
exactly in the span of J_iᵀu_j for the defense's best-gain eigenvectors u_j must vanish under the
attacker's projection, and the attacker's second pass must land closer to the truth than a plain
attack on the same noisy gradient.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from flguard.attacks import hyperparameters_of, reconstruct
from flguard.attacks.adaptive import weak_subspace
from flguard.attacks.objectives import project_out

DX, HIDDEN, CLASSES, K = 6, 5, 3, 2


def _problem(seed: int = 0, scale: float = 1.0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(DX, HIDDEN), nn.Sigmoid(), nn.Linear(HIDDEN, CLASSES)).double()
    x = scale * torch.randn(1, DX, dtype=torch.float64)
    y = torch.tensor([1])
    return model, x, y


def _flat_gradient(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    params = list(model.parameters())
    loss = nn.functional.cross_entropy(model(x), y)
    return torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss, params, create_graph=True)])


def _dense_weak_directions(model: nn.Module, x: torch.Tensor, y: torch.Tensor, k: int, eps_rel: float = 1e-2):
    """Dense J [dx, dθ] by autograd.functional.jacobian; the k eigenvectors of K = JJᵀ with the
    largest gain √λ/(λ+ε) (the eigen defense's rule), and Jᵀu for each."""
    jac = torch.autograd.functional.jacobian(lambda z: _flat_gradient(model, z.view(1, -1), y), x[0])  # [dθ, dx]
    jac = jac.T.contiguous()
    lam, vecs = torch.linalg.eigh(jac @ jac.T)
    gain = lam.clamp_min(0).sqrt() / (lam.clamp_min(0) + eps_rel * lam[-1])
    chosen = gain.topk(k).indices
    u = vecs[:, chosen]  # [dx, k]
    return jac, u, jac.T @ u  # columns Jᵀu_j, [dθ, k]


def _rmse(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).pow(2).mean().sqrt())


def test_weak_subspace_matches_the_dense_eigendecomposition_and_removes_noise_placed_in_it():
    model, x, y = _problem()
    _, u_dense, columns = _dense_weak_directions(model, x, y, K)
    basis, u = weak_subspace(model, x, y, size=K, krylov_steps=DX, select="gain")  # DX steps: exact Lanczos
    assert basis.shape == (columns.shape[0], K)
    torch.testing.assert_close(basis.T @ basis, torch.eye(K, dtype=basis.dtype), atol=1e-10, rtol=0)
    # Same input-space subspace and the same parameter-space span as the dense reference.
    torch.testing.assert_close(u[0] @ u[0].T, torch.eye(K, dtype=u.dtype), atol=1e-8, rtol=0)
    torch.testing.assert_close(u[0].T @ (u[0] @ u_dense), u_dense, atol=1e-7, rtol=0)
    q_dense, _ = torch.linalg.qr(columns)
    torch.testing.assert_close(basis @ basis.T, q_dense @ q_dense.T, atol=1e-7, rtol=0)

    clean = _flat_gradient(model, x, y).detach()
    noise = columns @ torch.tensor([3.0, -2.0], dtype=torch.float64)
    noise = noise * (2.0 * clean.norm() / noise.norm())  # twice the gradient's norm, all in the subspace
    shapes = [p.shape for p in model.parameters()]
    split = lambda v: [c.view(1, *s) for c, s in zip(v.split([s.numel() for s in shapes]), shapes)]  # noqa: E731
    projected_noisy = torch.cat([t.reshape(-1) for t in project_out(split(clean + noise), basis)])
    projected_clean = torch.cat([t.reshape(-1) for t in project_out(split(clean), basis)])
    dense_projector = torch.eye(len(clean), dtype=clean.dtype) - q_dense @ q_dense.T
    torch.testing.assert_close(projected_noisy, projected_clean, atol=1e-9 * float(noise.norm()), rtol=0)
    torch.testing.assert_close(projected_clean, dense_projector @ clean, atol=1e-9, rtol=1e-7)


@pytest.mark.parametrize("seed", [0, 1])
def test_second_pass_beats_the_plain_attack_on_noise_in_the_weak_subspace(seed):
    # Inputs near the data mean (0 in normalised units), the prior the second pass falls back on
    # for the coordinates it ignores; noise of 0.1·‖g‖ entirely in the dense weak subspace.
    model, x, y = _problem(seed, scale=0.3)
    _, _, columns = _dense_weak_directions(model, x, y, K)
    clean = _flat_gradient(model, x, y).detach()
    noise = columns @ torch.tensor([1.0, 1.0], dtype=torch.float64)
    noisy = clean + noise * (0.1 * clean.norm() / noise.norm())
    plain = reconstruct(model, noisy, (DX,), method="dlg", labels=y, iterations=30, seed=1)
    rec = reconstruct(model, noisy, (DX,), method="adaptive", labels=y, iterations=30, seed=1, base="dlg",
                      subspace=K + 1, krylov_steps=DX)
    first, final = _rmse(rec.extra["first_images"], x), _rmse(rec.images, x)
    assert _rmse(plain.images, x) == pytest.approx(first)  # the first pass is the plain attack
    assert first > 0.3, first  # the noise does hurt the plain attack ...
    assert rec.extra["chosen"] == "second" and final < 0.5 * first, (first, final)  # ... and the projection undoes it
    assert rec.method == "adaptive" and rec.images.shape == (1, DX)
    # Reusing the plain attack's output as the first pass gives the same answer.
    again = reconstruct(model, noisy, (DX,), method="adaptive", labels=y, iterations=30, seed=1, base="dlg",
                        subspace=K + 1, krylov_steps=DX, first_images=plain.images)
    assert _rmse(again.images, x) < 0.5 * first


def test_the_api_validates_hyperparameters():
    model, x, y = _problem(1)
    clean = _flat_gradient(model, x, y).detach()
    accepted = hyperparameters_of("adaptive")
    assert {"base", "subspace", "krylov_steps", "select", "eps", "first_images"} <= accepted.keys()
    with pytest.raises(ValueError, match="no hyperparameter 'bogus'"):
        reconstruct(model, clean, (DX,), method="adaptive", labels=y, bogus=1)
    with pytest.raises(ValueError, match="base="):
        reconstruct(model, clean, (DX,), method="adaptive", labels=y, base="hybrid")
    with pytest.raises(ValueError, match="may not set 'init'"):
        reconstruct(model, clean, (DX,), method="adaptive", labels=y, base_hyperparameters={"init": "rand"})
