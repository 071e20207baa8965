"""Solvers on explicit matrices, against torch.linalg.eigh / solve / trace."""

from __future__ import annotations

import torch

from flguard.risk.krylov import conjugate_gradient
from flguard.risk.lanczos import from_basis, in_basis, lanczos, orthogonalised
from flguard.risk.trace import exact_trace, hutchinson


def _jacobians(batch=3, dx=300, dtheta=500, decay=0.97, seed=0):
    """Random J_i with a geometric singular-value decay, like a conv net's."""
    gen = torch.Generator().manual_seed(seed)
    left = torch.linalg.qr(torch.randn(batch, dx, dx, generator=gen, dtype=torch.float64))[0]
    right = torch.linalg.qr(torch.randn(batch, dtheta, dx, generator=gen, dtype=torch.float64))[0]
    singular = decay ** torch.arange(dx, dtype=torch.float64) * (1 + torch.arange(batch, dtype=torch.float64)).unsqueeze(1)
    return left @ torch.diag_embed(singular) @ right.transpose(1, 2)


def test_lanczos_both_ends_match_eigh_and_need_few_products():
    jac = _jacobians()
    kernel = jac @ jac.transpose(1, 2)
    lam = torch.linalg.eigvalsh(kernel)
    res = lanczos(lambda q: torch.einsum("bij,bj->bi", kernel, q), 3, 300, like=kernel, rtol=1e-3, ends="max")
    assert torch.all((res.lambda_max - lam[:, -1]).abs() <= 1e-3 * lam[:, -1])
    assert res.iterations < 40 and bool(res.converged.all())
    both = lanczos(lambda q: torch.einsum("bij,bj->bi", kernel, q), 3, 300, like=kernel, rtol=1e-3, ends="both",
                   return_vectors=True)
    assert torch.all((both.lambda_min - lam[:, 0]).abs() <= 1e-3 * lam[:, -1])
    top = both.ritz_vectors[:, -1]
    residual = torch.einsum("bij,bj->bi", kernel, top) - both.lambda_max.unsqueeze(1) * top
    assert torch.all(residual.norm(dim=1) <= 1e-3 * both.lambda_max)


def test_lanczos_is_exact_after_n_steps_even_with_repeated_eigenvalues():
    eigenvalues = torch.tensor([0.0, 0.0, 1.0, 1.0, 1.0, 5.0], dtype=torch.float64)
    basis = torch.linalg.qr(torch.randn(6, 6, dtype=torch.float64))[0]
    kernel = (basis * eigenvalues) @ basis.T
    res = lanczos(lambda q: q @ kernel, 1, 6, like=kernel, rtol=1e-12, ends="both")
    torch.testing.assert_close(res.lambda_max, torch.tensor([5.0], dtype=torch.float64))
    assert abs(float(res.lambda_min)) < 1e-10


def test_lanczos_restarts_only_the_sample_that_broke_down():
    """A rank-2 block breaks down at its third step and continues from a fresh vector orthogonal to its basis; the
    full-rank block beside it is not touched: its run equals its run alone, and both spectra are exact at n steps."""
    gen = torch.Generator().manual_seed(5)
    low = torch.randn(8, 2, generator=gen, dtype=torch.float64)
    full = torch.randn(8, 8, generator=gen, dtype=torch.float64)
    kernel = torch.stack([low @ low.T, full @ full.T + torch.eye(8, dtype=torch.float64)])
    start = torch.randn(2, 8, generator=gen, dtype=torch.float64)

    def run(blocks, first):
        return lanczos(lambda q: torch.einsum("bij,bj->bi", blocks, q), blocks.shape[0], 8, like=blocks, rtol=1e-12,
                       ends="both", min_iter=8, start=first, seed=2)

    both, alone = run(kernel, start), run(kernel[1:], start[1:])
    torch.testing.assert_close(both.ritz_values, torch.linalg.eigvalsh(kernel), atol=1e-9, rtol=1e-9)
    gram = both.basis @ both.basis.transpose(1, 2)
    torch.testing.assert_close(gram, torch.eye(8, dtype=torch.float64).expand_as(gram), atol=1e-10, rtol=0.0)
    torch.testing.assert_close(both.basis[1], alone.basis[0], atol=1e-12, rtol=0.0)


def test_lanczos_is_scale_free_on_tiny_low_rank_blocks():
    """Saturated samples give per-sample blocks of norm ~1e-6 and low rank (seen in the demo: an
    absolute cut-off in the normalisation made the basis non-orthonormal, Ritz values 10⁴× too large
    and Lanczos ran to n steps). The result for c·A must be c times the result for A."""
    gen = torch.Generator().manual_seed(3)
    low = torch.randn(4, 200, 3, generator=gen)  # rank 3 per sample, float32 like the guard
    kernel = low @ low.transpose(1, 2)
    truth = torch.linalg.eigvalsh(kernel.double())[:, -1]
    for scale in (1.0, 1e-6, 1e-9):
        res = lanczos(lambda q: torch.einsum("bij,bj->bi", kernel * scale, q), 4, 200, like=kernel, rtol=1e-3,
                      ends="max", seed=1)
        assert bool(res.converged.all()) and res.iterations <= 6, (scale, res.iterations)
        torch.testing.assert_close(res.lambda_max.double() / scale, truth, rtol=1e-4, atol=0.0)
        gram = res.basis @ res.basis.transpose(1, 2)
        torch.testing.assert_close(gram, torch.eye(res.iterations).expand_as(gram), atol=1e-4, rtol=0.0)


def test_cg_error_bound_gives_relative_accuracy():
    jac = _jacobians(dx=120, dtheta=200)
    kernel = jac @ jac.transpose(1, 2)
    rhs = torch.randn(3, 120, dtype=torch.float64)
    shift = torch.tensor([1e-2, 1e-3, 1e-1], dtype=torch.float64)
    out = conjugate_gradient(lambda q: torch.einsum("bij,bj->bi", kernel, q), rhs, shift, rtol=1e-3)
    exact = torch.linalg.solve(kernel + shift.view(-1, 1, 1) * torch.eye(120, dtype=torch.float64), rhs)
    error = (out.solution - exact).norm(dim=1) / exact.norm(dim=1)
    assert bool(out.converged.all()) and torch.all(error <= 1e-3)


def test_trace_products_stay_within_their_float_budget(monkeypatch):
    """With a budget of 2 vectors' products per call (B = 3, dθ = 500: 3,000 floats), exact_trace and
    plain Hutchinson never ask jt for more, and give the values of the unbudgeted calls: the exact trace
    equals Σ‖J_i‖²_F, the estimate the same probes' mean."""
    from flguard.risk import trace

    jac = _jacobians(dx=40, dtheta=500, decay=0.9)
    truth = jac.pow(2).sum(dim=(1, 2))
    widest = []

    def jt(u: torch.Tensor) -> torch.Tensor:
        widest.append(u.shape[1])
        return torch.einsum("bkd,bdp->bkp", u, jac)

    unbudgeted = hutchinson(jt, 3, 40, like=jac, rtol=0.0, probes=16, max_probes=16, seed=5)[0]
    assert widest == [1, 15]  # the first vector tells dθ, the rest fit the default budget
    widest.clear()
    monkeypatch.setattr(trace, "MAX_PRODUCT_FLOATS", 2 * 3 * 500)
    torch.testing.assert_close(exact_trace(jt, 3, 40, like=jac), truth)
    torch.testing.assert_close(hutchinson(jt, 3, 40, like=jac, rtol=0.0, probes=16, max_probes=16, seed=5)[0], unbudgeted)
    assert max(widest) == 2


def test_exact_and_deflated_hutchinson_traces():
    for decay in (0.97, 0.9):
        jac = _jacobians(dx=300, dtheta=500, decay=decay)
        truth = jac.pow(2).sum(dim=(1, 2))
        jt = lambda u: torch.einsum("bkd,bdp->bkp", u, jac)  # noqa: E731
        torch.testing.assert_close(exact_trace(jt, 3, 300, like=jac), truth)
        kernel = jac @ jac.transpose(1, 2)
        res = lanczos(lambda q: torch.einsum("bij,bj->bi", kernel, q), 3, 300, like=kernel, rtol=1e-3, ends="both")
        estimate, probes, stderr = hutchinson(jt, 3, 300, like=jac, basis=res.basis, basis_trace=res.ritz_values.sum(1))
        assert probes > 0
        # the reported error bar is honest (4σ, fixed seed) ...
        assert torch.all((estimate - truth).abs() <= 4 * stderr), ((estimate - truth) / stderr)
        # ... and where the deflated remainder is small, the estimate is within 1%
        if decay == 0.9:
            torch.testing.assert_close(estimate, truth, rtol=1e-2, atol=0)


def test_the_class_tables_deflated_trace_is_close_to_the_exact_one():
    """The comparison's per-class ‖J_i‖²_F (``flguard.compare.classes.hutchinson_fro2``): 16 probes deflated
    by the λmax Lanczos run's basis land within 5% of the exact trace on a small tanh network (the basis'
    part, the Ritz values' sum, is most of the trace: dropping or double-counting it misses by far more)."""
    from flguard.compare.classes import hutchinson_fro2
    from flguard.risk.operator import JacobianOperator
    from flguard.risk.regularised import RegularisedK

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(48, 24), torch.nn.Tanh(), torch.nn.Linear(24, 5)).double()
    x, y = torch.randn(4, 3, 4, 4, dtype=torch.float64), torch.tensor([0, 1, 2, 3])
    op = JacobianOperator(model, x, y)
    truth = exact_trace(op.jt, 4, 48, like=op.x)
    spectrum = RegularisedK(op).lanczos(rtol=1e-3, ends="max", seed=0)
    estimate = hutchinson_fro2(op, 16, torch.Generator().manual_seed(1), spectrum)
    torch.testing.assert_close(estimate, truth, rtol=5e-2, atol=0)


def test_basis_products_match_each_samples_own_matrix_products():
    """The Krylov runs' batched basis products against each sample's dense Qv, Qᵀc and (I − QᵀQ)v, float64; a zero
    row of the basis (a shorter sample's padding) changes nothing."""
    g = torch.Generator().manual_seed(0)
    q, _ = torch.linalg.qr(torch.randn(3, 9, 4, generator=g, dtype=torch.float64))
    basis = q.transpose(1, 2).clone()  # [3, 4, 9], orthonormal rows
    basis[2, 3] = 0.0
    v = torch.randn(3, 9, generator=g, dtype=torch.float64)
    c = torch.randn(3, 4, generator=g, dtype=torch.float64)
    for i in range(3):
        assert torch.allclose(in_basis(basis, v)[i], basis[i] @ v[i], atol=1e-14)
        assert torch.allclose(from_basis(basis, c)[i], basis[i].T @ c[i], atol=1e-14)
        assert torch.allclose(orthogonalised(basis, v)[i], v[i] - basis[i].T @ (basis[i] @ v[i]), atol=1e-14)
    assert in_basis(basis, orthogonalised(basis, v)).abs().max() < 1e-14
