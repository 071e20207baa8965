"""P1: wall time of ``assess`` for one sample vs a GS attack run to its published length.

``assess`` computes λmax and the I2F lower bound for unit Gaussian noise (what I2F's efficiency
study times). GS runs its preset of 4,800 iterations; on CPU, ResNet18 at that length takes hours,
so by default GS is timed over ``--gs-iterations`` and scaled to 4,800 (the per-iteration cost is
constant: same graph every step). Pass ``--gs-iterations 4800`` to time it whole.

    python benchmarks/bench_assess_vs_attack.py [--models lenet resnet18] [--gs-iterations 100]
"""

from __future__ import annotations

import argparse
import time

import torch

from flguard.attacks import reconstruct
from flguard.risk import assess

PRESET = 4800


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--models", nargs="+", default=["lenet", "resnet18"])
    parser.add_argument("--gs-iterations", type=int, default=100)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    from flguard.models import create

    print(f"P1: assess (λmax + I_lb) vs GS ({PRESET} iterations), one 3×32×32 sample, device={args.device}")
    print(f"{'model':<9} {'assess s':>9} {'matvecs':>8} {'GS s/it':>9} {'GS s (4800)':>12} {'GS/assess':>10}")
    for name in args.models:
        torch.manual_seed(0)
        model = create(name, init="uniform" if name == "lenet" else "default").eval().to(args.device)
        x = torch.randn(1, 3, 32, 32, device=args.device)
        y = torch.tensor([3], device=args.device)
        params = [p for p in model.parameters() if p.requires_grad]
        g = torch.cat([t.reshape(-1) for t in torch.autograd.grad(torch.nn.functional.cross_entropy(model(x), y), params)])
        delta = torch.randn(g.numel(), device=args.device, generator=torch.Generator(device=args.device).manual_seed(0))
        assess(model, x, y, metrics=("lambda_max",))  # first-call set-up
        sync(args.device)
        start = time.perf_counter()
        rep = assess(model, x, y, delta=delta, metrics=("lambda_max", "i2f_lb"))
        sync(args.device)
        risk_seconds = time.perf_counter() - start
        reconstruct(model, g, (3, 32, 32), method="gs", labels=y, iterations=5, seed=0)  # warm-up
        sync(args.device)
        start = time.perf_counter()
        reconstruct(model, g, (3, 32, 32), method="gs", labels=y, iterations=args.gs_iterations, seed=0)
        sync(args.device)
        per_iteration = (time.perf_counter() - start) / args.gs_iterations
        attack_seconds = per_iteration * PRESET
        print(f"{name:<9} {risk_seconds:>9.2f} {rep.matvecs:>8} {per_iteration:>9.4f} {attack_seconds:>12.1f} "
              f"{attack_seconds / risk_seconds:>10.0f}")


if __name__ == "__main__":
    main()
