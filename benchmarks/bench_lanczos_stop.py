"""Issue 12 §3: would stopping Lanczos per sample (not when the batch's last sample converges) pay?

The guard's Lanczos run sets ε = eps·λmax and hands its Ritz pairs to PCG as a preconditioner, so
a sample whose Lanczos stops early carries fewer pairs into PCG. This counts, per sample, the K
products of both parts under two policies, on the demo's trained CNN and gaussian guard config
(``simulations/default.toml``: clip C, eps, rtol), B = 32, ``--batches`` batches of client 0:

- batch stop (what the guard does): every sample runs the batch's Lanczos steps, then PCG with
  those Ritz pairs until it certifies;
- per-sample stop (ideal): each sample stops Lanczos at the step its own top pair converged, then
  PCG with the pairs of that many steps.

Counts are ideal per-sample products (no sub-batch or rebuild overheads): an upper bound on what
per-sample stopping could save. PCG runs with ``ShrinkingProducts``; a sample's count is the
number of products that carried it.

    OMP_NUM_THREADS=1 python benchmarks/bench_lanczos_stop.py [--batches 4]
"""

from __future__ import annotations

import argparse
import importlib

import torch

from flguard.compare.config import load_config
from flguard.simulation.task import TaskSettings, initial_model, load_partition
from flguard.risk.assess import jacobian_product
from flguard.risk.krylov import preconditioned_cg, spectral_preconditioner
from flguard.risk.lanczos import LanczosResult
from flguard.risk.clipped import ClippedJacobian
from flguard.risk.operator import JacobianOperator
from flguard.risk.regularised import RegularisedK, ShrinkingProducts

lanczos_module = importlib.import_module("flguard.risk.lanczos")  # the module, not the function


def own_convergence_steps(K: RegularisedK, rtol: float, seed: int) -> tuple[torch.Tensor, LanczosResult]:
    """(the Lanczos step at which each sample's top Ritz pair first met rtol, the batch's run)."""
    seen: list[torch.Tensor] = []
    check = lanczos_module._ends_converged

    def logged(*args):
        done = check(*args)
        seen.append(done.clone())
        return done

    lanczos_module._ends_converged = logged
    try:
        result = K.lanczos(rtol=rtol, ends="max", seed=seed)
    finally:
        lanczos_module._ends_converged = check
    return torch.stack(seen).float().argmax(0) + 1, result


def pcg_products(op, K: RegularisedK, rhs: torch.Tensor, eps: torch.Tensor, steps: int, rtol: float,
                 seed: int) -> torch.Tensor:
    """K products per sample for PCG to certify, preconditioned by ``steps`` Lanczos steps' pairs."""
    spectrum = K.lanczos(rtol=0.0, ends="max", min_iter=steps, max_iter=steps, return_vectors=True, seed=seed)
    precond = spectral_preconditioner(spectrum.ritz_values, spectrum.ritz_vectors, eps)
    counts = torch.zeros(op.batch_size)
    shrinking = ShrinkingProducts(op)

    def rows_matvec(u, rows):
        counts[rows] += 1
        return shrinking(u, rows)

    def matvec(u):
        counts.add_(1)
        return K._kernel(u)

    result = preconditioned_cg(matvec, rhs, eps, precond, rtol=rtol, rows_matvec=rows_matvec)
    if not bool(result.converged.all()):
        raise SystemExit("PCG did not certify every sample")
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", default="simulations/default.toml")
    parser.add_argument("--batches", type=int, default=4)
    args = parser.parse_args()
    torch.set_num_threads(1)
    config = load_config(args.config)
    spec = config.defense("gaussian")
    cfg = config.guard_config(spec)
    settings = TaskSettings.from_config(config.run_config(spec))
    model = initial_model(settings)
    train, _ = load_partition(settings, 0)
    x, y = train.normalize(train.images[:32 * args.batches]), train.labels[:32 * args.batches]
    print(f"demo's trained {settings.model}, gaussian guard config (C={cfg.clip_per_sample}, eps={cfg.eps}, "
          f"rtol={cfg.rtol}), B=32; K products per sample = Lanczos steps + PCG products")
    totals = {"batch": 0.0, "own": 0.0}
    for b in range(args.batches):
        op = ClippedJacobian(JacobianOperator(model, x[32 * b:32 * b + 32], y[32 * b:32 * b + 32]),
                             cfg.clip_per_sample)
        K = RegularisedK(op)
        own, batch_run = own_convergence_steps(K, cfg.rtol, seed=b)
        batch_steps, eps = batch_run.iterations, cfg.eps * batch_run.lambda_max
        rhs = jacobian_product(op, torch.randn(op.dtheta, generator=torch.Generator().manual_seed(b)))
        pcg = {m: pcg_products(op, K, rhs, eps, m, cfg.rtol, seed=b) for m in sorted(set(own.tolist()) | {batch_steps})}
        batch_stop = batch_steps + pcg[batch_steps]
        own_stop = own.float() + torch.stack([pcg[int(m)][i] for i, m in enumerate(own.tolist())])
        totals["batch"] += float(batch_stop.sum())
        totals["own"] += float(own_stop.sum())
        print(f"batch {b}: Lanczos {batch_steps} steps (own: mean {own.float().mean():.2f}, max {int(own.max())}); "
              f"K products per sample: batch stop {batch_stop.mean():.2f}, per-sample stop {own_stop.mean():.2f}")
    n = 32 * args.batches
    print(f"all: batch stop {totals['batch'] / n:.2f}, per-sample stop {totals['own'] / n:.2f} "
          f"({totals['own'] / totals['batch'] - 1:+.1%})")


if __name__ == "__main__":
    main()
