"""Does the resolvent direction's floor solve need fewer iterations when it starts from each sample's own part?

δ = Σ_j J_jᵀv_j/ι_j (``flguard.defenses.resolvent``), so sample i's right-hand side b_i = J_iδ holds its own part
K_iv_i/ι_i, whose solve the λmax run already holds: x₀ = w_i/ι_i with w_i = Q_i(T_i+ε_iI)⁻¹T_i[:, :k]y_i (unit
norm). Started there, PCG would iterate only on the other samples' cross terms J_iJ_jᵀv_j/ι_j. Prints per batch
the own part's share of b, how well x₀ solves it, ‖b − (K+εI)x₀‖/‖b‖ (what the start leaves), and PCG's
iterations from zero and from x₀ (the guard's rtol, ε and Ritz preconditioner, the median clip level).

    cd benchmarks && OMP_NUM_THREADS=1 ../.venv/bin/python study_resolvent_start.py --model cnn --batches 4 [--batch 8]
"""

from __future__ import annotations

import argparse

import torch

from bench_guard_models import trained_batches


def main() -> None:
    from flguard import GuardConfig
    from flguard.defenses.resolvent import (FILTER_STEPS, NORM_STEPS, carried, krylov_resolvent, own_solution,
                                            resolvent_start)
    from flguard.guard.clipping import clip_level
    from flguard.risk.assess import jacobian_product
    from flguard.risk.clipped import ClippedJacobian
    from flguard.risk.krylov import preconditioned_cg, spectral_preconditioner
    from flguard.risk.operator import JacobianOperator
    from flguard.risk.regularised import RegularisedK

    args, model, data, batches = trained_batches(argparse.ArgumentParser(description=__doc__))
    cfg = GuardConfig(pixel_mean=data.mean, pixel_std=data.std)
    generator = torch.Generator().manual_seed(0)
    for seed, x, y, _ in batches:
        base = JacobianOperator(model, x, y)
        op = ClippedJacobian(base, clip_level("median", base, cfg.clip_quantile, cfg.clip_retention))
        run = RegularisedK(op).lanczos(rtol=cfg.rtol, ends="max", min_iter=FILTER_STEPS + NORM_STEPS, max_iter=100,
                                       return_vectors=True, seed=seed, start=resolvent_start(generator, op))
        eps = cfg.eps * run.lambda_max
        filtered, own = krylov_resolvent(run, eps, FILTER_STEPS)
        b = jacobian_product(op, carried(op, filtered, own))
        start = own_solution(run, eps, FILTER_STEPS) / own.unsqueeze(1)
        system, kernel = RegularisedK(op, eps), RegularisedK(op)  # K_i + ε_iI and K_i
        own_rhs = kernel.matvec(filtered) / own.unsqueeze(1)
        left = (b - system.matvec(start)).norm(dim=1) / b.norm(dim=1)
        preconditioner = spectral_preconditioner(run.ritz_values.to(b), run.ritz_vectors.to(b), eps)
        iterations = [preconditioned_cg(kernel.matvec, b, eps, preconditioner, rtol=cfg.rtol, max_iter=100,
                                        initial=initial).iterations for initial in (None, start)]
        print(f"batch {seed}: own part ‖K_iv_i‖/ι_i ÷ ‖b_i‖ median {float((own_rhs.norm(dim=1) / b.norm(dim=1)).median()):.3f}, "
              f"solved by x₀ to {float(((own_rhs - system.matvec(start)).norm(dim=1) / own_rhs.norm(dim=1)).median()):.1e}; "
              f"‖b − (K+εI)x₀‖/‖b‖ median {float(left.median()):.3f} (max {float(left.max()):.3f}); "
              f"PCG iterations from zero {iterations[0]}, from x₀ {iterations[1]}", flush=True)


if __name__ == "__main__":
    main()
