"""The batched K product with GroupNorm's second derivative in closed form against PyTorch's composite.

``flguard.risk.ghost_group_norm`` against ``F.group_norm`` in one process: a trained model of
``bench_guard_models.py``, one batch, a ``GhostKmv`` built each way (``ghost_forward.CLOSED_FORM_GROUP_NORM``), then
K products timed in alternation, and each form's operations per product counted at PyTorch's dispatcher (on a GPU
each is a kernel).

    cd benchmarks && OMP_NUM_THREADS=1 ../.venv/bin/python bench_group_norm_passes.py --model resnet20_gn --batch 8
    cd benchmarks && OMP_NUM_THREADS=1 ../.venv/bin/python bench_group_norm_passes.py --model resnet18_gn --batch 8 \
        --train-steps 20 --rounds 3 --reps 2

Printed: milliseconds per K product (median of ``--rounds`` rounds of ``--reps`` products), its graphs' build
(pass 1), operations per product and per build, closed form ÷ composite, and the products' relative difference.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from _common import add_product_arguments, ms_per_call
from bench_guard_models import _task
from flguard.risk import ghost_forward, ghost_products
from flguard.risk.ghost_products import GhostKmv
from flguard.risk.operator import JacobianOperator

FORMS = {"composite": False, "closed form": True}


class _Operations(TorchDispatchMode):
    """Counts the operations PyTorch's dispatcher runs (views and metadata included)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count[str(func)] += 1
        return func(*args, **(kwargs or {}))


def _ghost(model: torch.nn.Module, op: JacobianOperator, closed_form: bool) -> GhostKmv:
    ghost_forward.CLOSED_FORM_GROUP_NORM = closed_form
    return GhostKmv(model, op.params, op.buffers, op.loss_fn, op.x, op.y)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_product_arguments(parser, rounds=5, reps=5)
    parser.set_defaults(model="resnet20_gn", batch=8)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model, (x, y), _, _ = _task(args.model, args.train_steps, "cpu", 0)
    op = JacobianOperator(model, x[:args.batch], y[:args.batch], products="direct")
    u = torch.randn(args.batch, 1, op.dx, generator=torch.Generator().manual_seed(1))
    ghosts, builds, operations, results = {}, {}, {}, {}
    shipped = ghost_forward.CLOSED_FORM_GROUP_NORM
    for form, closed in FORMS.items():
        ghost_products._MEASURED.clear()  # each build measures one sample first
        start = time.perf_counter()
        ghosts[form] = _ghost(model, op, closed)
        builds[form] = (time.perf_counter() - start) * 1e3
        if not ghosts[form].retained:
            raise SystemExit(f"B = {args.batch}: the graphs are rebuilt at each product; take a smaller batch")
        with _Operations() as counted:
            results[form] = ghosts[form](u)
        operations[form] = sum(counted.count.values())
        ghost_products._MEASURED.clear()
        with _Operations() as counted:
            _ghost(model, op, closed)
        operations[form, "build"] = sum(counted.count.values())
    ghost_forward.CLOSED_FORM_GROUP_NORM = shipped
    difference = float((results["closed form"] - results["composite"]).norm() / results["composite"].norm())
    times: dict[str, list[float]] = {form: [] for form in FORMS}
    for _ in range(args.rounds):  # the two forms alternate, so the machine's drift falls on both
        for form, ghost in ghosts.items():
            times[form].append(ms_per_call(lambda: ghost(u), args.reps))  # noqa: B023 (called at once)
    a, b = (statistics.median(times[form]) for form in FORMS)
    print(f"{args.model} B={args.batch} (one CPU thread; K product ms, median of {args.rounds} × {args.reps})")
    print("| | composite | closed form | closed form ÷ composite |\n| --- | --- | --- | --- |")
    print(f"| K product, ms | {a:.1f} | {b:.1f} | {b / a:.3f} |")
    print(f"| graphs' build (pass 1, one sample first), ms | {builds['composite']:.1f} | "
          f"{builds['closed form']:.1f} | {builds['closed form'] / builds['composite']:.3f} |")
    for name, key in (("operations per K product", lambda f: f), ("operations per build", lambda f: (f, "build"))):
        c, d = operations[key("composite")], operations[key("closed form")]
        print(f"| {name} | {c:,} | {d:,} | {d / c:.3f} |")
    print(f"relative difference between the forms' K products: {difference:.1e}")


if __name__ == "__main__":
    main()
