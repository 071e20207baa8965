"""Products on the still-iterating samples only: ``restricted`` operators and ``ShrinkingProducts``.

References are independent: dense autograd Jacobians (``risk_reference.dense_jacobians``) and
``torch.linalg.solve`` on the dense K_i + εI; the counts are checked against the batch-equivalent
work the solver really did.
"""

from __future__ import annotations

import pytest
import torch

import flguard.risk.regularised as regularised_module
from flguard.risk import direct, ghost_products
from flguard.risk.krylov import conjugate_gradient, preconditioned_cg, spectral_preconditioner
from flguard.risk.clipped import ClippedJacobian
from flguard.risk.operator import JacobianOperator
from flguard.risk.regularised import RegularisedK, ShrinkingProducts
from risk_reference import dense_jacobians, tiny_conv_problem


def _problem(batch=6, seed=0):
    return tiny_conv_problem(batch, seed)


def test_restricted_operator_gives_the_parents_rows_with_the_batch_scale():
    """Rows {1, 4} of the batch's blocks — scaled 1/B by the batch's mean loss, not 1/2 — and the
    clipped operator's restriction keeps each sample's own clipping factor."""
    model, x, y = _problem()
    jac, _ = dense_jacobians(model, x, y)
    rows = torch.tensor([1, 4])
    sub = JacobianOperator(model, x, y).restricted(rows)
    gen = torch.Generator().manual_seed(1)
    u = torch.randn(2, 3, sub.dx, generator=gen, dtype=torch.float64)
    v = torch.randn(2, 2, sub.dtheta, generator=gen, dtype=torch.float64)
    torch.testing.assert_close(sub.jt(u), torch.einsum("bkd,bdp->bkp", u, jac[rows]), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(sub.j(v), torch.einsum("bdp,bkp->bkd", jac[rows], v), rtol=1e-10, atol=1e-12)
    assert sub.applications == 3 + 2 and sub.batch_size == 2

    full_clipped = ClippedJacobian(JacobianOperator(model, x, y), clip=1e-3)  # every sample clipped
    assert bool((full_clipped.factor < 1).all())
    sub_clipped = full_clipped.restricted(rows)
    u1 = u[:, :1]
    torch.testing.assert_close(sub_clipped.kmv(u1), full_clipped.kmv(
        torch.zeros(6, 1, sub.dx, dtype=torch.float64).index_copy(0, rows, u1))[rows], rtol=1e-10, atol=1e-14)
    with pytest.raises(ValueError, match="coupled"):
        JacobianOperator(model, x, y, coupled=True).restricted(rows)


def test_shrinking_products_rebuild_at_half_and_count_batch_equivalents():
    model, x, y = _problem(batch=8)
    jac, _ = dense_jacobians(model, x, y)
    kernel = jac @ jac.transpose(1, 2)
    op = JacobianOperator(model, x, y)
    products = ShrinkingProducts(op)
    gen = torch.Generator().manual_seed(2)
    for rows, carried in ((torch.arange(8), 8), (torch.tensor([0, 2, 3, 5, 7]), 8), (torch.tensor([2, 5, 7]), 3),
                          (torch.tensor([5]), 1), (torch.tensor([1, 5]), 2)):
        before = op.applications
        u = torch.randn(rows.numel(), op.dx, generator=gen, dtype=torch.float64)
        torch.testing.assert_close(products(u, rows), torch.einsum("bij,bj->bi", kernel[rows], u),
                                   rtol=1e-10, atol=1e-14)
        assert products.rows.numel() == carried  # 5 of 8 rides on the 8; 3 ≤ 8/2 rebuilds; [1, 5] ⊄ [5] rebuilds
        assert (products.sub is op) == (carried == 8)  # the whole batch reuses op (pullbacks built), no copy
        assert op.applications - before == pytest.approx(2 * carried / 8)


@pytest.mark.parametrize("path", ["chunks of 2", "one at a time", "one at a time, ghost K",
                                  "one at a time, ghost K, 7 rows fixed"])
def test_shrinking_products_on_the_direct_path(path, monkeypatch):
    """On the direct path a restricted copy builds nothing and a zero row costs a product like any other (one
    sample at a time, as a ResNet-18's on a CPU): S is always the rows asked for, never padded. Where the K product
    keeps the batch's graphs (``ghost_products``) a restricted copy builds its own, so S shrinks at half, as on a
    CPU's cached path, and only where the rows dropped pay the rebuild back within two products: with a product's
    fixed cost 7 rows' worth (``GhostKmv.overhead_rows``), 4 of 8 rows ride on the 8 (2·4 < 7 + 4/3), 1 of 8 does
    not (2·7 ≥ 7 + 1/3). Against the dense K_i, counted as that many samples' products."""
    fixed = 7.0 if path.endswith("7 rows fixed") else 0.0
    monkeypatch.setattr(direct, "GHOST_KMV", "ghost K" in path)
    monkeypatch.setattr(ghost_products.GhostKmv, "overhead_rows", property(lambda self: fixed))
    model, x, y = _problem(batch=8)
    jac, _ = dense_jacobians(model, x, y)
    kernel = jac @ jac.transpose(1, 2)
    op = JacobianOperator(model, x, y, products="direct")
    op.sample_chunk = 2 if path == "chunks of 2" else 1
    assert op.direct and op.one_at_a_time == (path != "chunks of 2")
    assert op.ghost_products == ("ghost K" in path)
    clipped = ClippedJacobian(op, clip=float(op.per_sample_gradients().norm(dim=1).median()))
    products = ShrinkingProducts(clipped)
    gen = torch.Generator().manual_seed(2)
    plain_op = JacobianOperator(model, x, y, products="direct")
    plain_op.sample_chunk = op.sample_chunk
    plain = ShrinkingProducts(plain_op)
    held = ({8: 8, 5: 8, 4: 8 if fixed else 4, 1: 1, 2: 2} if op.ghost_products else {n: n for n in range(9)})
    for rows in (torch.arange(8), torch.tensor([0, 2, 3, 5, 7]), torch.tensor([2, 3, 5, 7]), torch.tensor([5]),
                 torch.tensor([1, 5])):
        u = torch.randn(rows.numel(), op.dx, generator=gen, dtype=torch.float64)
        full = clipped.kmv(torch.zeros(8, 1, op.dx, dtype=torch.float64).index_copy(0, rows, u.unsqueeze(1)))
        before, plain_before = op.applications, plain.op.applications
        torch.testing.assert_close(plain(u, rows), torch.einsum("bij,bj->bi", kernel[rows], u), rtol=1e-10, atol=1e-14)
        torch.testing.assert_close(products(u, rows), full[rows, 0], rtol=1e-10, atol=1e-14)
        carried = held[rows.numel()]
        assert products.rows.numel() == carried and plain.rows.numel() == carried
        assert bool(torch.isin(rows, products.rows).all())
        assert plain.op.applications - plain_before == pytest.approx(2 * carried / 8)
        assert op.applications - before == pytest.approx(2 * carried / 8)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_shrinking_products_on_a_cuda_cached_path_keep_the_whole_batch():
    """On a GPU's cached path a product is launch-bound, so S stays the whole batch (rows not asked for carried as
    zeros, nothing rebuilt) — against the dense K_i, each product counted as a whole-batch one (on a CPU's cached
    path the same rows shrink at half: ``test_shrinking_products_rebuild_at_half_and_count_batch_equivalents``)."""
    model, x, y = _problem(batch=8)
    jac, _ = dense_jacobians(model, x, y)
    kernel = (jac @ jac.transpose(1, 2)).cuda()
    op = JacobianOperator(model.cuda(), x.cuda(), y.cuda())
    assert not op.direct and op.device.type == "cuda"
    products = ShrinkingProducts(op)
    gen = torch.Generator().manual_seed(2)
    for rows in (torch.arange(8), torch.tensor([0, 2, 3, 5, 7]), torch.tensor([2, 5]), torch.tensor([5])):
        rows = rows.cuda()
        u = torch.randn(rows.numel(), op.dx, generator=gen, dtype=torch.float64).cuda()
        before = op.applications
        torch.testing.assert_close(products(u, rows), torch.einsum("bij,bj->bi", kernel[rows], u),
                                   rtol=1e-10, atol=1e-14)
        assert products.sub is op and products.rows.numel() == 8
        assert op.applications - before == pytest.approx(2)


@pytest.mark.parametrize("solver", ["cg", "pcg"])
def test_solves_with_shrinking_products_match_dense_solves_and_cost_less(monkeypatch, solver):
    """The same iterates on fewer sample-products: solutions within the certified bound of the dense
    solve, equal to the whole-batch solve's, and fewer batch-equivalent applications — samples with
    very different conditioning (scaled inputs) certify at different iterations."""
    model, x, y = _problem(batch=6, seed=3)
    x = x * torch.tensor([0.05, 0.2, 1.0, 2.0, 4.0, 8.0], dtype=torch.float64).view(-1, 1, 1, 1)
    jac, _ = dense_jacobians(model, x, y)
    kernel = jac @ jac.transpose(1, 2)
    rhs = torch.randn(6, jac.shape[1], generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    eps = 1e-2 * torch.linalg.eigvalsh(kernel)[:, -1]
    exact = torch.linalg.solve(kernel + eps.view(-1, 1, 1) * torch.eye(jac.shape[1], dtype=torch.float64), rhs)
    ritz = None
    if solver == "pcg":
        spectrum = RegularisedK(JacobianOperator(model, x, y)).lanczos(rtol=1e-3, ends="max", return_vectors=True)
        ritz = (spectrum.ritz_values, spectrum.ritz_vectors)
    results = {}
    for shrink in (False, True):
        monkeypatch.setattr(regularised_module, "SHRINK_TO_ACTIVE", shrink)
        op = JacobianOperator(model, x, y)
        # PCG to 1e-9: at looser tolerances its samples here certify within an iteration of each other
        res = RegularisedK(op, eps).solve(rhs, rtol=1e-9 if solver == "pcg" else 1e-5, ritz=ritz)
        assert bool(res.converged.all())
        assert torch.all((res.solution - exact).norm(dim=1) <= 1e-5 * res.solution.norm(dim=1))
        results[shrink] = (res, op.applications)
    (whole, whole_cost), (shrunk, shrunk_cost) = results[False], results[True]
    torch.testing.assert_close(shrunk.solution, whole.solution, rtol=1e-9, atol=1e-12)
    assert shrunk.iterations == whole.iterations
    assert shrunk_cost < whole_cost, (shrunk_cost, whole_cost)


def test_solvers_skip_rows_they_do_not_need():
    """The model-free solvers hand ``rows_matvec`` only the rows still iterating (or being verified):
    once a sample has certified it is never asked for again, and the answers are unchanged."""
    gen = torch.Generator().manual_seed(0)
    basis = torch.linalg.qr(torch.randn(3, 30, 30, generator=gen, dtype=torch.float64))[0]
    spectra = torch.stack([torch.logspace(0, k, 30, dtype=torch.float64) for k in (0.5, 1.5, 2.5)])
    kernel = basis @ torch.diag_embed(spectra) @ basis.transpose(1, 2)
    rhs = torch.randn(3, 30, generator=gen, dtype=torch.float64)
    shift = torch.ones(3, dtype=torch.float64)
    matvec = lambda u: torch.einsum("bij,bj->bi", kernel, u)  # noqa: E731
    asked: list[list[int]] = []

    def rows_matvec(u, rows):
        asked.append(rows.tolist())
        return torch.einsum("bij,bj->bi", kernel[rows], u)

    precond = spectral_preconditioner(torch.zeros(3, 1, dtype=torch.float64), basis[:, :, :1].transpose(1, 2), shift)
    for name, solve in (("cg", lambda **k: conjugate_gradient(matvec, rhs, shift, rtol=1e-3, **k)),
                        ("pcg", lambda **k: preconditioned_cg(matvec, rhs, shift, precond, rtol=1e-3, **k))):
        asked.clear()
        plain, rows = solve(), solve(rows_matvec=rows_matvec)
        torch.testing.assert_close(rows.solution, plain.solution, rtol=1e-6, atol=1e-10)
        assert torch.equal(rows.converged, plain.converged) and bool(rows.converged.all())
        # the well-conditioned sample 0 certifies first; after that it is not iterated on again
        # (PCG's batched true-residual check of all three at the end is a whole-batch product)
        first_without = next(i for i, a in enumerate(asked) if 0 not in a)
        assert not [a for a in asked[first_without:] if 0 in a], (name, asked)
        assert first_without < len(asked) - 2  # (whole-batch products do not go through rows_matvec)
