"""The cached products with few-channel per-sample-weight convolutions unfolded (``flguard.risk.unfolded_convs``)
against PyTorch's grouped convolutions, in one process: a trained model of ``bench_guard_models.py``, one batch,
``JacobianOperator(products="cached")`` built each way, then Jᵀ, J and K products timed in alternation.

    cd benchmarks && OMP_NUM_THREADS=1 ../.venv/bin/python bench_unfolded_convs.py --model cnn --batch 32
    cd benchmarks && OMP_NUM_THREADS=1 ../.venv/bin/python bench_unfolded_convs.py --model resnet20_gn --batch 8

Printed: milliseconds per product (median of ``--rounds`` rounds of ``--reps`` products), the first K product (which
builds the pullbacks), unfolded ÷ grouped, and the products' largest relative difference between the two forms.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from _common import add_product_arguments, ms_per_call
from bench_guard_models import _task
from flguard.risk import unfolded_convs
from flguard.risk.operator import JacobianOperator


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_product_arguments(parser, rounds=5, reps=10)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model, (x, y), _, _ = _task(args.model, args.train_steps, "cpu", 0)
    xb, yb = x[:args.batch], y[:args.batch]
    generator = torch.Generator().manual_seed(1)
    u = torch.randn(args.batch, 1, xb[0].numel(), generator=generator)
    ops, first, results = {}, {}, {}
    for form in ("grouped", "unfolded"):
        unfolded_convs.UNFOLD_PER_SAMPLE_CONVS = form == "unfolded"
        start = time.perf_counter()
        ops[form] = JacobianOperator(model, xb, yb, torch.nn.CrossEntropyLoss(), products="cached")
        kmv = ops[form].kmv(u)
        first[form] = (time.perf_counter() - start) * 1e3
        v = torch.randn(args.batch, 1, ops[form].dtheta, generator=torch.Generator().manual_seed(2))
        results[form] = (ops[form].jt(u), ops[form].j(v), kmv)
    difference = max(float((a - b).norm() / b.norm()) for a, b in zip(results["unfolded"], results["grouped"]))
    times: dict[tuple[str, str], list[float]] = {}
    for _ in range(args.rounds):  # the two forms alternate, so the machine's drift falls on both
        for form, op in ops.items():
            for name, fn in (("jt", lambda: op.jt(u)), ("j", lambda: op.j(v)), ("kmv", lambda: op.kmv(u))):
                times.setdefault((form, name), []).append(ms_per_call(fn, args.reps))
    print(f"{args.model} B={args.batch} (one CPU thread; ms per product, median of {args.rounds} × {args.reps})")
    print("| product | grouped | unfolded | unfolded ÷ grouped |\n| --- | --- | --- | --- |")
    for name in ("jt", "j", "kmv"):
        a, b = (statistics.median(times[(f, name)]) for f in ("grouped", "unfolded"))
        print(f"| {name} | {a:.2f} | {b:.2f} | {b / a:.2f} |")
    print(f"| first K (builds the pullbacks) | {first['grouped']:.1f} | {first['unfolded']:.1f} | "
          f"{first['unfolded'] / first['grouped']:.2f} |")
    print(f"largest relative difference between the forms: {difference:.1e}")


if __name__ == "__main__":
    main()
