"""The direct path's K product as one batched pass with ghost per-sample weight gradients
(``flguard.risk.ghost_products``) against the one-at-a-time loop it replaces, in one process: a trained model of
``bench_guard_models.py``, one batch, one ``JacobianOperator(products="direct")`` with chunks of one sample (what a
ResNet-18 gets on a CPU), products timed in alternation with a training step of the batch.

    cd benchmarks && OMP_NUM_THREADS=1 ../.venv/bin/python bench_ghost_products.py --model resnet18_gn --batch 8
    cd benchmarks && OMP_NUM_THREADS=1 ../.venv/bin/python bench_ghost_products.py --model resnet18_gn --batch 32

Printed: each form × a training step (median of ``--rounds`` rounds of ``--reps`` products), ghost ÷ loop, the first
product (which builds the batch's graphs) and the bytes they keep, and the forms' relative difference. The clipped K
product (median clipping, what the solvers run) is timed; the plain one compared.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from _common import add_product_arguments, ms_per_call
from bench_guard_models import _task
from flguard.risk import direct
from flguard.risk.clipped import ClippedJacobian
from flguard.risk.operator import JacobianOperator


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_product_arguments(parser, rounds=5, reps=2)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model, (x, y), _, _ = _task(args.model, args.train_steps, "cpu", 0)
    x, y = x[:args.batch], y[:args.batch]

    def operator() -> ClippedJacobian:
        op = JacobianOperator(model, x, y, torch.nn.CrossEntropyLoss(), products="direct")
        op.sample_chunk = 1
        return ClippedJacobian(op, float(op.per_sample_gradients().norm(dim=1).median()))
    ghost, loop = operator(), operator()
    u = torch.randn(args.batch, 1, ghost.op.dx, generator=torch.Generator().manual_seed(1))
    first = ms_per_call(lambda: ghost.op.kmv(u), 1)  # builds the graphs
    assert ghost.op._ghost is not None, getattr(ghost.op, "ghost_refused", "not supported")
    kept = ghost.op._ghost
    plain = ghost.op.kmv(u)
    direct.GHOST_KMV = False
    reference = loop.op.kmv(u)
    direct.GHOST_KMV = True
    difference = float((plain - reference).norm() / reference.norm())

    def train() -> None:
        model.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()

    def looped() -> torch.Tensor:
        direct.GHOST_KMV = False
        try:
            return loop.kmv(u)
        finally:
            direct.GHOST_KMV = True
    forms = {"training step": train, "clipped K, loop": looped, "clipped K, ghost": lambda: ghost.kmv(u)}
    times: dict[str, list[float]] = {}
    for _ in range(args.rounds):  # the forms alternate, so the machine's drift falls on all
        for name, fn in forms.items():
            times.setdefault(name, []).append(ms_per_call(fn, args.reps))
    step = statistics.median(times["training step"])
    new, old = statistics.median(times["clipped K, ghost"]), statistics.median(times["clipped K, loop"])
    print(f"{args.model} B={args.batch} (one CPU thread; median of {args.rounds} × {args.reps}; × a training step of "
          f"{step:.0f} ms)")
    print("| clipped K, loop | clipped K, ghost | ghost ÷ loop | first ghost product (builds) | graphs kept | "
          "relative difference (plain K) |")
    print("| --- | --- | --- | --- | --- | --- |")
    kept_text = f"{kept.retained} (chunks of {kept.chunk})"
    print(f"| {old / step:.2f}× | {new / step:.2f}× | {new / old:.2f} | {first / step:.2f}× | {kept_text} | "
          f"{difference:.1e} |")


if __name__ == "__main__":
    main()
