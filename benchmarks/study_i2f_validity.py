"""I²F validity (issue 7, study 1): do I_lb and I²F track and lower-bound measured attack error?

Seed 000 Figs. 1–2: under Gaussian noise δ of several scales, the lower bound I_lb = ‖Jδ‖/λmax
(and I²F = ‖(K + εI)⁻¹Jδ‖), as an RMSE I/√dx in model-input units, tracks and lower-bounds the
RMSE of DLG and GS reconstructions. Seed 003 App. G: how ε changes that.

For each model × dataset, B = 1 FedSGD uploads of a few samples get independent Gaussian noise of
σ × (the gradient's RMS entry) for several σ; DLG (L-BFGS, labels known) and GS (box, no TV)
attack each noisy upload. The predictions come from the exact spectrum of K = JJᵀ, built column by
column from the product K e_j (``flguard.risk.JacobianOperator``, float64) and diagonalised — so
every ε, including 0, is evaluated exactly and at no extra cost; the product's ``assess`` is
checked against it at the default ε. Extends ``study_eps.py`` (which stays as it was) to more
models, datasets, ε values and statistics.

Reported per model × dataset × attack: Pearson (of log values) and Spearman correlation between
predicted and measured RMSE, and the share of uploads where the prediction is ≤ the measured RMSE
(a lower bound). Reconstructions farther from the truth than any image in the pixel box could be
(RMSE > 1/std) count as "diverged": they are in the lower-bound share but not in correlations.

    python benchmarks/study_i2f_validity.py                    # CPU: linear + LeNet, MNIST-5k + LFW, ~8 min
    python benchmarks/study_i2f_validity.py --full --device cuda   # + ResNet18, more samples, longer attacks
"""

from __future__ import annotations

import argparse
import copy
import csv
import math
import statistics
import sys
import time
from pathlib import Path

import torch
from scipy import stats

from _common import model_and_batch
from flguard.attacks import reconstruct
from flguard.risk import JacobianOperator, assess
from flguard.risk.assess import DEFAULT_EPS_RELATIVE

ROOT = Path(__file__).resolve().parents[1]
EPS = (0.0, 1e-4, 1e-3, 1e-2, 1e-1, 1.0)
INITS = {"linear": "default", "lenet": "uniform", "resnet18": "default"}  # LeNet: I²F's attack setting


def dense_kernel(op: JacobianOperator, chunk: int = 64) -> torch.Tensor:
    """K_i = J_iJ_iᵀ [B, dx, dx] from the products K e_j, ``chunk`` unit vectors at a time."""
    eye = torch.eye(op.dx, dtype=op.dtype, device=op.device)
    columns = [op.kmv(eye[s:s + chunk].unsqueeze(0).expand(op.batch_size, -1, -1)) for s in range(0, op.dx, chunk)]
    kernel = torch.cat(columns, dim=1)  # row j of sample i = K_i e_j
    return 0.5 * (kernel + kernel.transpose(1, 2))


def predictions(model, x, y, deltas) -> tuple[dict, torch.Tensor]:
    """Predicted RMSEs for noise ``deltas`` [B, S, dθ]: {'lb': [B, S], ε_rel: [B, S]} and λmax [B]."""
    work = copy.deepcopy(model).double()
    op = JacobianOperator(work, x.double(), y, lambda z, t: torch.nn.functional.cross_entropy(z, t, reduction="sum"))
    lam, vecs = torch.linalg.eigh(dense_kernel(op))
    lam = lam.clamp_min(0)
    lam_max = lam[:, -1]
    jd = op.j(deltas.double())  # [B, S, dx]
    coeff = torch.einsum("bnk,bsn->bsk", vecs, jd)  # J δ in K's eigenbasis
    root = op.dx ** 0.5
    out = {"lb": jd.norm(dim=2) / lam_max.unsqueeze(1) / root}
    for e in EPS:
        denominator = (lam + e * lam_max.unsqueeze(1)).unsqueeze(1)  # [B, 1, dx]
        inverse = torch.where(denominator > 0, 1 / denominator.clamp_min(1e-300), torch.zeros_like(denominator))
        out[e] = (coeff * inverse).norm(dim=2) / root
    return out, lam_max


def run_config(model_name: str, dataset: str, args) -> list[dict]:
    model, xs, ys, data = model_and_batch(model_name, dataset, args.samples, init=INITS[model_name],
                                          offset=args.offset, device=args.device)
    if model_name == "resnet18":
        model.eval()  # BatchNorm with its (initial) running statistics: one sample per upload
    params = [p for p in model.parameters() if p.requires_grad]
    generator = torch.Generator(device=args.device).manual_seed(0)
    grads, deltas = [], []
    for i in range(args.samples):
        loss = torch.nn.functional.cross_entropy(model(xs[i:i + 1]), ys[i:i + 1])
        g = torch.cat([t.reshape(-1) for t in torch.autograd.grad(loss, params)]).detach()
        rms = g.norm() / g.numel() ** 0.5
        z = torch.randn(len(args.sigmas), g.numel(), generator=generator, device=args.device, dtype=g.dtype)
        grads.append(g)
        deltas.append(torch.tensor(args.sigmas, device=args.device, dtype=g.dtype).unsqueeze(1) * rms * z)
    deltas = torch.stack(deltas)  # [B, S, dθ]
    predicted, lam_max = predictions(model, xs, ys, deltas)
    check = assess(model, xs[:1], ys[:1], delta=deltas[0, -1], metrics=("rmse_i2f", "rmse_i2f_lb"))
    agreement = float(check.rmse_i2f[0]) / float(predicted[DEFAULT_EPS_RELATIVE][0, -1])
    print(f"  {model_name}/{dataset}: assess vs exact spectrum at the default ε: ratio {agreement:.4f}", file=sys.stderr)
    rows = []
    for i in range(args.samples):
        x, y = xs[i:i + 1], ys[i:i + 1]
        for s, sigma in enumerate(args.sigmas):
            noisy = grads[i] + deltas[i, s]
            for attack in ("dlg", "gs"):
                hp = (dict(iterations=args.dlg_steps) if attack == "dlg" else
                      dict(iterations=args.gs_iterations, mean=data.mean, std=data.std, tv=0.0))
                rec = reconstruct(model, noisy, x.shape[1:], method=attack, labels=y, restarts=args.restarts,
                                  device=args.device, seed=i, **hp)
                measured = float((rec.images.detach() - x).pow(2).mean().sqrt())
                row = {"model": model_name, "dataset": dataset, "sample": i, "sigma": sigma, "attack": attack,
                       "measured": measured if math.isfinite(measured) else float("inf"),
                       "diverged": not measured <= 1.0 / min(data.std), "lambda_max": float(lam_max[i]),
                       "pred_lb": float(predicted["lb"][i, s])}
                row.update({f"pred_eps_{e:g}": float(predicted[e][i, s]) for e in EPS})
                rows.append(row)
        print(f"  {model_name}/{dataset} sample {i} done ({time.perf_counter() - START:.0f}s)", file=sys.stderr, flush=True)
    return rows


def fit(rows: list[dict], key: str) -> dict:
    """Lower-bound share over all points; correlations over the non-diverged ones."""
    ok = [r for r in rows if not r["diverged"]]
    pred = [r[key] for r in ok]
    meas = [r["measured"] for r in ok]
    out = {"points": len(rows), "diverged": len(rows) - len(ok),
           "lower_bound_share": 100.0 * sum(r[key] <= r["measured"] for r in rows) / max(1, len(rows)),
           "median_ratio": statistics.median(m / p for m, p in zip(meas, pred)) if ok else float("nan"),
           "pearson_log": float("nan"), "spearman": float("nan")}
    if len(ok) >= 3 and len(set(pred)) > 1 and len(set(meas)) > 1:
        out["pearson_log"] = float(stats.pearsonr([math.log10(p) for p in pred], [math.log10(m) for m in meas])[0])
        out["spearman"] = float(stats.spearmanr(pred, meas)[0])
    return out


def figures(rows: list[dict], eps_table: list[dict], stem: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    configs = list(dict.fromkeys((r["model"], r["dataset"]) for r in rows))
    fig, axes = plt.subplots(len(configs), 2, figsize=(9, 2.9 * len(configs)), squeeze=False, constrained_layout=True)
    default_key = f"pred_eps_{DEFAULT_EPS_RELATIVE:g}"
    for row_axes, (model, dataset) in zip(axes, configs):
        for ax, attack in zip(row_axes, ("dlg", "gs")):
            pts = [r for r in rows if (r["model"], r["dataset"], r["attack"]) == (model, dataset, attack) and not r["diverged"]]
            for key, marker, label in (("pred_lb", "o", "I_lb"), (default_key, "x", f"I²F ε={DEFAULT_EPS_RELATIVE:g}·λmax")):
                sc = ax.scatter([r[key] for r in pts], [r["measured"] for r in pts], c=[math.log10(r["sigma"]) for r in pts],
                                marker=marker, cmap="viridis", label=label, alpha=0.8)
            values = [v for r in pts for v in (r["pred_lb"], r[default_key], r["measured"])]
            if values:
                lo, hi = min(values) / 2, max(values) * 2
                ax.plot([lo, hi], [lo, hi], color="grey", lw=1)
            ax.set_xscale("log"), ax.set_yscale("log")
            ax.set_title(f"{model} / {dataset} / {attack.upper()}", fontsize=9)
            ax.set_ylabel("measured RMSE" if attack == "dlg" else "")
    for ax in axes[-1]:
        ax.set_xlabel("predicted RMSE (model-input units)")
    axes[0, 0].legend(fontsize=7)
    fig.colorbar(sc, ax=axes, label="log10 σ (× gradient RMS)", shrink=0.4)
    fig.savefig(f"{stem}.png", dpi=110)
    plt.close(fig)

    fig, axes = plt.subplots(1, 3, figsize=(12, 3.4))
    for attack in ("dlg", "gs"):
        t = [e for e in eps_table if e["attack"] == attack and e["predictor"] != "I_lb"]
        xs = [max(e["eps"], 3e-5) for e in t]  # ε = 0 drawn at the left edge
        for ax, key in zip(axes, ("lower_bound_share", "median_ratio", "spearman")):
            ax.plot(xs, [e[key] for e in t], marker="o", label=f"I²F, {attack.upper()}")
            lb = next(e for e in eps_table if e["attack"] == attack and e["predictor"] == "I_lb")
            ax.axhline(lb[key], ls="--", lw=1, color="C0" if attack == "dlg" else "C1", label=f"I_lb, {attack.upper()}")
    for ax, title in zip(axes, ("prediction ≤ measured (%)", "median measured / predicted", "Spearman ρ")):
        ax.set_xscale("log"), ax.set_title(title, fontsize=10), ax.set_xlabel("ε / λmax  (leftmost point: ε = 0)")
        ax.axvline(DEFAULT_EPS_RELATIVE, color="k", lw=0.8, ls=":")
    axes[1].set_yscale("log")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(f"{stem}_eps.png", dpi=110)
    plt.close(fig)


def write_csv(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(dict.fromkeys(k for r in rows for k in r)))
        writer.writeheader()
        writer.writerows(rows)


START = time.perf_counter()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--full", action="store_true", help="GPU scale: ResNet18 too, more samples, longer attacks")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--models", nargs="+", default=None)
    parser.add_argument("--datasets", nargs="+", default=["mnist5k", "lfw-faces"])
    parser.add_argument("--samples", type=int, default=None)
    parser.add_argument("--sigmas", type=float, nargs="+", default=[0.01, 0.03, 0.1, 0.3],
                        help="noise std relative to the gradient's RMS entry")
    parser.add_argument("--offset", type=int, default=0)
    parser.add_argument("--tag", default="")
    args = parser.parse_args()
    torch.set_num_threads(1)
    args.models = args.models or (["linear", "lenet", "resnet18"] if args.full else ["linear", "lenet"])
    args.samples = args.samples or (12 if args.full else 6)
    args.dlg_steps, args.gs_iterations, args.restarts = (50, 2400, 3) if args.full else (20, 400, 1)
    rows = [r for m in args.models for d in args.datasets for r in run_config(m, d, args)]
    stem = "i2f_validity" + (f"-{args.tag}" if args.tag else "")
    keys = [("I_lb", "pred_lb")] + [(f"I²F ε={e:g}·λmax", f"pred_eps_{e:g}") for e in EPS]
    summary = []
    for (model, dataset) in dict.fromkeys((r["model"], r["dataset"]) for r in rows):
        for attack in ("dlg", "gs"):
            pts = [r for r in rows if (r["model"], r["dataset"], r["attack"]) == (model, dataset, attack)]
            for name, key in (keys[0], (f"I²F ε={DEFAULT_EPS_RELATIVE:g}·λmax", f"pred_eps_{DEFAULT_EPS_RELATIVE:g}")):
                summary.append({"model": model, "dataset": dataset, "attack": attack, "predictor": name, **fit(pts, key)})
    eps_table = []
    for attack in ("dlg", "gs"):
        pts = [r for r in rows if r["attack"] == attack]
        for (name, key), e in zip(keys, (None,) + EPS):
            eps_table.append({"attack": attack, "predictor": name, "eps": e if e is not None else float("nan"), **fit(pts, key)})
    write_csv(ROOT / "benchmarks" / "results" / f"{stem}.csv", rows)
    write_csv(ROOT / "benchmarks" / "results" / f"{stem}_summary.csv", summary)
    write_csv(ROOT / "benchmarks" / "results" / f"{stem}_eps.csv", eps_table)
    (ROOT / "docs" / "figures").mkdir(parents=True, exist_ok=True)
    figures(rows, eps_table, ROOT / "docs" / "figures" / stem)
    print(f"I²F validity: {', '.join(args.models)} × {', '.join(args.datasets)}; {args.samples} samples × σ {args.sigmas} "
          f"(× gradient RMS); DLG {args.dlg_steps}×20 L-BFGS, GS {args.gs_iterations} (box, TV 0), restarts "
          f"{args.restarts}; {(time.perf_counter() - START) / 60:.1f} min wall, {time.process_time() / 60:.1f} min CPU")
    print()
    print("| model | dataset | attack | predictor | points | diverged | Pearson (log) | Spearman | prediction ≤ measured | median measured/predicted |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for s in summary:
        print(f"| {s['model']} | {s['dataset']} | {s['attack'].upper()} | {s['predictor']} | {s['points']} | {s['diverged']} | "
              f"{s['pearson_log']:.2f} | {s['spearman']:.2f} | {s['lower_bound_share']:.0f}% | {s['median_ratio']:.3g} |")
    print()
    print("ε study (all models and datasets pooled):")
    print()
    print("| attack | predictor | prediction ≤ measured | median measured/predicted | Pearson (log) | Spearman |")
    print("| --- | --- | --- | --- | --- | --- |")
    for e in eps_table:
        print(f"| {e['attack'].upper()} | {e['predictor']} | {e['lower_bound_share']:.0f}% | {e['median_ratio']:.3g} | "
              f"{e['pearson_log']:.2f} | {e['spearman']:.2f} |")


if __name__ == "__main__":
    main()
