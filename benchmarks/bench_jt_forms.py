"""The transposed per-sample product J_iᵀu in its two forms, × a training step of the same batch.

forward-over-reverse: d/dt ∇_θ ℓ(x_i + t·u) at t = 0 (a jvp through the gradient);
reverse-over-reverse: ∇_θ ⟨∇_x ℓ(x_i), u⟩ (the operator's form since issue 22) — equal by the symmetry
of ℓ's mixed second derivatives. ``j`` (J_i v, reverse-of-forward) for reference; every product is
``vmap``-ed over the batch as the operator's direct path does. Printed: medians of 3, and the
relative difference of the two forms.

    OMP_NUM_THREADS=1 python benchmarks/bench_jt_forms.py --model cnn --batch 32
    OMP_NUM_THREADS=1 python benchmarks/bench_jt_forms.py --model resnet18_gn --batch 8
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.func import jvp

from flguard.models import create
from flguard.risk.operator import JacobianOperator


def median_seconds(fn, repeats: int = 3):
    times, out = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2], out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="cnn")
    parser.add_argument("--batch", type=int, default=32)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    shape = (1, 28, 28) if args.model in ("cnn", "lenet") else (3, 32, 32)
    model = create(args.model, in_channels=shape[0], num_classes=10, image_size=shape[1])
    x, y = torch.randn(args.batch, *shape), torch.randint(0, 10, (args.batch,))
    op = JacobianOperator(model, x, y, products="direct")

    def forward_over_reverse(xi, yi, di, ui):
        return jvp(lambda z: op._sample_grad(z, yi, di), (xi,), (ui.reshape(xi.shape),))[1]

    def train():
        model.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()

    step, _ = median_seconds(train)
    u, v = torch.randn(args.batch, 1, op.dx), torch.randn(args.batch, 1, op.dtheta)
    fwd, a = median_seconds(lambda: op._per_sample_products(forward_over_reverse, u))
    rev, b = median_seconds(lambda: op._per_sample_products(op._jt_one, u))
    j, _ = median_seconds(lambda: op._per_sample_products(op._j_one, v))
    print(f"{args.model} B={args.batch}: training step {step * 1e3:.1f} ms; jt forward-over-reverse {fwd / step:.1f}x, "
          f"reverse-over-reverse {rev / step:.1f}x; j {j / step:.1f}x; relative difference "
          f"{float((a - b).norm() / a.norm()):.1e}")


if __name__ == "__main__":
    main()
