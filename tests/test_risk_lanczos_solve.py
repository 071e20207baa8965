"""λmax and the regularised solve from one Lanczos run (``lanczos_solve``) against dense references.

What must hold: λmax within rtol of ``torch.linalg.eigvalsh``; ε the run reports is eps·λmax of
that estimate; ``solution`` and ``error_bound`` are the centre x + r/(2ε) and radius ‖r‖/(2ε) of the
ball around the run's iterate x, r its TRUE residual (recomputed here), and the radius bounds
‖solution − x*‖ for x* from ``torch.linalg.solve`` at that ε; a converged sample meets
error_bound ≤ rtol‖solution‖. What it buys: fewer products than a Lanczos run and PCG.
Then on a conv model (dense autograd Jacobians) and in the guard (dense float64 I²F of the noise sent).
"""

from __future__ import annotations

import pytest
import torch

import flguard.guard.floor as floor_module
import flguard.guard.perturb as perturb_module
from flguard import Guard, GuardConfig
from flguard.risk.assess import i2f_solve_with_lambda_max
from flguard.risk.krylov import preconditioned_cg, spectral_preconditioner
from flguard.risk.lanczos import lanczos
from flguard.risk.lanczos_solve import lanczos_solve
from flguard.risk.operator import JacobianOperator
from risk_reference import (dense_jacobians, dense_shifted_solve, outlier_kernels, residual_ball_of, tiny_conv_problem,
                            assert_reported_rmse)
from guard_settings import unclipped


def _matvec(kernel):
    return lambda u: torch.einsum("bij,bj->bi", kernel, u)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("rtol", [1e-2, 1e-3])
def test_one_run_gives_lambda_max_and_a_certified_solve_with_fewer_products(dtype, rtol):
    kernel, rhs = outlier_kernels(seed=3)
    kernel, rhs = kernel.to(dtype), rhs.to(dtype)
    matvec = _matvec(kernel)
    run = lanczos_solve(matvec, rhs, eps=1e-2, rtol=rtol)
    assert bool(run.converged.all()) and bool(run.lambda_converged.all())
    lam = torch.linalg.eigvalsh(kernel.double())[:, -1]
    assert torch.all((run.lambda_max.double() - lam).abs() <= rtol * lam)
    torch.testing.assert_close(run.eps, 1e-2 * run.lambda_max)
    x = run.solution.double()
    centre, true = residual_ball_of(run.iterate.double(), rhs.double(), _matvec(kernel.double()), run.eps.double())
    exact = dense_shifted_solve(kernel.double(), rhs.double(), run.eps.double())
    error = (x - exact).norm(dim=1)
    # float64: the bound is the true residual's. float32: the residual, ~rtol·ε‖x‖ out of ‖b‖, is
    # formed with rounding — measured up to 9% of the bound at rtol 1e-3 — so it is held to 15%
    slack = 1e-8 if dtype == torch.float64 else 0.15
    torch.testing.assert_close(run.error_bound.double(), true, rtol=slack, atol=0)
    # the centre moves by r/(2ε), so the residual's rounding enters it as a vector (float32: measured up to 42% of
    # the radius at rtol 1e-3); the bound below is what the certificate needs, and holds to the same 15%
    assert torch.all((x - centre).norm(dim=1) <= (1e-8 if dtype == torch.float64 else 0.5) * true), (x, centre)
    assert torch.all(error <= run.error_bound.double() * (1 + slack)), (error, run.error_bound)
    assert torch.all(run.error_bound <= rtol * run.solution.norm(dim=1))
    # the two-run practice it replaces: Lanczos for λmax, then PCG preconditioned by its Ritz pairs
    spectrum = lanczos(matvec, 4, 200, like=kernel, rtol=rtol, ends="max", return_vectors=True)
    eps = 1e-2 * spectrum.lambda_max
    pcg = preconditioned_cg(matvec, rhs, eps, spectral_preconditioner(spectrum.ritz_values, spectrum.ritz_vectors, eps),
                            rtol=rtol)
    assert run.matvecs < spectrum.matvecs + pcg.matvecs, (run.matvecs, spectrum.matvecs, pcg.matvecs)


def test_a_zero_right_hand_side_gets_x_zero_and_lambda_max_and_an_absolute_eps():
    kernel, rhs = outlier_kernels(seed=4)
    rhs[2] = 0
    run = lanczos_solve(_matvec(kernel), rhs, eps=1e-5, relative=False, rtol=1e-3)
    assert bool(run.converged.all())
    assert torch.equal(run.solution[2], torch.zeros_like(run.solution[2])) and float(run.error_bound[2]) == 0
    lam = torch.linalg.eigvalsh(kernel)[:, -1]
    assert torch.all((run.lambda_max - lam).abs() <= 1e-3 * lam)
    torch.testing.assert_close(run.eps, torch.full((4,), 1e-5, dtype=torch.float64))
    exact = dense_shifted_solve(kernel, rhs, run.eps)
    assert torch.all((run.solution - exact).norm(dim=1) <= run.error_bound)


def test_out_of_iterations_is_reported_with_a_bound_that_still_holds():
    kernel, rhs = outlier_kernels(seed=5)
    run = lanczos_solve(_matvec(kernel), rhs, eps=1e-3, rtol=1e-6, max_iter=3)
    assert not bool(run.converged.any())
    exact = dense_shifted_solve(kernel, rhs, run.eps)
    assert torch.all((run.solution - exact).norm(dim=1) <= run.error_bound)
    assert torch.all(run.error_bound > 1e-6 * run.solution.norm(dim=1))


def test_on_a_conv_model_it_matches_dense_jacobians():
    model, x, y = tiny_conv_problem(batch=3, seed=2)
    jac, g = dense_jacobians(model, x, y)
    delta = torch.randn(g.numel(), generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    shift, jd, converged, lambda_max, eps, lambda_ok, _ = i2f_solve_with_lambda_max(
        JacobianOperator(model, x, y), delta, 1e-2, True, 1e-3)
    kernel = jac @ jac.transpose(1, 2)
    lam = torch.linalg.eigvalsh(kernel)[:, -1]
    assert bool(converged.all()) and bool(lambda_ok.all())
    assert torch.all((lambda_max - lam).abs() <= 1e-3 * lam)
    torch.testing.assert_close(eps, 1e-2 * lambda_max)
    torch.testing.assert_close(jd, (jac @ delta).norm(dim=1))
    exact = dense_shifted_solve(kernel, jac @ delta, eps)
    assert torch.all((shift - exact).norm(dim=1) <= 1e-3 * shift.norm(dim=1))


@pytest.mark.parametrize("one_run", [True, False])
def test_gaussian_guard_meets_the_floor_under_dense_recomputation(monkeypatch, one_run):
    monkeypatch.setattr(perturb_module, "LANCZOS_SOLVE", one_run)
    model, x, y = tiny_conv_problem(batch=4, seed=1)
    jac, g = dense_jacobians(model, x, y)
    tau = 0.2
    out = Guard(unclipped(defense="gaussian", min_rmse=tau, seed=3, max_rel_noise=1e9)).protect(model, x, y, g)
    assert out.report.met and out.gradient is not None
    kernel = jac @ jac.transpose(1, 2)
    lam = torch.linalg.eigvalsh(kernel)[:, -1]
    torch.testing.assert_close(out.report.eps, 1e-2 * lam, rtol=2e-3, atol=0)  # ε = eps·λmax (GuardConfig's eps)
    exact = dense_shifted_solve(kernel, jac @ (out.gradient - g), out.report.eps)
    rmse = exact.norm(dim=1) / jac.shape[1] ** 0.5
    assert torch.all(rmse >= tau), rmse
    assert_reported_rmse(out.report, rmse, rtol=2e-3)


def test_products_that_break_the_lanczos_relation_are_finished_by_pcg_with_a_true_bound(monkeypatch):
    """A slightly asymmetric operator (float32 products of a nearly saturated sample are, to ~1e-3
    of λmax) makes the recurrence's residual estimate wrong: the true-residual check catches it and
    PCG, started from the Lanczos x, finishes the sample; the bound returned is the true residual's."""
    import flguard.risk.lanczos_solve as module

    kernel, rhs = outlier_kernels(seed=6)
    skew = torch.randn(4, 200, 200, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    skew = skew - skew.transpose(1, 2)
    operator = kernel + 1e-4 * skew / torch.linalg.matrix_norm(skew, ord=2).view(-1, 1, 1)  # ‖A − Aᵀ‖ = 2e-4·λmax
    calls = []
    real = module.preconditioned_cg
    monkeypatch.setattr(module, "preconditioned_cg", lambda *a, **k: calls.append(k["initial"]) or real(*a, **k))
    run = lanczos_solve(_matvec(operator), rhs, eps=1e-2, rtol=1e-4)
    assert calls, "the check did not catch the drifted recurrence"
    centre, radius = residual_ball_of(run.iterate, rhs, _matvec(operator), run.eps)
    torch.testing.assert_close(run.error_bound, radius, rtol=1e-8, atol=0)
    assert torch.all((run.solution - centre).norm(dim=1) <= 1e-4 * run.error_bound + 1e-12)  # rounding only
    assert bool(run.converged.all())
    assert torch.all(run.error_bound <= 1e-4 * run.solution.norm(dim=1))


def test_pcg_from_a_starting_x_keeps_its_bound_and_needs_fewer_products():
    kernel, rhs = outlier_kernels(seed=7)
    matvec = _matvec(kernel)
    eps = torch.full((4,), 1e-3, dtype=torch.float64)
    identity = spectral_preconditioner(torch.zeros(4, 1, dtype=torch.float64), torch.zeros(4, 1, 200, dtype=torch.float64), eps)
    exact = dense_shifted_solve(kernel, rhs, eps)
    cold = preconditioned_cg(matvec, rhs, eps, identity, rtol=1e-6)
    near = exact + 1e-4 * exact.norm(dim=1, keepdim=True) * torch.randn(4, 200, generator=torch.Generator().manual_seed(3),
                                                                          dtype=torch.float64) / 200 ** 0.5
    warm = preconditioned_cg(matvec, rhs, eps, identity, rtol=1e-6, initial=near)
    assert bool(warm.converged.all()) and bool(cold.converged.all())
    assert torch.all((warm.solution - exact).norm(dim=1) <= warm.error_bound)
    assert warm.matvecs < cold.matvecs, (warm.matvecs, cold.matvecs)


def test_skipped_samples_take_no_product_and_leave_the_others_unchanged():
    """``skip``: those samples are never in a product (rows_matvec is never asked for them), come back
    x = 0 and not converged; the other samples' λmax, ε and solution are the unskipped run's."""
    kernel, rhs = outlier_kernels(seed=3)
    asked: list[torch.Tensor] = []

    def rows_matvec(u, rows):
        asked.append(rows.clone())
        return torch.einsum("bij,bj->bi", kernel[rows], u)

    skip = torch.tensor([False, True, False, True])
    run = lanczos_solve(_matvec(kernel), rhs, eps=1e-2, rtol=1e-3, rows_matvec=rows_matvec, skip=skip)
    full = lanczos_solve(_matvec(kernel), rhs, eps=1e-2, rtol=1e-3)
    assert asked and not any(bool(torch.isin(rows, torch.tensor([1, 3])).any()) for rows in asked)
    assert not bool(run.converged[skip].any()) and not bool(run.lambda_converged[skip].any())
    assert torch.equal(run.solution[skip], torch.zeros_like(run.solution[skip]))
    assert bool(run.converged[~skip].all())
    for got, want in ((run.solution, full.solution), (run.lambda_max, full.lambda_max), (run.eps, full.eps)):
        torch.testing.assert_close(got[~skip], want[~skip], rtol=1e-10, atol=0)
    exact = dense_shifted_solve(kernel, rhs, run.eps)[~skip]
    assert torch.all((run.solution[~skip] - exact).norm(dim=1) <= run.error_bound[~skip])



def _counting(kernel, counts):
    """(matvec, rows_matvec) that count each sample's products in ``counts``."""
    def rows_matvec(u, rows):
        counts.index_add_(0, rows, torch.ones_like(rows))
        return torch.einsum("bij,bj->bi", kernel[rows], u)
    return lambda u: rows_matvec(u, torch.arange(u.shape[0])), rows_matvec


def test_a_sufficient_rule_stops_samples_early_with_their_true_bound():
    """``sufficient`` accepting samples 0 and 1 at 30% error: they stop with fewer products than the
    rtol test asks, their ``error_bound`` is the true residual's and bounds ‖x − x*‖ (x* from
    ``torch.linalg.solve``) — above rtol‖x‖, so they did stop early — and they count as converged;
    samples 2 and 3, never accepted, end at rtol."""
    kernel, rhs = outlier_kernels(seed=3)
    loose = torch.tensor([True, True, False, False])
    asked_rows = []

    def rule(x, error, ask):
        asked_rows.append(ask.clone())
        return ask & loose & (error <= 0.3 * x.norm(dim=1))

    counts, plain_counts = torch.zeros(4, dtype=torch.long), torch.zeros(4, dtype=torch.long)
    matvec, rows = _counting(kernel, counts)
    run = lanczos_solve(matvec, rhs, eps=1e-3, rtol=1e-6, rows_matvec=rows, sufficient=rule)
    matvec, rows = _counting(kernel, plain_counts)
    plain = lanczos_solve(matvec, rhs, eps=1e-3, rtol=1e-6, rows_matvec=rows)
    assert bool(run.converged.all()) and asked_rows
    exact = dense_shifted_solve(kernel, rhs, run.eps)
    centre, true = residual_ball_of(run.iterate, rhs, _matvec(kernel), run.eps)
    # the rtol samples' residual sits at rounding level: compared to 1e-13 absolute
    torch.testing.assert_close(run.error_bound, true, rtol=1e-8, atol=1e-13)
    assert torch.all((run.solution - centre).norm(dim=1) <= 1e-4 * run.error_bound + 1e-12)  # rounding only
    assert torch.all((run.solution - exact).norm(dim=1) <= run.error_bound * (1 + 1e-8))
    norms = run.solution.norm(dim=1)
    assert torch.all(run.error_bound[loose] > 1e-6 * norms[loose]) and torch.all(run.error_bound[loose] <= 0.3 * norms[loose])
    assert torch.all(run.error_bound[~loose] <= 1e-6 * norms[~loose])
    assert torch.all(counts[loose] < plain_counts[loose]) and torch.equal(counts[~loose], plain_counts[~loose])
    torch.testing.assert_close(run.solution[~loose], plain.solution[~loose], rtol=1e-10, atol=0)


def test_a_sample_the_rule_stops_accepting_resumes_its_run_to_rtol():
    """The rule accepts sample 0 once, then never again (the target moved while the others converged):
    its verification asks again, it resumes its own Lanczos run where it stopped and ends at rtol."""
    kernel, rhs = outlier_kernels(seed=3)
    accepted_once = []

    def rule(x, error, ask):
        out = torch.zeros_like(ask)
        if not accepted_once and bool(ask[0]) and float(error[0]) <= 0.3 * float(x[0].norm()):
            accepted_once.append(True)
            out[0] = True
        return out

    run = lanczos_solve(_matvec(kernel), rhs, eps=1e-3, rtol=1e-6, sufficient=rule)
    assert accepted_once and bool(run.converged.all())
    assert torch.all(run.error_bound <= 1e-6 * run.solution.norm(dim=1))
    exact = dense_shifted_solve(kernel, rhs, run.eps)
    assert torch.all((run.solution - exact).norm(dim=1) <= run.error_bound * (1 + 1e-8))


@pytest.mark.parametrize("defense", ["gaussian", "eigen"])
@pytest.mark.parametrize("bounds", [None, (-3.0, 3.0)])
def test_the_guard_stopping_samples_when_they_certify_spends_fewer_products_for_the_same_noise(monkeypatch, bounds,
                                                                                               defense):
    """The guard's rule (``FloorCalibrator.sufficient``) against the rtol stop on the same draw — in the
    Gaussian's one Lanczos run and in eigen's PCG solve: the floor holds under dense float64
    recomputation either way, the noise differs by at most the fit's tolerance, and the rule takes no
    more products."""
    model, x, y = tiny_conv_problem(batch=8, seed=1)
    jac, g = dense_jacobians(model, x, y)
    kernel = jac @ jac.transpose(1, 2)
    tau, outs = 0.2, {}
    for stop in (True, False):
        monkeypatch.setattr(floor_module, "STOP_WHEN_SUFFICIENT", stop)
        cfg = unclipped(defense=defense, min_rmse=tau, seed=3, max_rel_noise=1e9, rtol=1e-2, input_bounds=bounds)
        outs[stop] = out = Guard(cfg).protect(model, x, y, g)
        assert out.report.met and out.gradient is not None
        shift = dense_shifted_solve(kernel, jac @ (out.gradient - g), out.report.eps)
        flat = x.flatten(1)
        # the guard widens the box to contain x itself (``input_bounds``)
        moved = shift if bounds is None else torch.clamp(flat + shift, flat.clamp(max=bounds[0]), flat.clamp(min=bounds[1])) - flat
        rmse = moved.norm(dim=1) / jac.shape[1] ** 0.5
        assert torch.all(rmse >= tau), rmse
        assert_reported_rmse(out.report, rmse, rtol=2e-3, solver_rtol=1e-2)
    assert outs[True].report.matvecs <= outs[False].report.matvecs
    assert outs[True].report.noise_norm == pytest.approx(outs[False].report.noise_norm, rel=2e-2)


def test_a_sample_without_a_shift_is_never_stopped_by_the_rule():
    """A sample whose K is zero but whose right-hand side is not (a float32 product that underflows) has
    θmax = 0 and so ε = 0: no error bound exists to judge it by. A rule that accepts anything must not
    stop it (it ran into PCG, which refuses ε = 0, and failed the whole solve); it ends unconverged while
    the others converge."""
    kernel, rhs = outlier_kernels(seed=3)
    kernel[1] = 0.0
    run = lanczos_solve(_matvec(kernel), rhs, eps=1e-3, rtol=1e-6, max_iter=30,
                        sufficient=lambda x, error, ask: ask.clone())
    assert not bool(run.converged[1]) and bool(run.converged[[0, 2, 3]].all())
    exact = dense_shifted_solve(kernel[[0, 2, 3]], rhs[[0, 2, 3]], run.eps[[0, 2, 3]])
    assert torch.all((run.solution[[0, 2, 3]] - exact).norm(dim=1) <= run.error_bound[[0, 2, 3]] * (1 + 1e-8))


def test_a_drifted_sample_is_finished_by_pcg_under_the_rule_with_a_true_bound(monkeypatch):
    """The asymmetric operator of the PCG test above, with a rule accepting 2e-4 relative error: the drifted
    samples reach PCG, which asks the rule with the whole batch's current x and bounds (never an
    undefined one), and every sample ends converged with the true residual's bound."""
    import flguard.risk.lanczos_solve as module

    kernel, rhs = outlier_kernels(seed=6)
    skew = torch.randn(4, 200, 200, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    skew = skew - skew.transpose(1, 2)
    operator = kernel + 1e-4 * skew / torch.linalg.matrix_norm(skew, ord=2).view(-1, 1, 1)
    operator[2:] = kernel[2:]  # samples 2 and 3 symmetric: only 0 and 1 drift, so PCG sees part of the batch
    calls, seen = [], []
    real = module.preconditioned_cg
    monkeypatch.setattr(module, "preconditioned_cg", lambda *a, **k: calls.append(1) or real(*a, **k))

    def rule(x, error, ask):
        seen.append(bool(torch.isfinite(error).all()))
        return ask & (error <= 2e-4 * x.norm(dim=1))

    run = lanczos_solve(_matvec(operator), rhs, eps=1e-2, rtol=1e-4, sufficient=rule)
    assert calls and all(seen) and bool(run.converged.all())
    centre, radius = residual_ball_of(run.iterate, rhs, _matvec(operator), run.eps)
    torch.testing.assert_close(run.error_bound, radius, rtol=1e-8, atol=0)
    assert torch.all((run.solution - centre).norm(dim=1) <= 1e-4 * run.error_bound + 1e-12)  # rounding only
    assert torch.all(run.error_bound <= 2e-4 * run.solution.norm(dim=1))
