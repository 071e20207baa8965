"""Seed 002 (Chen & Campbell) Table 3: MSE and PSNR of DLG, GS, R-GAP and hybrid on the eight CNNs.

Setting (seed 002 §4, App. D): untrained nets with uniform init U(−0.5, 0.5), tanh after every
bias-free convolution, FC with bias and 10 outputs, one image per attack (B = 1), known label
(iDLG recovers it here). Images: two LFW faces resized to 32×32 and repeated to 3 channels, so
the nets have exactly the 3×32×32 geometry (and c(M)) of Table 1. The whole run is float64: with
U(−0.5, 0.5) weights the logits saturate and a float32 gradient is mostly rounding noise. DLG and
GS run on a float32 copy of the net (``--optim-dtype``) with that copy's own float32 gradient.

Full settings (default, or ``--full``): DLG 300 L-BFGS steps × 20 inner iterations (the original
loop), GS 4,800 iterations, hybrid 10,000 / 8,000 / 1,000 per layer. ``--quick``: DLG 10 × 20,
GS 300, hybrid 200 / 160 / 20 — CPU minutes instead of hours.

PSNR is 10·log10(1/MSE) on pixels in [0, 1]. Seed 002 prints 10·log10(255²/MSE) with the MSE of
its own image scale (every pair in its Table 3 satisfies that identity), i.e. 48.13 dB more than
this convention for the same MSE; the CSV also carries ``psnr_255`` for that comparison.

    python benchmarks/bench_table3.py --quick --out benchmarks/out/table3
"""

from __future__ import annotations

import argparse
import copy
import csv
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from flguard.attacks.api import reconstruct
from flguard.attacks.metrics import mse
from flguard.data import load
from flguard.models import create
from flguard.models.zoo import CNN_VARIANTS
from flguard.risk.architecture import architecture_index

METHODS = ("dlg", "gs", "rgap", "hybrid")
SETTINGS = {
    "full": {"dlg": {"iterations": 300, "max_iter": 20}, "gs": {"iterations": 4800}, "rgap": {},
             "hybrid": {"iterations": 10_000}},
    "quick": {"dlg": {"iterations": 10, "max_iter": 20}, "gs": {"iterations": 300}, "rgap": {},
              "hybrid": {"iterations": 200}},
}


def faces(count: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``count`` LFW faces as 3×32×32 images in [0, 1] and labels (1 = face)."""
    data = load("lfw-faces")
    index = (data.labels == 1).nonzero().reshape(-1)[:count]
    images = F.interpolate(data.images[index].double(), size=32, mode="bilinear", align_corners=False)
    return images.clamp(0, 1).repeat(1, 3, 1, 1).to(dtype), data.labels[index]


def run(args: argparse.Namespace) -> list[dict]:
    dtype = getattr(torch, args.dtype)
    mode = "quick" if args.quick else "full"
    images, labels = faces(args.images, dtype)
    rows: list[dict] = []
    for name in args.models:
        torch.manual_seed(args.seed)
        model = create(name, init="uniform").to(device=args.device, dtype=dtype)
        index = architecture_index(model, (3, 32, 32))
        for k in range(images.shape[0]):
            x, y = images[k:k + 1].to(args.device), labels[k:k + 1].to(args.device)
            gradient = torch.autograd.grad(F.cross_entropy(model(x), y), list(model.parameters()))
            for method in args.methods:
                attacked, upload = model, gradient
                if method in ("dlg", "gs") and args.optim_dtype != args.dtype:
                    # The optimisation attacks run in their own dtype (float32 unless told).
                    attacked = copy.deepcopy(model).to(getattr(torch, args.optim_dtype))
                    xo = x.to(getattr(torch, args.optim_dtype))
                    upload = torch.autograd.grad(F.cross_entropy(attacked(xo), y), list(attacked.parameters()))
                row = {"model": name, "image": k, "method": method, "mode": mode, "c_M": round(index.c, 2),
                       "rd": " ".join(map(str, index.rank_deficiency))}
                start = time.perf_counter()
                try:
                    rec = reconstruct(attacked, list(upload), (3, 32, 32), method=method, seed=args.seed,
                                      **SETTINGS[mode][method])
                    error = float(mse(rec.images.double().cpu(), x.double().cpu()))
                    row.update(mse=error, psnr=10 * math.log10(1 / error) if error > 0 else math.inf,
                               psnr_255=10 * math.log10(255**2 / error) if error > 0 else math.inf,
                               loss=rec.loss, labels_ok=bool(int(rec.labels[0]) == int(y[0])))
                except Exception as failure:  # report and continue: one method must not sink the table
                    row.update(mse=math.nan, psnr=math.nan, psnr_255=math.nan, loss=math.nan, labels_ok=False,
                               error=f"{type(failure).__name__}: {failure}")
                row["seconds"] = round(time.perf_counter() - start, 2)
                rows.append(row)
                print(f"{name:8} img{k} {method:7} mse={row['mse']:.3e} psnr={row['psnr']:.2f} "
                      f"({row['seconds']}s){'  ' + row['error'] if 'error' in row else ''}", flush=True)
    return rows


def summarise(rows: list[dict], models: list[str], methods: list[str]) -> list[dict]:
    """Mean MSE and PSNR over the images, per model and method (Table 3's layout)."""
    table = []
    for name in models:
        entry: dict = {"model": name}
        for method in methods:
            chosen = [r for r in rows if r["model"] == name and r["method"] == method]
            if not chosen:
                continue
            entry["c_M"] = chosen[0]["c_M"]
            entry[f"{method}_mse"] = sum(r["mse"] for r in chosen) / len(chosen)
            entry[f"{method}_psnr"] = sum(r["psnr"] for r in chosen) / len(chosen)
        table.append(entry)
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    speed = parser.add_mutually_exclusive_group()
    speed.add_argument("--quick", action="store_true", help="reduced iterations for a CPU run")
    speed.add_argument("--full", action="store_true", help="published iterations (the default)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/out/table3"))
    parser.add_argument("--models", nargs="+", default=list(CNN_VARIANTS))
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--images", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="float64", choices=("float64", "float32"))
    parser.add_argument("--optim-dtype", dest="optim_dtype", default="float32", choices=("float64", "float32"),
                        help="dtype of the DLG/GS runs (their implementation optimises in float32)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (1 is fastest for these tiny nets)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = run(args)
    args.out.mkdir(parents=True, exist_ok=True)
    fields = ["model", "image", "method", "mode", "c_M", "rd", "mse", "psnr", "psnr_255", "loss", "labels_ok",
              "seconds", "error"]
    with open(args.out / "table3_runs.csv", "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=fields, restval="")
        writer.writeheader()
        writer.writerows(rows)
    table = summarise(rows, args.models, args.methods)
    columns = ["model", "c_M"] + [f"{m}_{s}" for m in args.methods for s in ("mse", "psnr")]
    with open(args.out / "table3.csv", "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=columns, restval="")
        writer.writeheader()
        writer.writerows(table)
    print(f"\nmode={'quick' if args.quick else 'full'}; MSE, PSNR (dB, peak 1) averaged over {args.images} images")
    print(f"{'model':8} {'c(M)':>9} " + " ".join(f"{m:>20}" for m in args.methods))
    for entry in table:
        cells = " ".join(f"{entry.get(m + '_mse', math.nan):10.3e},{entry.get(m + '_psnr', math.nan):7.2f}"
                         f"  " for m in args.methods)
        print(f"{entry['model']:8} {entry.get('c_M', math.nan):9.2f} {cells}")
    print(f"wrote {args.out / 'table3.csv'} and {args.out / 'table3_runs.csv'}")


if __name__ == "__main__":
    main()
