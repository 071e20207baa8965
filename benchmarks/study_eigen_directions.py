"""Eigen-directions study (seed 000 §5.1, Fig. 6): at equal noise norm, does the attack's error
scale as 1/λ of the eigen-direction the gradient is perturbed along?

For a few MNIST-5k samples (LeNet, uniform init, B = 1), K_i = J_iJ_iᵀ is formed densely (dx = 784
Jᵀ products, eigh in float64) and eigenpairs (λ_j, u_j) are picked at log-spaced eigenvalues from
λmax down to ``--lambda-ratio``·λmax. The upload is g + a·v_j with v_j = J_iᵀu_j/√λ_j (the right
singular vector, unit norm) and one fixed a for every sample and direction; DLG (labels known)
(L-BFGS with a strong-Wolfe line search) reconstructs. To first order the recovery moves by a/√λ_j along u_j, so MSE = a²/(λ_j·dx) in
model-input units (I2F with ε → 0; slope −1 on log-log axes). Also reported: flguard's I2F at its
default ε = 1e-2·λmax (what the guard uses) and the lower bound I_lb, for the same δ.

    python benchmarks/study_eigen_directions.py          # CPU default: 4 samples × 6 directions
    python benchmarks/study_eigen_directions.py --full --device cuda
"""

from __future__ import annotations

import math
import time

import numpy as np
import torch

from _common import dense_jacobian, flat_gradient, model_and_batch, pixel_scores, parse_study_args, study_argparser, study_paths, write_table
from flguard.attacks import reconstruct
from flguard.risk import assess
from flguard.risk.operator import JacobianOperator


def directions(model, x, y, count: int, ratio: float) -> list[tuple[int, float, torch.Tensor]]:
    """(rank from the top, λ_j, unit v_j) at eigenvalues log-spaced from λmax to ratio·λmax."""
    op = JacobianOperator(model, x, y)
    jac = dense_jacobian(op)[0].double()
    lam, vectors = torch.linalg.eigh(jac @ jac.T)
    targets = np.geomspace(float(lam[-1]), float(lam[-1]) * ratio, count)
    picked = sorted({int(torch.argmin((lam.clamp_min(1e-300).log() - math.log(t)).abs())) for t in targets}, reverse=True)
    out = []
    for index in picked:
        v = jac.T @ vectors[:, index]
        out.append((op.dx - 1 - index, float(lam[index]), (v / v.norm()).to(x.dtype)))
    return out


def slope(lams, mses) -> float:
    return float(np.polyfit(np.log(lams), np.log(mses), 1)[0])


def figure(rows, images, path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = plt.figure(figsize=(13, 7.5))
    grid = fig.add_gridspec(2, len(images), height_ratios=(3, 1))
    ax = fig.add_subplot(grid[0, :])
    samples = sorted({r["sample"] for r in rows})
    for s in samples:
        part = [r for r in rows if r["sample"] == s]
        lam = [r["lambda"] for r in part]
        line, = ax.plot(lam, [r["mse_measured"] for r in part], "o", label=f"sample {s}: DLG measured")
        ax.plot(lam, [r["mse_i2f_eps0"] for r in part], "-", color=line.get_color(), alpha=0.6)
        ax.plot(lam, [r["mse_i2f_default"] for r in part], "x", color=line.get_color(), alpha=0.8)
    pooled = slope([r["lambda"] for r in rows], [r["mse_measured"] for r in rows])
    ax.set(xscale="log", yscale="log", xlabel="λ_j of the perturbed direction",
           ylabel="MSE (model-input units)",
           title=f"equal noise norm along v_j: measured DLG MSE (o), a²/(λ·dx) (line), flguard I2F at ε=1e-2·λmax (x); "
                 f"pooled slope {pooled:.2f}")
    ax.legend(fontsize=8)
    for c_i, (caption, image) in enumerate(images):
        sub = fig.add_subplot(grid[1, c_i])
        sub.imshow(image, cmap="gray", vmin=0, vmax=1)
        sub.set_title(caption, fontsize=8)
        sub.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = study_argparser(__doc__)
    parser.add_argument("--samples", type=int, default=None, help="(4; --full 10)")
    parser.add_argument("--directions", type=int, default=None, help="eigen-directions per sample (6; --full 8)")
    parser.add_argument("--lambda-ratio", type=float, default=1e-4, help="smallest picked λ relative to λmax")
    parser.add_argument("--target-rmse", type=float, default=0.3,
                        help="first-order RMSE (input units) of the smallest picked λ; fixes the noise norm a")
    parser.add_argument("--dlg-steps", type=int, default=None, help="L-BFGS step calls of 20 its (20; --full 50)")
    parser.add_argument("--restarts", type=int, default=None, help="(1; --full 2)")
    parser.add_argument("--line-search", default="strong_wolfe", type=lambda s: None if s == "none" else s,
                        help="DLG's L-BFGS line search: strong_wolfe (default: without it L-BFGS at lr 1 "
                             "diverges on some perturbed uploads) or none (the published DLG)")
    args = parse_study_args(parser, full={"samples": 10, "directions": 8, "dlg_steps": 50, "restarts": 2},
                            cpu={"samples": 4, "directions": 6, "dlg_steps": 20, "restarts": 1})
    start = time.perf_counter()
    model, xs, ys, data = model_and_batch("lenet", "mnist5k", args.samples, seed=args.seed, device=args.device, offset=300)
    picked = [directions(model, xs[i:i + 1], ys[i:i + 1], args.directions, args.lambda_ratio) for i in range(args.samples)]
    dx = xs[0].numel()
    a = args.target_rmse * math.sqrt(dx * min(lam for p in picked for _, lam, _ in p))
    print(f"Eigen-directions study: LeNet uniform init, MNIST-5k, B=1, {args.samples} samples × ≤{args.directions} "
          f"directions, DLG {args.dlg_steps}×20 L-BFGS ({args.line_search or 'no'} line search), restarts {args.restarts}; noise norm a = {a:.4g}", flush=True)
    rows, images = [], []
    for i in range(args.samples):
        x, y = xs[i:i + 1], ys[i:i + 1]
        g = flat_gradient(model, x, y)
        if i == 0:
            images.append(("original", data.denormalize(x.cpu())[0, 0].numpy()))
        for rank, lam, v in picked[i]:
            delta = a * v
            rec = reconstruct(model, g + delta, x.shape[1:], method="dlg", labels=y, iterations=args.dlg_steps,
                              restarts=args.restarts, seed=i, line_search=args.line_search)
            report = assess(model, x, y, delta=delta, metrics=("lambda_max", "rmse_i2f", "rmse_i2f_lb"))
            measured = float((rec.images.cpu() - x.cpu()).pow(2).mean())
            rows.append({"sample": i, "label": int(y), "rank": rank, "lambda": lam,
                         "lambda_over_max": lam / float(report.lambda_max), "noise_norm": a,
                         "mse_measured": measured, "mse_i2f_eps0": a * a / (lam * dx),
                         "mse_i2f_default": float(report.rmse_i2f) ** 2, "mse_i2f_lb": float(report.rmse_i2f_lb) ** 2,
                         "pixel_mse": pixel_scores(data, rec.images, x)["mse"][0]})
            if i == 0:
                images.append((f"λ={lam:.2g}", data.denormalize(rec.images.cpu()).clamp(0, 1)[0, 0].numpy()))
        print(f"  sample {i}: done", flush=True)
    figure_path, table_path = study_paths("eigen_directions")
    for r in rows:
        r["measured_over_eps0"] = r["mse_measured"] / r["mse_i2f_eps0"]
    print(write_table(rows, table_path, ["sample", "label", "rank", "lambda", "lambda_over_max", "mse_measured",
                                         "mse_i2f_eps0", "measured_over_eps0", "mse_i2f_default", "mse_i2f_lb"], digits=3))
    print("\nfitted log-log slope of measured MSE vs λ (claim ≈ −1):")
    for i in range(args.samples):
        part = [r for r in rows if r["sample"] == i]
        print(f"  sample {i}: {slope([r['lambda'] for r in part], [r['mse_measured'] for r in part]):+.2f}")
    print(f"  pooled:   {slope([r['lambda'] for r in rows], [r['mse_measured'] for r in rows]):+.2f}")
    print(f"  flguard I2F at ε=1e-2·λmax, pooled: "
          f"{slope([r['lambda'] for r in rows], [r['mse_i2f_default'] for r in rows]):+.2f}")
    ratios = sorted(r["measured_over_eps0"] for r in rows)
    print(f"measured / (a²/(λ·dx)): median {ratios[len(ratios) // 2]:.2f}, range {ratios[0]:.2f}..{ratios[-1]:.2f}")
    figure(rows, images, figure_path)
    print(f"\nfigure {figure_path}\ntable {table_path}\nwall time {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
