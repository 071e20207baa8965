"""Spectral-preconditioned CG (``preconditioned_cg``) against dense references.

What must hold whatever the preconditioner: the returned ``solution`` and ``error_bound`` are the
centre x + r/(2ε) and radius ‖r‖/(2ε) of the ball around the last iterate x, r = b − (K+εI)x its
TRUE residual (recomputed here), the radius really bounds ‖solution − x*‖ (x* from
``torch.linalg.solve``), and a converged sample meets error_bound ≤ rtol‖solution‖. What the Ritz pairs
buy: fewer products than plain CG on an ill-conditioned K. Then the guard with
``PRECONDITION_CG`` on a small model: its floor verified against dense float64 I²F.
"""

from __future__ import annotations

import pytest
import torch

import flguard.guard.floor as floor_module
from flguard import Guard, GuardConfig
from flguard.risk.assess import i2f_solve
from flguard.risk.krylov import conjugate_gradient, preconditioned_cg, residual_ball, spectral_preconditioner
from flguard.risk.lanczos import Deflation, galerkin_start, lanczos
from flguard.risk.operator import JacobianOperator
from flguard.risk.regularised import RegularisedK
from risk_reference import (assert_reported_rmse, dense_jacobians, dense_shifted_solve as _dense, outlier_kernels as _kernels,
                            residual_ball_of, tiny_conv_problem)
from guard_settings import unclipped


@pytest.mark.parametrize("rtol", [1e-2, 1e-4])
def test_pcg_matches_solve_within_its_true_residual_bound_and_needs_fewer_products(rtol):
    kernel, rhs = _kernels()
    matvec = lambda u: torch.einsum("bij,bj->bi", kernel, u)  # noqa: E731
    spectrum = lanczos(matvec, 4, 200, like=kernel, rtol=1e-2, ends="max", min_iter=8, return_vectors=True)
    eps = 1e-3 * spectrum.lambda_max  # κ ≈ 1000: plain CG needs many steps
    exact = _dense(kernel, rhs, eps)
    pcg = preconditioned_cg(matvec, rhs, eps, spectral_preconditioner(spectrum.ritz_values, spectrum.ritz_vectors,
                                                                      eps), rtol=rtol)
    plain = conjugate_gradient(matvec, rhs, eps, rtol=rtol)
    assert bool(pcg.converged.all()) and bool(plain.converged.all())
    centre, radius = residual_ball_of(pcg.iterate, rhs, matvec, eps)
    torch.testing.assert_close(pcg.error_bound, radius, rtol=1e-6, atol=0)
    assert torch.all((pcg.solution - centre).norm(dim=1) <= 1e-4 * pcg.error_bound + 1e-12)  # rounding only
    error = (pcg.solution - exact).norm(dim=1)
    assert torch.all(error <= pcg.error_bound), (error, pcg.error_bound)
    assert torch.all(pcg.error_bound <= rtol * pcg.solution.norm(dim=1))
    assert pcg.matvecs < plain.matvecs, (pcg.matvecs, plain.matvecs)


def _counted_run(top: int = 40, steps: int = 10):
    """(K_i [4, 200, 200] with ``top`` outliers, b_i, x ↦ K_ix_i counting its calls in ``products``, a ``steps``-step
    Lanczos run on it, ε_i = 1e-3·λmax): the start and deflation tests' problem."""
    kernel, rhs = _kernels(top=top)
    products = [0]

    def matvec(u):
        products[0] += 1
        return torch.einsum("bij,bj->bi", kernel, u)
    run = lanczos(matvec, 4, 200, like=kernel, rtol=0.0, ends="max", min_iter=steps, max_iter=steps,
                  return_vectors=True)
    return kernel, rhs, matvec, products, run, 1e-3 * run.lambda_max


def test_galerkin_start_is_the_dense_galerkin_solve_on_the_run_and_pcg_from_it_stays_verified():
    """``galerkin_start`` on a 10-step run: x₀ is Q(QᵀKQ + εI)⁻¹Qᵀb written out from the dense K and the run's basis,
    and its residual from the Lanczos relation is b − (K + εI)x₀ to rounding — for no product. PCG from it (that
    residual taken as given) returns the ball of an explicit product's residual, which holds x*, with fewer products
    than from zero (40 outliers, 10 of them found: 35 against 42); a negative shifted Ritz value (no valid shift)
    starts that sample from zero."""
    kernel, rhs, matvec, products, run, eps = _counted_run()
    q = run.basis.transpose(1, 2)  # [B, n, m]
    small = q.transpose(1, 2) @ kernel @ q + eps.view(-1, 1, 1) * torch.eye(10, dtype=kernel.dtype)
    dense_x0 = (q @ torch.linalg.solve(small, q.transpose(1, 2) @ rhs.unsqueeze(2))).squeeze(2)
    x0, r0 = galerkin_start(run, rhs, eps)
    torch.testing.assert_close(x0, dense_x0, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(r0, rhs - matvec(x0) - eps.unsqueeze(1) * x0, rtol=1e-7, atol=1e-10)
    assert not torch.allclose(x0, torch.zeros_like(x0))
    precond = spectral_preconditioner(run.ritz_values, run.ritz_vectors, eps)
    exact = _dense(kernel, rhs, eps)
    products[0] = 0
    warm = preconditioned_cg(matvec, rhs, eps, precond, rtol=1e-2, initial=x0, initial_residual=r0)
    warm_products, products[0] = products[0], 0
    cold = preconditioned_cg(matvec, rhs, eps, precond, rtol=1e-2)
    assert bool(warm.converged.all()) and bool(cold.converged.all())
    centre, radius = residual_ball_of(warm.iterate, rhs, lambda u: torch.einsum("bij,bj->bi", kernel, u), eps)
    torch.testing.assert_close(warm.error_bound, radius, rtol=1e-6, atol=0)
    assert torch.all((warm.solution - exact).norm(dim=1) <= warm.error_bound)
    assert warm_products == warm.matvecs < products[0] == cold.matvecs, (warm.matvecs, cold.matvecs)
    negative = eps.clone()
    negative[1] = -2 * run.ritz_values[1, -1]  # every shifted Ritz value of sample 1 negative
    x0, r0 = galerkin_start(run, rhs, negative)
    assert bool((x0[1] == 0).all()) and torch.equal(r0[1], rhs[1])


def test_deflated_pcg_on_the_runs_krylov_space_stays_verified_and_needs_fewer_products():
    """``Deflation`` on a 10-step run: its directions are A-orthogonal to the run's basis ((K + εI)W written out
    densely), and PCG deflated by it — started on the space for no product, every direction kept A-orthogonal —
    returns the explicit residual's ball that holds x* (dense solve) in fewer products than started there alone."""
    kernel, rhs, matvec, products, run, eps = _counted_run()
    deflation = Deflation(run, eps, rhs)
    z = torch.randn(4, 200, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    applied = torch.einsum("bij,bkj->bki", kernel, run.basis) + eps.view(-1, 1, 1) * run.basis  # (K + εI)W [B, m, n]
    torch.testing.assert_close(applied @ deflation.directions(z).unsqueeze(2), torch.zeros(4, 10, 1, dtype=z.dtype),
                               rtol=0, atol=1e-9 * float(z.norm()))
    precond = spectral_preconditioner(run.ritz_values, run.ritz_vectors, eps)
    exact = _dense(kernel, rhs, eps)
    x0, r0 = galerkin_start(run, rhs, eps)
    products[0] = 0
    deflated = preconditioned_cg(matvec, rhs, eps, precond, rtol=1e-2, deflation=deflation)
    deflated_products, products[0] = products[0], 0
    started = preconditioned_cg(matvec, rhs, eps, precond, rtol=1e-2, initial=x0, initial_residual=r0)
    assert bool(deflated.converged.all()) and bool(started.converged.all())
    centre, radius = residual_ball_of(deflated.iterate, rhs, lambda u: torch.einsum("bij,bj->bi", kernel, u), eps)
    torch.testing.assert_close(deflated.error_bound, radius, rtol=1e-6, atol=0)
    assert torch.all((deflated.solution - exact).norm(dim=1) <= deflated.error_bound)
    assert deflated_products == deflated.matvecs < products[0] == started.matvecs, (deflated.matvecs, started.matvecs)
    # a run whose space is the whole input space (a tiny model): nothing left to deflate into, and PCG still converges
    small, small_rhs = _kernels(dx=12, top=3)
    whole = lanczos(lambda u: torch.einsum("bij,bj->bi", small, u), 4, 12, like=small, rtol=0.0, ends="max",
                    min_iter=12, max_iter=12, return_vectors=True)
    small_eps = 1e-3 * whole.lambda_max
    solved = preconditioned_cg(lambda u: torch.einsum("bij,bj->bi", small, u), small_rhs, small_eps,
                               spectral_preconditioner(whole.ritz_values, whole.ritz_vectors, small_eps), rtol=1e-2,
                               deflation=Deflation(whole, small_eps, small_rhs))
    assert bool(solved.converged.all())
    exact_small = _dense(small, small_rhs, small_eps)  # solved to rounding here: the bound holds to the reference's
    slack = 1e-12 * exact_small.norm(dim=1)
    assert torch.all((solved.solution - exact_small).norm(dim=1) <= solved.error_bound + slack)


def test_pcg_stops_the_samples_a_sufficient_rule_accepts_with_their_true_bound():
    """``sufficient`` accepting samples 0 and 2 at 20% error: PCG sets them aside early, verifies them on
    the true residual (the bound returned is that residual's and bounds ‖x − x*‖) and counts them as
    converged; samples 1 and 3 end at rtol as without the rule."""
    kernel, rhs = _kernels()
    matvec = lambda u: torch.einsum("bij,bj->bi", kernel, u)  # noqa: E731
    spectrum = lanczos(matvec, 4, 200, like=kernel, rtol=1e-2, ends="max", min_iter=4, return_vectors=True)
    eps = 1e-3 * spectrum.lambda_max
    precond = spectral_preconditioner(spectrum.ritz_values, spectrum.ritz_vectors, eps)
    loose = torch.tensor([True, False, True, False])
    rule = lambda x, error, ask: ask & loose & (error <= 0.2 * x.norm(dim=1))  # noqa: E731
    run = preconditioned_cg(matvec, rhs, eps, precond, rtol=1e-8, sufficient=rule)
    tight = preconditioned_cg(matvec, rhs, eps, precond, rtol=1e-8)
    assert bool(run.converged.all())
    centre, radius = residual_ball_of(run.iterate, rhs, matvec, eps)
    # the rtol samples' residual sits at rounding level: compared to 1e-13 absolute
    torch.testing.assert_close(run.error_bound, radius, rtol=1e-6, atol=1e-13)
    assert torch.all((run.solution - centre).norm(dim=1) <= 1e-4 * run.error_bound + 1e-12)  # rounding only
    assert torch.all((run.solution - _dense(kernel, rhs, eps)).norm(dim=1) <= run.error_bound)
    norms = run.solution.norm(dim=1)
    assert torch.all(run.error_bound[loose] > 1e-8 * norms[loose]) and torch.all(run.error_bound[loose] <= 0.2 * norms[loose])
    assert torch.all(run.error_bound[~loose] <= 1e-8 * norms[~loose])
    assert torch.all(tight.error_bound[loose] <= 1e-8 * tight.solution.norm(dim=1)[loose])


def test_the_bound_holds_with_a_useless_preconditioner_and_when_out_of_iterations():
    """The certificate never trusts the preconditioner: wrong "Ritz vectors" (random orthonormal
    ones with made-up values) slow PCG down but its bound still bounds the true error; stopped
    early, unconverged samples are reported so, with the bound of the x returned."""
    kernel, rhs = _kernels(seed=1)
    matvec = lambda u: torch.einsum("bij,bj->bi", kernel, u)  # noqa: E731
    eps = torch.full((4,), 1e-3, dtype=torch.float64)
    exact = _dense(kernel, rhs, eps)
    gen = torch.Generator().manual_seed(5)
    wrong = torch.linalg.qr(torch.randn(4, 200, 5, generator=gen, dtype=torch.float64))[0].transpose(1, 2)
    precond = spectral_preconditioner(torch.rand(4, 5, generator=gen, dtype=torch.float64), wrong, eps)
    for max_iter in (3, None):
        res = preconditioned_cg(matvec, rhs, eps, precond, rtol=1e-3, max_iter=max_iter)
        assert torch.all((res.solution - exact).norm(dim=1) <= res.error_bound)
        assert bool(res.converged.all()) == (max_iter is None)
        meets = res.error_bound <= 1e-3 * res.solution.norm(dim=1)
        assert torch.equal(res.converged, meets)
    with pytest.raises(ValueError, match="shift > 0"):
        preconditioned_cg(matvec, rhs, torch.zeros(4, dtype=torch.float64), precond)


def _model_problem(batch=3, seed=0):
    return tiny_conv_problem(batch, seed)


def test_i2f_solve_with_ritz_pairs_on_a_model_matches_dense_jacobians():
    model, x, y = _model_problem()
    jac, g = dense_jacobians(model, x, y)
    op = JacobianOperator(model, x, y)
    spectrum = RegularisedK(op).lanczos(rtol=1e-3, ends="max", return_vectors=True)
    eps = 1e-2 * spectrum.lambda_max
    delta = torch.randn(g.numel(), generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    shift, jd, converged, _ = i2f_solve(op, delta, eps, 1e-3, ritz=(spectrum.ritz_values, spectrum.ritz_vectors))
    exact = _dense(jac @ jac.transpose(1, 2), jac @ delta, eps)
    assert bool(converged.all())
    torch.testing.assert_close(jd, (jac @ delta).norm(dim=1))
    assert torch.all((shift - exact).norm(dim=1) <= 1e-3 * shift.norm(dim=1))


@pytest.mark.parametrize("defense", ["gaussian", "eigen"])
def test_guard_with_pcg_meets_the_floor_under_dense_recomputation(monkeypatch, defense):
    monkeypatch.setattr(floor_module, "PRECONDITION_CG", True)
    model, x, y = _model_problem(batch=4, seed=1)
    jac, g = dense_jacobians(model, x, y)
    tau = 0.2
    out = Guard(unclipped(defense=defense, min_rmse=tau, seed=3, max_rel_noise=1e9)).protect(model, x, y, g)
    assert out.report.met and out.gradient is not None
    exact = _dense(jac @ jac.transpose(1, 2), jac @ (out.gradient - g), out.report.eps)
    rmse = exact.norm(dim=1) / jac.shape[1] ** 0.5
    assert torch.all(rmse >= tau), rmse
    assert_reported_rmse(out.report, rmse, rtol=2e-3)


def test_compiled_products_equal_eager_ones(monkeypatch):
    """``COMPILE_PRODUCTS`` (opt-in): the first product builds the pullbacks eagerly, later ones run
    compiled — and give K's products unchanged."""
    import flguard.risk.regularised as regularised_module

    model, x, y = _model_problem()
    u = torch.randn(3, 36, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    eager = RegularisedK(JacobianOperator(model, x, y), 0.5)
    monkeypatch.setattr(regularised_module, "COMPILE_PRODUCTS", True)
    compiled = RegularisedK(JacobianOperator(model, x, y), 0.5)
    first, second = compiled @ u, compiled @ u
    assert hasattr(compiled.op, "_compiled_kmv")
    torch.testing.assert_close(first, eager @ u)
    torch.testing.assert_close(second, eager @ u)


def test_the_residual_ball_holds_the_solution_and_is_the_least_ball_the_residual_allows():
    """``residual_ball`` against ``torch.linalg.solve``: for any iterate x, x* = (A+εI)⁻¹b lies within ‖r‖/(2ε)
    of x + r/(2ε) — for PSD A of any spectrum and for a non-symmetric A whose symmetric part is PSD (float32
    products are slightly asymmetric) — and no smaller ball would do: with A = 0 x* sits on the far side
    (x + r/ε) and with A ≫ εI on the near side (x), both on the sphere."""
    gen = torch.Generator().manual_seed(7)
    n, batch = 40, 6
    basis = torch.linalg.qr(torch.randn(batch, n, n, generator=gen, dtype=torch.float64))[0]
    values = torch.logspace(-4, 3, n, dtype=torch.float64).expand(batch, n) * torch.rand(batch, 1, generator=gen,
                                                                                           dtype=torch.float64)
    skew = torch.randn(batch, n, n, generator=gen, dtype=torch.float64)
    kernels = [(basis * values.unsqueeze(1)) @ basis.transpose(1, 2)]
    kernels.append(kernels[0] + 0.5 * (skew - skew.transpose(1, 2)))  # accretive, not symmetric
    eps = torch.full((batch,), 0.1, dtype=torch.float64)
    b = torch.randn(batch, n, generator=gen, dtype=torch.float64)
    x = torch.randn(batch, n, generator=gen, dtype=torch.float64)  # any iterate
    for kernel in kernels:
        exact = _dense(kernel, b, eps)
        r = b - torch.einsum("bij,bj->bi", kernel, x) - eps.unsqueeze(1) * x
        centre, radius = residual_ball(x, r, eps)
        torch.testing.assert_close(radius, r.norm(dim=1) / (2 * eps))
        distance = (exact - centre).norm(dim=1)
        assert torch.all(distance <= radius * (1 + 1e-12)), (distance, radius)
        assert torch.all((exact - x).norm(dim=1) <= 2 * radius * (1 + 1e-12))  # inside the plain ‖r‖/ε ball
    for scale in (0.0, 1e9):  # the two ends of the spectrum: x* on the sphere
        kernel = scale * torch.eye(n, dtype=torch.float64).expand(batch, n, n)
        exact = _dense(kernel, b, eps)
        r = b - torch.einsum("bij,bj->bi", kernel, x) - eps.unsqueeze(1) * x
        centre, radius = residual_ball(x, r, eps)
        torch.testing.assert_close((exact - centre).norm(dim=1), radius, rtol=1e-6, atol=0)
