"""``Guard.protect`` on a few batches of a trained model, one line per batch: to compare two commits (or two
settings) on the same batches.

The model and batches are ``bench_guard_models.py``'s (trained unguarded from a fixed seed; batch k drawn with
seed k); the guard has the data's normalisation, ``seed=0`` and any ``FIELD=VALUE`` given. Printed per batch:
whether the floor was met, the kind sent, the guard's seconds, Jacobian products per sample, the noise in units
of the clipping norm C, samples left out (negligible ones), and the least certified RMSE over τ.
``--stop-at-rtol``: every sample's solve to rtol (``flguard.guard.floor.STOP_WHEN_SUFFICIENT`` off), the
practice before the solves stopped each sample once it certifies.

    cd benchmarks && OMP_NUM_THREADS=1 ../.venv/bin/python bench_guard_batches.py --model cnn --batch 32 --batches 6
    cd benchmarks && OMP_NUM_THREADS=1 ../.venv/bin/python bench_guard_batches.py --model cnn --batches 6 rtol=0.03
    cd benchmarks && OMP_NUM_THREADS=1 ../.venv/bin/python bench_guard_batches.py --model cnn --batches 6 --stop-at-rtol
    # another commit on the same batches: PYTHONPATH=<its worktree> ../.venv/bin/python bench_guard_batches.py …
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from _common import guard_settings
from bench_guard_models import trained_batches
from flguard import Guard, GuardConfig
from flguard.guard import floor


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stop-at-rtol", action="store_true", help="solve every sample to rtol")
    parser.add_argument("settings", nargs="*", metavar="FIELD=VALUE")
    args, model, data, batches = trained_batches(parser)
    floor.STOP_WHEN_SUFFICIENT = not args.stop_at_rtol
    seconds = []
    print("| batch | met | kind | guard s | products/sample | noise / C | left out (negligible) | min RMSE / τ |\n"
          "|---|---|---|---|---|---|---|---|")
    for seed, xb, yb, g in batches:
        guard = Guard(GuardConfig(pixel_mean=data.mean, pixel_std=data.std, seed=0, **guard_settings(args.settings)))
        start = time.perf_counter()
        report = guard.protect(model, xb, yb, g).report
        seconds.append(time.perf_counter() - start)
        d = report.details
        noise = report.noise_norm / d["clip"] if d.get("clip") else float("nan")
        print(f"| {seed} | {report.met} | {d.get('defense_used', report.defense)} | {seconds[-1]:.2f} | {report.matvecs:.1f} | "
              f"{noise:.4g} | {d.get('excluded', 0)} ({d.get('excluded_negligible', 0)}) | "
              f"{float(report.rmse_after.min()) / report.min_rmse:.3f} |", flush=True)
    print(f"median guard seconds per batch: {statistics.median(seconds):.3f}")


if __name__ == "__main__":
    main()
