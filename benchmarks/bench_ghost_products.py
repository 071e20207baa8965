"""The direct path's K product as one batched pass with ghost per-sample weight gradients
(``flguard.risk.ghost_products``) against the one-at-a-time loop it replaces, in one process: a trained model of
``bench_guard_models.py``, one batch, one ``JacobianOperator(products="direct")`` with chunks of one sample (what a
ResNet-18 gets on a CPU), products timed in alternation with a training step of the batch. ``--against cached``:
``products="ghost"`` (the guard's operator on a CPU) against the cached pullbacks, on a batch they hold.

    cd benchmarks && OMP_NUM_THREADS=1 ../.venv/bin/python bench_ghost_products.py --model resnet18_gn --batch 8
    cd benchmarks && OMP_NUM_THREADS=1 ../.venv/bin/python bench_ghost_products.py --model resnet18_gn --batch 32
    cd benchmarks && OMP_NUM_THREADS=1 ../.venv/bin/python bench_ghost_products.py --model cnn --against cached

Printed, each form × a training step (median of ``--rounds`` rounds of ``--reps`` calls) and ghost ÷ the other: the
per-sample gradients (where the ghost form builds the batch's graphs, which its products then keep), the clipped K
product (median clipping, what the solvers run) and the clipped summed Jᵀ product (resolvent noise's); whether the
graphs are kept, and the forms' largest relative difference.
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any, Callable

import torch

from _common import add_product_arguments, ms_per_call
from bench_guard_models import _task
from flguard.risk import direct
from flguard.risk.clipped import ClippedJacobian
from flguard.risk.operator import JacobianOperator


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_product_arguments(parser, rounds=5, reps=2)
    parser.add_argument("--against", choices=("loop", "cached"), default="loop",
                        help="the form the ghost products replace: the one-at-a-time loop, or the cached pullbacks")
    args = parser.parse_args()
    old = args.against
    torch.set_num_threads(1)
    model, (x, y), _, _ = _task(args.model, args.train_steps, "cpu", 0)
    x, y = x[:args.batch], y[:args.batch]

    def switched(ghost: bool, fn: Callable[[], Any]) -> Any:
        """``fn()`` with the batched products on (``ghost``) or off: the loop."""
        direct.GHOST_KMV = ghost
        try:
            return fn()
        finally:
            direct.GHOST_KMV = True

    def gradients(ghost: bool) -> JacobianOperator:
        if old == "cached":  # the guard's choice on a CPU (its graphs built with the operator) or the pullbacks
            op = JacobianOperator(model, x, y, torch.nn.CrossEntropyLoss(), products="ghost" if ghost else "cached")
        else:
            op = JacobianOperator(model, x, y, torch.nn.CrossEntropyLoss(), products="direct")
            op.sample_chunk = 1
        switched(ghost, op.per_sample_gradients)
        return op

    def operator(ghost: bool) -> ClippedJacobian:
        op = gradients(ghost)
        return ClippedJacobian(op, float(op.per_sample_gradients().norm(dim=1).median()))
    ghost, loop = operator(True), operator(False)
    assert ghost.op._ghost is not None, getattr(ghost.op, "ghost_refused", "not supported")
    generator = torch.Generator().manual_seed(1)
    u = torch.randn(args.batch, 1, ghost.op.dx, generator=generator)
    summed = torch.randn(args.batch, ghost.op.dx, generator=generator)
    pairs = {"per-sample gradients": (lambda: loop.op.per_sample_gradients(), lambda: ghost.op.per_sample_gradients()),
             "plain K": (lambda: switched(False, lambda: loop.op.kmv(u)), lambda: ghost.op.kmv(u)),
             "clipped summed Jᵀ": (lambda: switched(False, lambda: loop.jt_sum(summed)),
                                   lambda: ghost.jt_sum(summed))}
    difference = {name: _relative(new(), old()) for name, (old, new) in pairs.items()}

    def train() -> None:
        model.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
    forms = {"training step": train,
             f"per-sample gradients, {old}": lambda: gradients(False),
             "per-sample gradients, ghost": lambda: gradients(True),  # with the graphs' build
             f"clipped K, {old}": lambda: switched(False, lambda: loop.kmv(u)),
             "clipped K, ghost": lambda: ghost.kmv(u),
             f"clipped summed Jᵀ, {old}": pairs["clipped summed Jᵀ"][0],
             "clipped summed Jᵀ, ghost": pairs["clipped summed Jᵀ"][1]}
    times: dict[str, list[float]] = {}
    for _ in range(args.rounds):  # the forms alternate, so the machine's drift falls on all
        for name, fn in forms.items():
            times.setdefault(name, []).append(ms_per_call(fn, args.reps))
    step = statistics.median(times["training step"])
    kept = ghost.op._ghost
    print(f"{args.model} B={args.batch} (one CPU thread; median of {args.rounds} × {args.reps}; × a training step of "
          f"{step:.0f} ms; graphs kept: {kept.retained}, chunks of {kept.chunk})")
    print(f"| | {old} | ghost | ghost ÷ {old} | relative difference |")
    print("| --- | --- | --- | --- | --- |")
    for name, compared in (("per-sample gradients (the ghost's builds its graphs)", "per-sample gradients"),
                           ("clipped K", "plain K"), ("clipped summed Jᵀ", "clipped summed Jᵀ")):
        key = name.split(" (")[0]
        before, after = (statistics.median(times[f"{key}, {form}"]) for form in (old, "ghost"))
        print(f"| {name} | {before / step:.2f}× | {after / step:.2f}× | {after / before:.2f} | {difference[compared]:.1e} "
              f"({compared}) |")


def _relative(new: torch.Tensor, old: torch.Tensor) -> float:
    return float((new - old).norm() / old.norm())


if __name__ == "__main__":
    main()
