"""P7: time per sample of ``assess`` at batch sizes 1, 8, 32, 128 (batching speedup).

One call of ``assess`` measures every sample of a batch together (vmap over samples); this
prints seconds per sample at each B and the speedup over B = 1, from one run.

    python benchmarks/bench_assess_batching.py [--metrics all|core] [--sizes 1 8 32 128] [--device cpu]
"""

from __future__ import annotations

import argparse
import time

import torch

from _common import model_and_batch
from flguard.risk import assess

CORE = ("grad_norm", "lambda_max", "lambda_min", "i2f", "i2f_lb")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--metrics", choices=("all", "core"), default="core")
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 8, 32, 128])
    parser.add_argument("--dataset", default="mnist5k")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    metrics = None if args.metrics == "all" else CORE
    print(f"P7: assess() seconds per sample, LeNet/{args.dataset}, metrics={args.metrics}, device={args.device}")
    warm_model, warm_x, warm_y, _ = model_and_batch("lenet", args.dataset, 2, device=args.device)
    assess(warm_model, warm_x, warm_y, metrics=("lambda_max",))  # first-call set-up out of the timings
    base = None
    print(f"{'B':>5} {'seconds':>9} {'s/sample':>9} {'speedup vs B=1':>15} {'matvecs':>8}")
    for size in args.sizes:
        model, x, y, _ = model_and_batch("lenet", args.dataset, size, device=args.device)
        delta = torch.randn(sum(p.numel() for p in model.parameters()), device=args.device,
                            generator=torch.Generator(device=args.device).manual_seed(0))
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        start = time.perf_counter()
        rep = assess(model, x, y, delta=delta, metrics=metrics)
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        per_sample = (time.perf_counter() - start) / size
        base = base or per_sample
        print(f"{size:>5} {per_sample * size:>9.2f} {per_sample:>9.4f} {base / per_sample:>15.1f} {rep.matvecs:>8}")


if __name__ == "__main__":
    main()
