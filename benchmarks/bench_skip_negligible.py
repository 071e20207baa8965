"""The one-run solve with and without skipping the negligible samples (``flguard.guard.perturb.SKIP_NEGLIGIBLE``).

On a trained model many samples of a batch are fitted: their clipped gradient is ≤ 1% of C, their
float32 solves rarely certify and ran to SOLVER_MAX_ITER, and the floor then left them out anyway
(free of ``max_excluded``). This runs ``Guard.protect`` with the defaults (only the normalisation
given) on the same batches of the model ``bench_guard_models.py`` trains, each batch twice per
setting (skip on, off, on, off: the second pair shows the timing noise), and prints per batch the
guard's seconds, products per sample, noise (in C), samples left out (negligible ones), and the
ratio of the medians.

    cd benchmarks && OMP_NUM_THREADS=1 ../.venv/bin/python bench_skip_negligible.py --model cnn --batch 32 --batches 6
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import flguard.guard.perturb as perturb
from bench_guard_models import trained_batches
from flguard import Guard, GuardConfig


def main() -> None:
    _, model, data, batches = trained_batches(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    seconds: dict[bool, list[float]] = {True: [], False: []}
    print("| batch | skip | met | guard s | products/sample | noise / C | left out (negligible) |\n|---|---|---|---|---|---|---|")
    for seed, xb, yb, g in batches:
        for skip in (True, False, True, False):
            perturb.SKIP_NEGLIGIBLE = skip
            guard = Guard(GuardConfig(pixel_mean=data.mean, pixel_std=data.std, seed=0))
            start = time.perf_counter()
            report = guard.protect(model, xb, yb, g).report
            seconds[skip].append(time.perf_counter() - start)
            details = report.details
            noise = report.noise_norm / details["clip"] if details.get("clip") else float("nan")
            print(f"| {seed} | {'on' if skip else 'off'} | {report.met} | {seconds[skip][-1]:.2f} | {report.matvecs:.1f} | "
                  f"{noise:.3g} | {details.get('excluded', 0)} ({details.get('excluded_negligible', 0)}) |", flush=True)
    off, on = statistics.median(seconds[False]), statistics.median(seconds[True])
    print(f"median guard seconds per step: skip off {off:.3f}, on {on:.3f}: {off / on:.2f}× faster")


if __name__ == "__main__":
    main()
