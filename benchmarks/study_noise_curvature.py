"""How much each noise costs training per unit of norm: the curvature of the held-out loss along it.

A step's noise δ changes the loss by about gᵀδ (zero mean) + ½δᵀHδ: the second-order term is what training pays on
average, H the Hessian of the loss. For the quickstart CNN that ``bench_guard_models.py`` trains (``--seed``), on
``--batches`` batches of 32 at the median per-sample clip level: the noise the guard sends with resolvent noise,
δ = (guarded update) − (the clipped sum alone, ``min_rmse=0``), with the fixed filter (6 of a 9-step run) and each
sample's own filter length chosen by the noise's norm and by ‖K_iv_i‖ (the default;
``flguard.defenses.resolvent.CHOOSE_FILTER``, ``FILTER_CHOICE``), ``--draws`` seeded draws each; printed
per batch: ρ(d) = dᵀHd/‖d‖² on 1,000 held-out samples for the batch gradient g, one isotropic draw, the three
noises and the calibrated Gaussian's noise at the same floor (means over the draws; a withheld Gaussian draw is
skipped), and each noise's ρ·‖δ‖² (the second-order loss it adds, ×2).

    cd benchmarks && OMP_NUM_THREADS=1 ../.venv/bin/python study_noise_curvature.py --seed 2
"""

from __future__ import annotations

import argparse
import importlib

import torch
import torch.nn.functional as F
from torch.func import functional_call, grad, jvp

from _common import flat_gradient, study_paths, write_table
from bench_guard_models import _task
from flguard import Guard
from flguard.guard.config import GuardConfig

FILTER = importlib.import_module("flguard.defenses.resolvent")  # the package binds the name to the function


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=2, help="bench_guard_models.py's seed: the trained model")
    parser.add_argument("--batches", type=int, default=4)
    parser.add_argument("--draws", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model, (x, y), (x_test, y_test), data = _task("cnn", 150, "cpu", args.seed)
    x_test, y_test = x_test[:1000], y_test[:1000]
    named = [(name, p.shape) for name, p in model.named_parameters()]
    theta = torch.cat([p.detach().reshape(-1) for p in model.parameters()])

    def held_out_loss(flat: torch.Tensor) -> torch.Tensor:
        params, at = {}, 0
        for name, shape in named:
            params[name] = flat[at:at + shape.numel()].view(shape)
            at += shape.numel()
        return F.cross_entropy(functional_call(model, params, (x_test,)), y_test)

    def curvature(direction: torch.Tensor) -> float:
        unit = direction / direction.norm()
        return float(unit @ jvp(grad(held_out_loss), (theta,), (unit,))[1])

    settings = dict(pixel_mean=data.mean, pixel_std=data.std, clip_per_sample="median", defense="resolvent")
    generator = torch.Generator().manual_seed(7)
    default = FILTER.CHOOSE_FILTER, FILTER.FILTER_CHOICE
    rows = []
    for batch in range(args.batches):
        index = torch.randperm(len(y), generator=generator)[:32]
        xb, yb = x[index], y[index]
        g = flat_gradient(model, xb, yb)
        clipped = Guard(GuardConfig(clip_per_sample="median", defense="resolvent", min_rmse=0.0, seed=0)).protect(
            model, xb, yb, g).gradient
        row = {"batch": batch, "rho_gradient": curvature(g),
               "rho_isotropic": curvature(torch.randn(theta.numel(), generator=generator))}
        for name, defense, choose in (("fixed", "resolvent", False), ("norm", "resolvent", "norm"),
                                      ("kernel", "resolvent", "kernel"), ("gaussian", "gaussian", False)):
            FILTER.CHOOSE_FILTER = bool(choose)
            FILTER.FILTER_CHOICE = choose or "kernel"
            rho, added = [], []
            for draw in range(args.draws):
                sent = Guard(GuardConfig(**{**settings, "defense": defense}, seed=10 + draw)).protect(model, xb, yb, g)
                if sent.gradient is None:  # withheld (the Gaussian over its budget): no noise to measure
                    continue
                noise = sent.gradient - clipped
                rho.append(curvature(noise))
                added.append(rho[-1] * float(noise.norm()) ** 2)
            row[f"rho_{name}"] = sum(rho) / len(rho) if rho else float("nan")
            row[f"added_{name}"] = sum(added) / len(added) if added else float("nan")
        FILTER.CHOOSE_FILTER, FILTER.FILTER_CHOICE = default
        rows.append(row)
        print(row, flush=True)
    print(write_table(rows, study_paths(f"study_noise_curvature_seed{args.seed}")[1]))


if __name__ == "__main__":
    main()
