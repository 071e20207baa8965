"""The direct path's products where a chunk is one sample, in two forms interleaved in one process, × a training step:
``vmap`` over chunks of one against one sample at a time with plain autograd (``--forms vmap,autograd``, the default;
``flguard.risk.direct.ONE_AT_A_TIME``), or plain autograd with PyTorch's own convolution nodes against convolutions'
input gradients as transposed convolutions (``--forms autograd,transposed``;
``flguard.risk.sample_autograd.TRANSPOSED_INPUT_GRADS``).

Products on the operator the guard builds (the zoo's model at its seeded initialisation; a product's cost does not
depend on training): the clipped K product (median clipping, the guard's default; what the solvers run), J_iᵀu and
J_iv with one vector per sample, the summed Jᵀ product (resolvent noise's) and the per-sample gradients. Printed:
medians over ``--repeats`` rounds, each round timing a training step and every product in both forms, and the
largest relative difference between the forms' outputs.

    cd benchmarks && OMP_NUM_THREADS=1 ../.venv/bin/python bench_sample_autograd.py --model resnet18_gn --batch 8
    cd benchmarks && OMP_NUM_THREADS=1 ../.venv/bin/python bench_sample_autograd.py --forms autograd,transposed
"""

from __future__ import annotations

import argparse
import time

import torch

from flguard.models import create
from flguard.risk import direct, sample_autograd
from flguard.risk.clipped import ClippedJacobian
from flguard.risk.operator import JacobianOperator


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet18_gn")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--forms", default="vmap,autograd", choices=["vmap,autograd", "autograd,transposed"])
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = create(args.model, in_channels=3, num_classes=10, image_size=32)
    x, y = torch.randn(args.batch, 3, 32, 32), torch.randint(0, 10, (args.batch,))
    op = JacobianOperator(model, x, y, products="direct")
    op.sample_chunk = 1  # what the CPU's sizing gives a ResNet-18; forced so that any model can be compared
    clipped = ClippedJacobian(op, float(op.per_sample_gradients().norm(dim=1).median()))
    u, v = torch.randn(args.batch, 1, op.dx), torch.randn(args.batch, 1, op.dtheta)

    def gradients() -> torch.Tensor:
        op.__dict__.pop("_per_sample", None)
        return op.per_sample_gradients()

    products = {"clipped K": lambda: clipped.kmv(u), "Jᵀu": lambda: op.jt(u), "Jv": lambda: op.j(v),
                "Σ Jᵀu": lambda: op.jt_sum(u[:, 0]), "per-sample gradients": gradients}

    def train() -> None:
        model.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()

    times: dict[str, list[float]] = {}
    outputs: dict[tuple[str, bool], torch.Tensor] = {}
    for _ in range(args.repeats):
        start = time.perf_counter()
        train()
        times.setdefault("train", []).append(time.perf_counter() - start)
        for looped in (False, True):
            if args.forms == "vmap,autograd":
                direct.ONE_AT_A_TIME, sample_autograd.TRANSPOSED_INPUT_GRADS = looped, False
            else:
                direct.ONE_AT_A_TIME, sample_autograd.TRANSPOSED_INPUT_GRADS = True, looped
            for name, product in products.items():
                start = time.perf_counter()
                outputs[name, looped] = product()
                times.setdefault(f"{name}|{looped}", []).append(time.perf_counter() - start)
    direct.ONE_AT_A_TIME = sample_autograd.TRANSPOSED_INPUT_GRADS = True
    median = {k: sorted(t)[len(t) // 2] for k, t in times.items()}
    step = median["train"]
    print(f"{args.model} B={args.batch}, one CPU thread: training step {step * 1e3:.0f} ms")
    first, second = {"vmap,autograd": ("vmap, chunks of one", "one at a time, autograd"),
                     "autograd,transposed": ("autograd", "autograd, transposed input gradients")}[args.forms]
    print(f"| product | {first} | {second} | ratio | relative difference |")
    print("| --- | --- | --- | --- | --- |")
    for name in products:
        before, after = median[f"{name}|False"], median[f"{name}|True"]
        a, b = outputs[name, False], outputs[name, True]
        diff = float((a - b).norm() / a.norm().clamp_min(1e-30))
        print(f"| {name} | {before / step:.2f}× | {after / step:.2f}× | {after / before:.2f} | {diff:.1e} |")


if __name__ == "__main__":
    main()
