"""Which PSNR floor means "not recognisable"? (issue 12 §4: the default floor from measurements)

The guard's floor is a PSNR (pixel RMSE) that no sample's predicted reconstruction may exceed.
PSNR is an average error: whether an image at p dB is still recognisable depends on what the error
looks like. This study puts a number on it for MNIST-5k's digits: the client test images of the
demo's task are perturbed to exactly p dB (per image, by bisection on the perturbation's size,
clipped to the pixel box as an attacker would) with four error shapes, and the demo's trained
classifier (the warm-started quickstart CNN, 91% clean) reads them; SSIM is reported beside it.

- ``noise``: i.i.d. Gaussian pixel noise (the guard's isotropic noise maps to errors like this);
- ``smooth``: Gaussian noise blurred with σ = 1.5 px (the low-frequency error a TV-regularised
  attack such as GS leaves);
- ``fade``: a blend towards the dataset's mean image (a reconstruction that lost contrast);
- ``shift``: a translation of the digit by whole pixels, then blended (an attack that gets the
  shape right in the wrong place: low PSNR, perfectly recognisable).

The second table reads the demo's own reconstructions (``--demo-out``, a finished ``flguard demo``
directory): every attacked image of every defense, matched to its original, is classified by the
same network, and counted as recognised when the class equals the one the network gives the
original — the attacker's view of "recognisable", on what the attacks actually produced.

    python benchmarks/study_floor.py                                 # CPU, ~1 min
    python benchmarks/study_floor.py --demo-out flguard-demo        # + the demo's reconstructions

Writes benchmarks/results/floor.csv (and floor_demo.csv).
"""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from flguard.attacks import metrics
from flguard.compare.config import load_config
from flguard.simulation import task

ROOT = Path(__file__).resolve().parents[1]
SHAPES = ("noise", "smooth", "fade", "shift")


def _blur(images: torch.Tensor, sigma: float = 1.5) -> torch.Tensor:
    radius = int(3 * sigma)
    t = torch.arange(-radius, radius + 1, dtype=images.dtype)
    kernel = torch.exp(-t ** 2 / (2 * sigma ** 2))
    kernel = kernel / kernel.sum()
    c = images.shape[1]
    out = F.conv2d(images, kernel.view(1, 1, 1, -1).expand(c, 1, 1, -1), padding=(0, radius), groups=c)
    return F.conv2d(out, kernel.view(1, 1, -1, 1).expand(c, 1, -1, 1), padding=(radius, 0), groups=c)


def direction(shape: str, images: torch.Tensor, mean_image: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """An error direction per image; the perturbed image is clip(x + a·d) for a scale a ≥ 0."""
    if shape == "noise":
        return torch.randn(images.shape, generator=generator)
    if shape == "smooth":
        return _blur(torch.randn(images.shape, generator=generator))
    if shape == "fade":
        return mean_image.expand_as(images) - images
    if shape == "shift":
        return torch.roll(images, shifts=(3, 3), dims=(2, 3)) - images
    raise ValueError(shape)


def at_psnr(images: torch.Tensor, d: torch.Tensor, target: float, bounded: bool) -> torch.Tensor:
    """clip(x + a·d) with a per image such that PSNR = target dB (bisection; PSNR falls as a grows).
    ``bounded`` directions (fade, shift) reach their end at a = 1: images that cannot get that far
    from the truth stay at a = 1 (their PSNR is then above the target, which favours recognition)."""
    lo = torch.zeros(images.shape[0])
    hi = torch.ones(images.shape[0]) if bounded else torch.full((images.shape[0],), 64.0)
    for _ in range(50):
        mid = (lo + hi) / 2
        out = (images + mid.view(-1, 1, 1, 1) * d).clamp(0, 1)
        too_close = metrics.psnr(out, images) > target
        lo, hi = torch.where(too_close, mid, lo), torch.where(too_close, hi, mid)
    return (images + hi.view(-1, 1, 1, 1) * d).clamp(0, 1)


def write_rows(name: str, rows: list[dict]) -> Path:
    """benchmarks/results/<name>, one row per dict."""
    path = ROOT / "benchmarks" / "results" / name
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--psnr", type=float, nargs="+", default=[5, 7.5, 10, 12.5, 15, 17.5, 20, 25, 30])
    parser.add_argument("--images", type=int, default=600)
    parser.add_argument("--demo-out", type=Path, default=None, help="a finished demo directory to read")
    args = parser.parse_args()
    torch.set_num_threads(1)
    demo = load_config(ROOT / "simulations" / "default.toml")
    t = demo.task
    settings = task.TaskSettings(dataset=t.dataset, model=t.model, init=t.init, num_partitions=t.clients,
                                 partitioning=t.partitioning, alpha=t.alpha, seed=demo.seed,
                                 public_examples=t.public_examples, pretrain_epochs=t.pretrain_epochs)
    model = task.initial_model(settings).eval()
    tests = [task.load_partition(settings, i)[1] for i in range(t.clients)]
    images = torch.cat([d.images for d in tests])[: args.images]
    labels = torch.cat([d.labels for d in tests])[: args.images]
    data = tests[0]
    mean_image = task.load_dataset(t.dataset).images.mean(0, keepdim=True)
    generator = torch.Generator().manual_seed(0)

    def accuracy(x: torch.Tensor) -> float:
        with torch.no_grad():
            return float((model(data.normalize(x)).argmax(1) == labels).float().mean())

    rows = [{"shape": "clean", "psnr": float("inf"), "accuracy": accuracy(images), "ssim": 1.0, "achieved_psnr": None}]
    for shape in SHAPES:
        d = direction(shape, images, mean_image, generator)
        for p in args.psnr:
            out = at_psnr(images, d, p, bounded=shape in ("fade", "shift"))
            rows.append({"shape": shape, "psnr": p, "accuracy": accuracy(out),
                         "ssim": float(metrics.ssim(out, images).mean()),
                         "achieved_psnr": float(metrics.psnr(out, images).median())})
    path = write_rows("floor.csv", rows)
    print(f"clean accuracy {rows[0]['accuracy']:.3f} on {len(images)} client test images (chance 0.1)\n")
    print("| PSNR (dB) | " + " | ".join(f"{s} acc / SSIM" for s in SHAPES) + " |")
    print("|---|" + "---|" * len(SHAPES))
    for p in args.psnr:
        cells = []
        for s in SHAPES:
            r = next(r for r in rows if r["shape"] == s and r["psnr"] == p)
            cells.append(f"{r['accuracy']:.2f} / {r['ssim']:.2f}" + ("" if abs(r["achieved_psnr"] - p) < 0.5
                                                                      else f" (median {r['achieved_psnr']:.1f} dB)"))
        print(f"| {p:g} | " + " | ".join(cells) + " |")
    print(f"\nwrote {path.relative_to(ROOT)}")
    if args.demo_out is not None:
        demo_reconstructions(args.demo_out, model, data)


def demo_reconstructions(out: Path, model: torch.nn.Module, data) -> None:
    """Per defense and attack target: recognised share and PSNR of the demo's reconstructions."""
    rows = []
    with open(out / "rounds.csv", newline="") as handle:
        attacked = [r for r in csv.DictReader(handle) if r["attack_image"]]
    for r in attacked:
        saved = torch.load(out / r["attack_image"], weights_only=False)
        recon, orig = saved["reconstruction"].float(), saved["original"].float()
        recon = recon[metrics.match(recon, orig)]
        with torch.no_grad():
            same = model(data.normalize(recon)).argmax(1) == model(data.normalize(orig)).argmax(1)
        psnr = metrics.psnr(recon, orig)
        rows.extend({"defense": r["defense"], "target": r["attack_target"], "round": int(r["round"]),
                     "psnr": float(p), "recognised": bool(k)} for p, k in zip(psnr, same))
    path = write_rows("floor_demo.csv", rows)
    print(f"\nthe demo's reconstructions ({out}): recognised = same class as the original's\n")
    print("| defense | target | images | recognised | max PSNR (dB) | recognised among PSNR ≥ 15 dB |")
    print("|---|---|---|---|---|---|")
    for key in dict.fromkeys((r["defense"], r["target"]) for r in rows):
        group = [r for r in rows if (r["defense"], r["target"]) == key]
        high = [r for r in group if r["psnr"] >= 15]
        print(f"| {key[0]} | {key[1]} | {len(group)} | {sum(r['recognised'] for r in group) / len(group):.2f} "
              f"| {max(r['psnr'] for r in group):.1f} | "
              + (f"{sum(r['recognised'] for r in high)}/{len(high)}" if high else "–") + " |")
    print(f"\nwrote {path.relative_to(ROOT)}")


if __name__ == "__main__":
    sys.exit(main())
