"""LAVP study (seed 001 Tables 1–3): do Hessian eigenvalues rank samples by attack quality better
than the gradient norm?

For B = 1 FedSGD uploads of LeNet (uniform init) on MNIST-5k and LFW faces, every sample gets
- proxies: grad norm; LAVP-L2 max/min = λmax/λmin of K_i = J_iJ_iᵀ; LAVP-cos max/min = extreme
  eigenvalues of H_cos,i = J_i(I − ĝĝᵀ)J_iᵀ/‖g‖²; fusion √(λmax·cos_min). The eigenvalues are
  exact (dense K_i from dx Jᵀ products, eigvalsh in float64); flguard's `assess` (Lanczos,
  rtol 1e-3) is run beside them and its λmax/λmin are reported too (its λmin is only certified
  to be ≤ rtol·λmax, see the section in docs/studies/lavp.md);
- attacks on the unperturbed gradient: DLG (L2 matching, L-BFGS) and GS (cosine matching, signed
  Adam, pixel box, no TV — so each attack minimises exactly the loss whose Hessian is measured);
- scores on [0, 1] pixels: MSE, SSIM, PSNR.
Reported: Spearman ρ (scipy.stats.spearmanr) of every proxy with every score, per dataset and attack.

    python benchmarks/study_lavp.py            # CPU default: 50 samples per dataset, short attacks
    python benchmarks/study_lavp.py --full --device cuda
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from scipy.stats import spearmanr

from _common import dense_jacobian, flat_gradient, model_and_batch, pixel_scores, parse_study_args, study_argparser, study_paths, write_table
from flguard.attacks import reconstruct
from flguard.risk import assess
from flguard.risk.operator import JacobianOperator

PROXIES = ("grad_norm", "lmax", "lmin", "lmin_flguard", "cos_max", "cos_min", "fusion")
SCORES = ("mse", "ssim", "psnr")
ATTACKS = {"dlg": "L2 (DLG)", "gs": "cosine (GS)"}


def sum_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum reduction: the batched operator's blocks are then the unscaled per-sample J̃_i (= B = 1)."""
    return F.cross_entropy(logits, labels, reduction="sum")


def exact_proxies(model, x, y) -> dict:
    """Dense eigenvalues of K_i and H_cos,i for one sample (float64)."""
    op = JacobianOperator(model, x, y)
    jac = dense_jacobian(op)[0].double()
    k = jac @ jac.T
    g = op.batch_gradient().double()
    w = jac @ g / g.norm()
    lam = torch.linalg.eigvalsh(k)
    cos = torch.linalg.eigvalsh((k - torch.outer(w, w)) / (g @ g))
    lmax, cos_min = float(lam[-1]), max(float(cos[0]), 0.0)
    return {"grad_norm": float(g.norm()), "lmax": lmax, "lmin": max(float(lam[0]), 0.0),
            "cos_max": float(cos[-1]), "cos_min": cos_min, "fusion": (lmax * cos_min) ** 0.5}


def measure(dataset: str, args) -> list[dict]:
    model, xs, ys, data = model_and_batch("lenet", dataset, args.samples, seed=args.seed, device=args.device)
    flguard = assess(model, xs, ys, loss_fn=sum_loss, metrics=("grad_norm", "lambda_max", "lambda_min"))
    rows = []
    for i in range(args.samples):
        x, y = xs[i:i + 1], ys[i:i + 1]
        row = {"dataset": dataset, "sample": i, "label": int(y), **exact_proxies(model, x, y),
               "lmax_flguard": float(flguard.lambda_max[i]), "lmin_flguard": float(flguard.lambda_min[i])}
        g = flat_gradient(model, x, y)
        recs = {"dlg": reconstruct(model, g, x.shape[1:], method="dlg", labels=y, iterations=args.dlg_steps,
                                   restarts=args.restarts, seed=i),
                "gs": reconstruct(model, g, x.shape[1:], method="gs", labels=y, iterations=args.gs_iterations,
                                  restarts=args.restarts, seed=i, mean=data.mean, std=data.std, tv=0.0)}
        for name, rec in recs.items():
            scores = pixel_scores(data, rec.images, x)
            row.update({f"{name}_{s}": scores[s][0] for s in SCORES})
        rows.append(row)
        if (i + 1) % 10 == 0:
            print(f"  {dataset}: {i + 1}/{args.samples} samples", flush=True)
    return rows


def correlations(rows: list[dict]) -> list[dict]:
    table = []
    for dataset in dict.fromkeys(r["dataset"] for r in rows):
        part = [r for r in rows if r["dataset"] == dataset]
        for attack in ATTACKS:
            for proxy in PROXIES:
                entry = {"dataset": dataset, "attack": attack, "proxy": proxy, "n": len(part)}
                for s in SCORES:
                    rho, p = spearmanr([r[proxy] for r in part], [r[f"{attack}_{s}"] for r in part])
                    entry[f"rho_{s}"], entry[f"p_{s}"] = float(rho), float(p)
                table.append(entry)
    return table


def figure(rows: list[dict], table: list[dict], path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = (("grad_norm", "dlg"), ("lmax", "dlg"), ("grad_norm", "gs"), ("cos_min", "gs"))
    datasets = list(dict.fromkeys(r["dataset"] for r in rows))
    fig, axes = plt.subplots(len(datasets), 4, figsize=(16, 3.6 * len(datasets)), squeeze=False)
    for r_i, dataset in enumerate(datasets):
        part = [r for r in rows if r["dataset"] == dataset]
        for c_i, (proxy, attack) in enumerate(panels):
            ax = axes[r_i][c_i]
            rho = next(t["rho_mse"] for t in table if (t["dataset"], t["attack"], t["proxy"]) == (dataset, attack, proxy))
            ax.scatter([r[proxy] for r in part], [max(r[f"{attack}_mse"], 1e-16) for r in part], s=12,
                       c=[r["label"] for r in part], cmap="tab10", vmin=0, vmax=9)
            ax.set(xscale="log", yscale="log", xlabel=proxy, ylabel=f"{attack.upper()} MSE (pixels)")
            ax.set_title(f"{dataset}: {proxy} vs {ATTACKS[attack]}, ρ={rho:.2f}", fontsize=9)
    fig.suptitle("colour = label (the untrained model's gradient norm is mostly set by the label)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = study_argparser(__doc__)
    parser.add_argument("--datasets", nargs="+", default=["mnist5k", "lfw-faces"])
    parser.add_argument("--samples", type=int, default=None, help="per dataset (default 50; --full 100)")
    parser.add_argument("--dlg-steps", type=int, default=None, help="L-BFGS step calls of 20 its (3; --full 50)")
    parser.add_argument("--gs-iterations", type=int, default=None, help="(80; --full 2000)")
    parser.add_argument("--restarts", type=int, default=None, help="(1; --full 3, as seed 001)")
    full = {"samples": 100, "dlg_steps": 50, "gs_iterations": 2000, "restarts": 3}
    cpu = {"samples": 50, "dlg_steps": 3, "gs_iterations": 80, "restarts": 1}
    args = parse_study_args(parser, full=full, cpu=cpu)
    start = time.perf_counter()
    print(f"LAVP study: LeNet uniform init, B=1, {args.samples} samples per dataset; DLG {args.dlg_steps}×20 "
          f"L-BFGS, GS {args.gs_iterations} its (no TV), restarts {args.restarts}", flush=True)
    rows = [row for dataset in args.datasets for row in measure(dataset, args)]
    table = correlations(rows)
    figure_path, table_path = study_paths("lavp")
    write_table(rows, table_path.with_name("lavp_samples.csv"))
    shown = [{**t, "rho (MSE / SSIM / PSNR)": f"{t['rho_mse']:+.2f} / {t['rho_ssim']:+.2f} / {t['rho_psnr']:+.2f}"}
             for t in table]
    write_table(table, table_path)
    print(write_table(shown, None, ["dataset", "attack", "proxy", "n", "rho (MSE / SSIM / PSNR)", "p_mse"], digits=2))
    lmax_gap = max(abs(r["lmax_flguard"] - r["lmax"]) / r["lmax"] for r in rows)
    print(f"\nflguard λmax vs dense: max relative difference {lmax_gap:.1e}")
    for dataset in args.datasets:
        part = [r for r in rows if r["dataset"] == dataset]
        rho = spearmanr([r["lmin_flguard"] for r in part], [r["lmin"] for r in part])[0]
        ratio = sorted(r["lmin_flguard"] / r["lmax"] for r in part)
        pairs = [("grad_norm", "lmax"), ("grad_norm", "cos_min"), ("lmax", "cos_min"), ("dlg_mse", "gs_mse")]
        print(f"{dataset}: ρ between " + ", ".join(
            f"{u}~{v} {spearmanr([r[u] for r in part], [r[v] for r in part])[0]:+.2f}" for u, v in pairs))
        for label in sorted({r["label"] for r in part}):
            group = [r for r in part if r["label"] == label]
            median = lambda key: sorted(r[key] for r in group)[len(group) // 2]  # noqa: E731
            line = (f"  label {label}: n={len(group)}, median grad norm {median('grad_norm'):.3g}, λmax "
                    f"{median('lmax'):.3g}, DLG MSE {median('dlg_mse'):.2e}, GS MSE {median('gs_mse'):.2e}")
            if len(group) >= 20:  # enough for a within-label correlation (the label confound removed)
                line += "; within label ρ(·, MSE): " + ", ".join(
                    f"{a}/{p} {spearmanr([r[p] for r in group], [r[f'{a}_mse'] for r in group])[0]:+.2f}"
                    for a in ATTACKS for p in ("grad_norm", "lmax", "cos_min", "fusion"))
            print(line)
        print(f"{dataset}: flguard λmin (rtol 1e-3) vs dense λmin: ρ = {rho:+.2f}; flguard λmin/λmax "
              f"{ratio[0]:.1e}..{ratio[-1]:.1e}; median pixel MSE DLG "
              f"{sorted(r['dlg_mse'] for r in part)[len(part) // 2]:.2e}, GS {sorted(r['gs_mse'] for r in part)[len(part) // 2]:.2e}")
    figure(rows, table, figure_path)
    print(f"\nfigure {figure_path}\ntable {table_path}\nwall time {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
