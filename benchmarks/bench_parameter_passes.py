"""The cached path's passes over parameter space, each against the form it replaced, in one process: a trained model
of ``bench_guard_models.py``, one batch, one ``JacobianOperator(products="cached")``, products timed in alternation.

- K: ``kmv`` hands Jᵀ's rows to J's pullback per parameter, against ``j(jt(u))``, which concatenates them into
  [B, dθ] first and splits them again;
- the summed Jᵀ product (``jt_sum``, resolvent noise's δ) through the Jᵀ pullback a K product built, against its
  own reverse-over-reverse pass of the batch loss (what it runs before any product).

    cd benchmarks && OMP_NUM_THREADS=1 ../.venv/bin/python bench_parameter_passes.py --model cnn --batch 32
    cd benchmarks && OMP_NUM_THREADS=1 ../.venv/bin/python bench_parameter_passes.py --model resnet8_gn --batch 32

Printed: milliseconds per product (median of ``--rounds`` rounds of ``--reps``), new ÷ old, and the forms' largest
relative difference.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from _common import add_product_arguments, ms_per_call
from bench_guard_models import _task
from flguard.risk.operator import JacobianOperator


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_product_arguments(parser, rounds=7, reps=8)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model, (x, y), _, _ = _task(args.model, args.train_steps, "cpu", 0)
    op = JacobianOperator(model, x[:args.batch], y[:args.batch], torch.nn.CrossEntropyLoss(), products="cached")
    u = torch.randn(args.batch, 1, op.dx, generator=torch.Generator().manual_seed(1))
    summed_fresh = op.jt_sum(u[:, 0])  # before any product: its own pass
    built = (op.kmv(u), op._cached_transpose)[1]

    def fresh_sum() -> torch.Tensor:
        op._cached_transpose = None
        try:
            return op.jt_sum(u[:, 0])
        finally:
            op._cached_transpose = built

    forms = {"K": (lambda: op.kmv(u), lambda: op.j(op.jt(u))),
             "summed Jᵀ": (lambda: op.jt_sum(u[:, 0]), fresh_sum)}
    difference = {"K": float((op.kmv(u) - op.j(op.jt(u))).norm() / op.kmv(u).norm()),
                  "summed Jᵀ": float((op.jt_sum(u[:, 0]) - summed_fresh).norm() / summed_fresh.norm())}
    times: dict[tuple[str, int], list[float]] = {}
    for _ in range(args.rounds):  # the forms alternate, so the machine's drift falls on both
        for name, pair in forms.items():
            for which, fn in enumerate(pair):
                times.setdefault((name, which), []).append(ms_per_call(fn, args.reps))
    print(f"{args.model} B={args.batch} (one CPU thread; ms per product, median of {args.rounds} × {args.reps})")
    print("| product | old form | new form | new ÷ old | largest relative difference |")
    print("| --- | --- | --- | --- | --- |")
    for name in forms:
        new, old = (statistics.median(times[(name, which)]) for which in (0, 1))
        print(f"| {name} | {old:.2f} | {new:.2f} | {new / old:.2f} | {difference[name]:.1e} |")


if __name__ == "__main__":
    main()
