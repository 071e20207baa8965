"""What batching the guard's per-sample products could buy at most on a CPU: the same passes on B samples one at a time
(as the guard's direct path runs them on a ResNet-18) against one pass on the batch.

    cd benchmarks && OMP_NUM_THREADS=1 ../.venv/bin/python bench_batching_ceiling.py [--model resnet18_gn] [--batch 8]

Two passes, each timed as B passes of one sample and as one pass of B (medians of three): a training step (forward and
backward), and the double-backward pass that one of the guard's J products is (∇θ of the loss with its graph kept,
then ∇x of ⟨∇θ ℓ, w⟩ for a fixed w). With one w shared by the batch the batched pass is exact only for the sum over
samples — the guard's products need each sample's own w_i, which batching has to carry as per-sample weights
(grouped convolutions, vmap's batching rule); so the printed ratio is a ceiling on what batching the per-sample loop
can save, not a product the guard could use as it stands (docs/results.md, "Left", the fifth session's
addendum).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

from flguard.models import create


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="resnet18_gn")
    parser.add_argument("--batch", type=int, default=8)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = create(args.model)
    x, y = torch.randn(args.batch, 3, 32, 32), torch.randint(0, 10, (args.batch,))
    direction = [torch.randn_like(p) for p in model.parameters()]

    def training_step(xb: torch.Tensor, yb: torch.Tensor) -> None:
        model.zero_grad()
        nn.functional.cross_entropy(model(xb), yb).backward()

    def double_backward(xb: torch.Tensor, yb: torch.Tensor) -> None:
        xb = xb.clone().requires_grad_(True)
        grads = torch.autograd.grad(nn.functional.cross_entropy(model(xb), yb), list(model.parameters()),
                                    create_graph=True)
        torch.autograd.grad(sum((g * w).sum() for g, w in zip(grads, direction)), xb)

    for name, run in (("training step", training_step), ("double backward (a J product)", double_backward)):
        run(x, y)
        run(x[:1], y[:1])
        one_at_a_time, batched = [], []
        for _ in range(3):
            start = time.perf_counter()
            for i in range(args.batch):
                run(x[i:i + 1], y[i:i + 1])
            one_at_a_time.append(time.perf_counter() - start)
            start = time.perf_counter()
            run(x, y)
            batched.append(time.perf_counter() - start)
        loop, whole = statistics.median(one_at_a_time), statistics.median(batched)
        print(f"{args.model}, {name}: {args.batch} × B = 1 {loop:.3f} s, one B = {args.batch} {whole:.3f} s, "
              f"ratio {loop / whole:.2f}", flush=True)


if __name__ == "__main__":
    main()
