"""Issue 12's doubt: are eigen-guarded one-sample probes recognisable more often than gaussian ones?

The demo's classifier read 3 of 3 (1 of 3 in another run) of the eigen guard's probe
reconstructions and 0 of 3 of the gaussian guard's, all at ≤ 9.9 dB pixel PSNR — six probes per
defense. This study takes more: ``--samples`` clients' examples (outside the public split, as
study 8 ``--trained`` draws them), each uploaded as a B = 1 FedSGD gradient of the demo's
warm-started CNN, unguarded and under the demo's gaussian and eigen guards (their configs from
``simulations/default.toml``, seed per sample), attacked by GS in the server's strongest-attack mode
(TV sweep, best matching loss; 1,000 iterations as study 8 ``--trained``), reconstructions clipped
to the pixel box. "Recognised" = the demo's classifier (the attacked model itself) gives the
reconstruction the class it gives the original. Beside it, the same classifier on the original plus
isotropic pixel noise at the reconstruction's own PSNR: how recognisable an error of that size is
when it has no structure.

    OMP_NUM_THREADS=1 python benchmarks/study_recognisable.py [--samples 20]
"""

from __future__ import annotations

import argparse
import csv
import sys
import time
from pathlib import Path

import torch

from flguard import Guard
from flguard.attacks import metrics, reconstruct
from study_floor import at_psnr, direction
from study_promise import batch_gradient, guard_for, trained_model_and_batch, trained_setup

ROOT = Path(__file__).resolve().parents[1]


def same_class(model: torch.nn.Module, data, image: torch.Tensor, original: torch.Tensor) -> bool:
    with torch.no_grad():
        return bool(model(data.normalize(image)).argmax(1) == model(data.normalize(original)).argmax(1))


def noise_at(original: torch.Tensor, psnr: float, generator: torch.Generator) -> torch.Tensor:
    """original + isotropic pixel noise, clipped to [0, 1], at ``psnr`` dB (study_floor's "noise")."""
    return at_psnr(original, direction("noise", original, original, generator), psnr, bounded=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=20)
    parser.add_argument("--gs-iterations", type=int, default=1000)
    parser.add_argument("--sample-seed", type=int, default=2, help="study 8 used 0 and 1")
    parser.add_argument("--config", default=str(ROOT / "simulations" / "default.toml"))
    args = parser.parse_args()
    args.model, args.defenses, args.device, args.trained = "cnn", ["gaussian", "eigen"], "cpu", True
    torch.set_num_threads(1)
    trained_setup(args)
    model, xs, ys, data, indices = trained_model_and_batch(args, args.samples, 0)
    generator = torch.Generator().manual_seed(0)
    rows, start = [], time.perf_counter()
    for i in range(args.samples):
        x, y = xs[i:i + 1], ys[i:i + 1]
        gradient = batch_gradient(model, x, y)
        original = data.denormalize(x).clamp(0, 1)
        for defense in ("none", "gaussian", "eigen"):
            sent = gradient
            if defense != "none":
                sent = Guard(guard_for(args, defense, args.taus[0], 1000 * i + 1)).protect(model, x, y, gradient).gradient
            row = {"sample": i, "index": int(indices[i]), "label": int(y), "defense": defense, "sent": sent is not None}
            if sent is not None:
                result = reconstruct(model, sent, x.shape[1:], method="gs", labels=y, batch_size=1, restarts=1,
                                     seed=0, iterations=args.gs_iterations, strongest=True, mean=data.mean, std=data.std)
                image = data.denormalize(result.images.detach().clamp(*args.box)).clamp(0, 1)
                psnr = float(metrics.psnr(image, original))
                row.update(psnr=psnr, recognised=same_class(model, data, image, original),
                           noise_recognised=same_class(model, data, noise_at(original, psnr, generator), original))
            rows.append(row)
            print(f"  sample {i} {defense:<8} " + (f"{row['psnr']:5.1f} dB recognised {row['recognised']}"
                                                   if sent is not None else "withheld"), file=sys.stderr, flush=True)
    path = ROOT / "benchmarks" / "results" / "recognisable.csv"
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=sorted({k for r in rows for k in r}))
        writer.writeheader()
        writer.writerows(rows)
    print(f"{args.samples} B = 1 probes of the demo's trained CNN, GS strongest {args.gs_iterations} its; "
          f"{(time.perf_counter() - start) / 60:.1f} min\n")
    print("| defense | probes | withheld | recognised | median PSNR (dB) | max PSNR (dB) | isotropic noise at the same PSNR: recognised |")
    print("|---|---|---|---|---|---|---|")
    for defense in ("none", "gaussian", "eigen"):
        group = [r for r in rows if r["defense"] == defense]
        sent = [r for r in group if r["sent"]]
        psnrs = sorted(r["psnr"] for r in sent)
        print(f"| {defense} | {len(group)} | {len(group) - len(sent)} | {sum(r['recognised'] for r in sent)} / {len(sent)} | "
              f"{psnrs[len(psnrs) // 2]:.1f} | {psnrs[-1]:.1f} | {sum(r['noise_recognised'] for r in sent)} / {len(sent)} |")
    print(f"\nwrote {path.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
