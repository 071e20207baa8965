"""Aimed noise directions compared by what they buy: the least protected sample's I²F per unit of noise.

On a few batches of a trained model (``bench_guard_models.py``'s, with the median per-sample clipping the guard
applies) each direction d is normalised to ‖d‖ = 1 and every sample's I²F shift (K_i+ε_iI)⁻¹J_id is solved to
1% (ε_i = 1e-2·λmax): the guard's noise scale for the floor is set by the smallest ‖shift_i‖, so a direction
whose smallest ‖shift_i‖ is twice another's needs half its noise. Printed per batch and direction: that minimum,
the median, and the K products per sample the direction itself took (the floor's verification, the
same for all, is not counted, nor is the guard's λmax Lanczos run, 5–7 steps, which resolvent noise reads ε
from; eigen's count is its whole run, row-space noise counts its own). Directions: the isotropic Gaussian; eigen (``flguard.defenses.eigen``, Ritz directions
from ``--krylov-steps`` Lanczos steps); row-space noise (``flguard.defenses.rowspace``: the filtered noise
summed without a per-sample scale); resolvent noise (``flguard.defenses.resolvent.krylov_resolvent``) with v_i
on the first k steps of an n-step Lanczos run and ι_i on all n (the former fixed filter, ``CHOOSE_FILTER = False``,
is k = 6, n = 9; the guard's λmax run, 5–7 steps on a ResNet-20-GN, goes on to n, so the count here is the run's, which the
guard spends partly for λmax anyway), ι_i solved to 1%, and each sample's own k of 1 … n
(``flguard.defenses.resolvent.chosen_resolvent``, by the noise's norm or by ‖K_iv_i‖). Samples the guard leaves out unsolved (negligible gradients,
``flguard.guard.exclusion``) are left out here too.

    cd benchmarks && OMP_NUM_THREADS=1 ../.venv/bin/python study_aimed_noise.py --model resnet20_gn --batch 8 --batches 3
"""

from __future__ import annotations

import argparse

import torch

from bench_guard_models import trained_batches
from flguard.defenses.base import DefenseContext
from flguard.defenses.eigen import eigen_direction
from flguard.defenses.resolvent import carried, chosen_resolvent, krylov_resolvent
from flguard.defenses.rowspace import rowspace
from flguard.guard.config import GuardConfig
from flguard.guard.exclusion import negligible_samples
from flguard.risk.assess import i2f_solve
from flguard.risk.clipped import ClippedJacobian
from flguard.risk.operator import JacobianOperator
from flguard.risk.regularised import RegularisedK


#: Sample-K-products taken so far: rows of every K product, through ``RegularisedK`` or a shrinking solve's rows.
COUNT = [0]


def _count_products() -> None:
    from flguard.risk import regularised

    kernel, shrinking = regularised.RegularisedK._kernel, regularised.ShrinkingProducts.__call__

    def counted_kernel(self, u):
        COUNT[0] += u.shape[0] * (u.shape[1] if u.ndim == 3 else 1)
        return kernel(self, u)

    def counted_rows(self, u, rows):
        COUNT[0] += u.shape[0] * (u.shape[1] if u.ndim == 3 else 1)
        return shrinking(self, u, rows)
    regularised.RegularisedK._kernel, regularised.ShrinkingProducts.__call__ = counted_kernel, counted_rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--krylov-steps", type=int, default=64)
    parser.add_argument("--draws", type=int, default=2, help="draws of each random direction per batch")
    args, model, _, batches = trained_batches(parser)
    _count_products()
    print("| batch | direction | least ‖shift‖ per unit noise | median | K products / sample |\n|---|---|---|---|---|")
    for seed, x, y, _ in batches:
        op = median_clipped(model, x, y)
        batch = op.batch_size
        spectrum = RegularisedK(op).lanczos(rtol=0.03, ends="max", min_iter=args.krylov_steps,
                                            max_iter=args.krylov_steps, return_vectors=True, seed=seed)
        eps = 1e-2 * spectrum.lambda_max

        def row(name: str, direction: torch.Tensor, products: float) -> None:
            shift = i2f_solve(op, direction / direction.norm(), eps, 1e-2)[0].norm(dim=1)
            print(f"| {seed} | {name} | {float(shift.min()):.4g} | {float(shift.median()):.4g} | {products:.1f} |",
                  flush=True)

        def context(draw: int) -> DefenseContext:
            return DefenseContext(op, op.gradient, eps, spectrum.lambda_max,
                                  torch.Generator().manual_seed(1000 * seed + draw), GuardConfig(defense="eigen"),
                                  spectrum=spectrum)

        def counted(make) -> tuple[torch.Tensor, float]:
            before = COUNT[0]
            vector = make()
            return vector, (COUNT[0] - before) / batch

        for draw in range(args.draws):
            row(f"isotropic, draw {draw}", torch.randn(op.dtheta, generator=context(draw).generator), 0.0)
        row(f"eigen, {args.krylov_steps} Lanczos steps", eigen_direction(context(0)).vector, float(args.krylov_steps))
        for draw in range(args.draws):
            row(f"rowspace, draw {draw}", *counted(lambda: rowspace(op, context(draw).generator, 1e-2).vector))
        for filter_steps, steps in ((3, 3), (3, 6), (6, 6), (6, 9), (6, 12), (12, 12)):
            for draw in range(args.draws):
                run = RegularisedK(op).lanczos(rtol=0.0, min_iter=steps, max_iter=steps, seed=1000 * seed + draw)
                row(f"resolvent, v on {filter_steps} of a {steps}-step run, draw {draw}",
                    _resolvent(op, run, eps, filter_steps), float(steps))
                if (filter_steps, steps) == (6, 9):
                    row(f"resolvent, v on 6 steps, ι_i solved to 1%, draw {draw}",
                        *counted(lambda: _resolvent(op, run, eps, filter_steps, solved=True)))
        for by, steps in (("norm", 6), ("norm", 9), ("kernel", 6)):  # ``chosen_resolvent``: each sample's own k of 1 … n
            for draw in range(args.draws):
                run = RegularisedK(op).lanczos(rtol=0.0, min_iter=steps, max_iter=steps, seed=1000 * seed + draw)
                filtered, own, lengths = chosen_resolvent(run, eps, by)
                row(f"resolvent, each sample's own k of a {steps}-step run by {by} (mean k {float(lengths.mean()):.2f}), "
                    f"draw {draw}", carried(op, filtered, own), float(steps))


def median_clipped(model, x: torch.Tensor, y: torch.Tensor) -> ClippedJacobian:
    """The batch's operator clipped at its median per-sample norm, without the samples the guard leaves out unsolved
    (negligible gradients) unless that is all of them."""
    base = JacobianOperator(model, x, y)
    op = ClippedJacobian(base, float(base.per_sample_gradients().norm(dim=1).median()))
    free = negligible_samples(op)
    return op.restricted((~free).nonzero().squeeze(1)) if bool(free.any()) and not bool(free.all()) else op


def _resolvent(op, run, eps: torch.Tensor, filter_steps: int, solved: bool = False) -> torch.Tensor:
    """``flguard.defenses.resolvent``'s direction on ``run`` with v_i on its first ``filter_steps`` vectors and
    ι_i on all of them (as shipped) or, ``solved``, ι_i = ‖(K_i+ε_iI)⁻¹K_iv_i‖ solved to 1%."""
    filtered, own = krylov_resolvent(run, eps, filter_steps)
    if solved:
        own = RegularisedK(op, eps).solve(RegularisedK(op).matvec(filtered), rtol=1e-2).solution.norm(dim=1)
    return carried(op, filtered, own)


if __name__ == "__main__":
    main()
