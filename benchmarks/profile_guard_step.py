"""Where a guarded step's time goes, beyond the products' own timings: one model trained as ``bench_guard_models.py``
trains it, ``--warmup`` guarded steps, then ``--steps`` guarded steps under ``cProfile`` (the guard's Python-level
phases, cumulative) and ``torch.profiler`` (the operators, by self time on the device and on the CPU). On a GPU
each step is closed by a synchronisation, so the Python-level times are the step's own.

    cd benchmarks && OMP_NUM_THREADS=1 ../.venv/bin/python profile_guard_step.py --model cnn --batch 32
    cd benchmarks && python profile_guard_step.py --device cuda --model resnet18_gn --batch 32 --shrink off

Printed only (the tables are for reading, not for a results file): seconds per step, products per sample, the
guard's functions by cumulative time, the operators by self time.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

import torch

from _common import guarded_step, synchronize
from bench_guard_models import LEARNING_RATE, _task


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="cnn")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--train-steps", type=int, default=150)
    parser.add_argument("--shrink", choices=["default", "on", "off"], default="default",
                        help="the solves' products on their still-iterating samples (SHRINK_TO_ACTIVE) or not")
    parser.add_argument("--rows", type=int, default=30, help="rows of each table")
    args = parser.parse_args()
    from flguard import GuardConfig, make_guarded
    from flguard.risk import regularised

    if args.shrink != "default":
        regularised.SHRINK_TO_ACTIVE = args.shrink == "on"
    model, (x, y), _, data = _task(args.model, args.train_steps, args.device, 0)
    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE[args.model] / 5)
    criterion = torch.nn.CrossEntropyLoss()
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(1))
    batches = order[:(args.warmup + args.steps) * args.batch].split(args.batch)
    model, optimizer, criterion = make_guarded(model, optimizer, criterion,
                                               GuardConfig(pixel_mean=data.mean, pixel_std=data.std, seed=1))

    def step(idx: torch.Tensor) -> None:
        guarded_step(model, optimizer, criterion, x[idx], y[idx])  # a withheld step is profiled as well
        synchronize(args.device)

    for idx in batches[:args.warmup]:
        step(idx)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.device(args.device).type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    python = cProfile.Profile()
    start = time.perf_counter()
    with torch.profiler.profile(activities=activities) as trace:
        python.enable()
        for idx in batches[args.warmup:]:
            step(idx)
        python.disable()
    seconds = (time.perf_counter() - start) / args.steps
    reports = optimizer.guard_reports[args.warmup:]
    print(f"{args.model} B={args.batch} {args.device}: {seconds:.3f} s per profiled step (both profilers on), "
          f"{sum(r.matvecs for r in reports) / len(reports):.1f} products per sample, "
          f"{sum(r.met for r in reports)}/{len(reports)} sent")
    text = io.StringIO()
    pstats.Stats(python, stream=text).sort_stats("cumulative").print_stats("flguard", args.rows)
    print(text.getvalue())
    key = "self_cuda_time_total" if len(activities) > 1 else "self_cpu_time_total"
    print(trace.key_averages().table(sort_by=key, row_limit=args.rows))
    if len(activities) > 1:
        print(trace.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))


if __name__ == "__main__":
    main()
