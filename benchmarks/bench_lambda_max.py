"""P2: Jacobian applications to get λmax(K_i) within rtol, Lanczos vs power iteration.

Reference practice (I2F's code): 100 power iterations = 200 applications (each K product is one
Jᵀ and one J application). We also run power iteration until it reaches the same accuracy as
Lanczos, against a tight reference λmax (Lanczos at rtol 1e-9).

    python benchmarks/bench_lambda_max.py [--samples 16] [--rtol 1e-3]
"""

from __future__ import annotations

import argparse

import torch

from _common import model_and_batch
from flguard.risk.lanczos import lanczos
from flguard.risk.operator import JacobianOperator

REFERENCE_APPLICATIONS = 200


def power_iteration_applications(op: JacobianOperator, truth: torch.Tensor, rtol: torch.Tensor | float,
                                 limit: int = 300) -> torch.Tensor:
    """Per-sample applications until the Rayleigh quotient is within rtol of ``truth`` (inf if never)."""
    q = torch.randn(op.batch_size, op.dx, generator=torch.Generator().manual_seed(1), dtype=op.dtype)
    q = q / q.norm(dim=1, keepdim=True)
    needed = torch.full((op.batch_size,), float("nan"))
    for step in range(1, limit + 1):
        w = op.kmv(q.unsqueeze(1)).squeeze(1)
        estimate = (w * q).sum(1)
        hit = ((truth - estimate).abs() <= rtol * truth) & needed.isnan()
        needed[hit] = 2.0 * step
        if not bool(needed.isnan().any()):
            break
        q = w / w.norm(dim=1, keepdim=True)
    return needed.nan_to_num(float("inf"))


def run(dataset: str, samples: int, rtol: float) -> dict:
    model, x, y, _ = model_and_batch("lenet", dataset, samples)
    op = JacobianOperator(model.double(), x.double(), y)
    matvec = lambda q: op.kmv(q.unsqueeze(1)).squeeze(1)  # noqa: E731
    truth = lanczos(matvec, op.batch_size, op.dx, like=op.x, rtol=1e-9, ends="max").lambda_max
    op.applications = 0
    fast = lanczos(matvec, op.batch_size, op.dx, like=op.x, rtol=rtol, ends="max")
    lanczos_apps = op.applications
    errors = (fast.lambda_max - truth).abs() / truth
    power = power_iteration_applications(op, truth, rtol)
    power_same = power_iteration_applications(op, truth, errors.clamp_min(1e-12))
    return {"dataset": dataset, "samples": samples, "lanczos": lanczos_apps, "max_rel_error": errors.max().item(),
            "power_median": float(power.median()), "power_max": float(power.max()),
            "power_same_max": float(power_same.max())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--rtol", type=float, default=1e-3)
    args = parser.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    print(f"P2: applications of J or Jᵀ per sample for λmax at rtol {args.rtol} (LeNet, uniform init, float64)")
    print("power@rtol: power iteration until within rtol (median/max over samples); power@same: until as "
          "accurate as Lanczos actually was (inf = not within 600 applications)")
    print(f"{'dataset':<10} {'Lanczos':>8} {'its err':>9} {'power@rtol':>12} {'power@same':>11} {'ref':>5} "
          f"{'Lanczos/ref':>12} {'Lanczos/power@same':>19}")
    for dataset in ("mnist5k", "lfw-faces"):
        r = run(dataset, args.samples, args.rtol)
        print(f"{r['dataset']:<10} {r['lanczos']:>8} {r['max_rel_error']:>9.1e} "
              f"{r['power_median']:>5.0f}/{r['power_max']:<6.0f} {r['power_same_max']:>11.0f} {REFERENCE_APPLICATIONS:>5} "
              f"{r['lanczos'] / REFERENCE_APPLICATIONS:>12.3f} {r['lanczos'] / r['power_same_max']:>19.3f}")


if __name__ == "__main__":
    main()
