"""Fairness study (seed 000 §5.2, Fig. 7): homogeneous Gaussian noise protects samples and classes
unequally; does flguard's per-sample floor even it out?

LeNet (uniform init), B = 1 FedSGD uploads of a class-balanced set of samples. Two defenses with
the same mean noise norm:
- homogeneous: δ_i = σ·z_i, one σ for every sample (σ = ``--sigma-rel`` × the median per-sample
  gradient RMS entry);
- floor: flguard's calibrated ``gaussian`` guard at a τ chosen so that its mean noise norm equals
  the homogeneous one (I2F is linear in δ, so the guard's noise is exactly proportional to τ for a
  fixed seed: the guard is run at τ0 and rescaled, and the rescaling is checked on one sample by
  re-running the guard at τ*).
DLG (labels known; L-BFGS with a strong-Wolfe line search, which keeps it from diverging on noisy
uploads) attacks every upload. Reported per defense: per-sample pixel MSE spread (max/min,
coefficient of variation, mean of the worst-protected decile), per-class means, and the predicted
I2F RMSE spread (flguard's I2F, ε = 1e-2·λmax). One sample per class is also attacked without
noise, to show the attack's own error floor is far below the noise-induced error.

    python benchmarks/study_fairness.py                  # CPU default: MNIST-5k, 3 per class
    python benchmarks/study_fairness.py --full --device cuda
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F
from scipy.stats import spearmanr

from _common import flat_gradient, pixel_scores, parse_study_args, study_argparser, study_paths, write_table
from flguard import Guard, GuardConfig
from flguard.attacks import reconstruct
from flguard.data import load
from flguard.models import create
from flguard.risk import assess
from flguard.risk.assess import DEFAULT_EPS_RELATIVE, i2f_norms
from flguard.risk.operator import JacobianOperator

TAU0 = 0.1


def balanced(data, per_class: int, seed: int) -> torch.Tensor:
    order = torch.randperm(len(data), generator=torch.Generator().manual_seed(seed))
    chosen = [i for c in range(data.num_classes) for i in order[data.labels[order] == c][:per_class].tolist()]
    return torch.tensor(chosen)


def sum_loss(logits, labels):
    return F.cross_entropy(logits, labels, reduction="sum")


def predicted_rmse(model, xs, ys, deltas) -> torch.Tensor:
    """flguard's I2F RMSE of each sample's own upload perturbation (batched; sum loss = B=1 blocks)."""
    lam = assess(model, xs, ys, loss_fn=sum_loss, metrics=("lambda_max",)).lambda_max
    op = JacobianOperator(model, xs, ys, sum_loss)
    i2f, _, converged = i2f_norms(op, deltas.to(op.x), DEFAULT_EPS_RELATIVE * lam, 1e-3)
    assert bool(converged.all()), "I2F solve did not converge"
    return i2f / op.dx ** 0.5


def spread(values: list[float]) -> dict:
    ordered = sorted(values)
    decile = ordered[:max(1, len(ordered) // 10)]
    mean = statistics.fmean(values)
    return {"mean": mean, "min": ordered[0], "max": ordered[-1], "max_over_min": ordered[-1] / ordered[0],
            "cv": statistics.pstdev(values) / mean, "worst_decile": statistics.fmean(decile)}


def guard_floor(model, xs, ys, grads, eps: float, target_norm: float):
    """Per-sample calibrated-Gaussian guard noise (B = 1 each) rescaled to mean norm ``target_norm``;
    (noise [N, dθ], predicted RMSE [N], τ*, relative gap of a re-run at τ* on sample 0)."""
    noise, rmse = [], []
    for i in range(len(xs)):
        cfg = GuardConfig(defense="gaussian", min_rmse=TAU0, eps=eps, seed=i, max_rel_noise=1e9)
        out = Guard(cfg).protect(model, xs[i:i + 1], ys[i:i + 1], grads[i])
        assert out.report.met, out.report.reason
        noise.append(out.gradient - grads[i])
        rmse.append(float(out.report.rmse_after[0]))
    scale = target_norm / float(torch.stack(noise).norm(dim=1).mean())
    check = Guard(GuardConfig(defense="gaussian", min_rmse=TAU0 * scale, eps=eps, seed=0, max_rel_noise=1e9)).protect(
        model, xs[:1], ys[:1], grads[0])
    gap = float((check.gradient - grads[0] - scale * noise[0]).norm() / (scale * noise[0]).norm())
    assert gap < 1e-4, f"guard noise is not proportional to τ (relative gap {gap:.1e})"
    return torch.stack(noise) * scale, [r * scale for r in rmse], TAU0 * scale, gap


def run(dataset: str, args) -> tuple[list[dict], list[dict]]:
    data = load(dataset)
    torch.manual_seed(args.seed)
    channels, size, _ = data.shape
    model = create("lenet", in_channels=channels, num_classes=data.num_classes, image_size=size, init="uniform")
    model = model.to(args.device)
    index = balanced(data, args.per_class, args.seed)
    n = len(index)
    xs, ys = data.normalize(data.images[index]).to(args.device), data.labels[index].to(args.device)
    grads = torch.stack([flat_gradient(model, xs[i:i + 1], ys[i:i + 1]) for i in range(n)])
    dtheta = grads.shape[1]
    sigma = args.sigma_rel * float((grads.norm(dim=1) / dtheta ** 0.5).median())
    homogeneous = torch.stack([sigma * torch.randn(dtheta, generator=torch.Generator().manual_seed(1000 + i))
                               for i in range(n)]).to(grads)
    reference = [i for i in range(n) if i % args.per_class < args.reference_per_class]
    conditions = [("homogeneous", homogeneous, predicted_rmse(model, xs, ys, homogeneous).tolist(), sigma, range(n))]
    print(f"{dataset}: {n} samples, homogeneous σ = {sigma:.3g}", flush=True)
    for eps in args.floor_eps:
        noise, rmse, tau, gap = guard_floor(model, xs, ys, grads, eps, float(homogeneous.norm(dim=1).mean()))
        conditions.append((f"floor ε={eps:g}·λmax", noise, rmse, tau, range(n)))
        print(f"  floor ε={eps:g}·λmax: τ* = {tau:.4g} (guard re-run at τ*: relative gap {gap:.1e})", flush=True)
    conditions.append(("none", torch.zeros_like(homogeneous), [0.0] * n, 0.0, reference))
    rows, summary = [], []
    for name, noise, predicted, level, which in conditions:
        part = []
        for i in which:
            x, y = xs[i:i + 1], ys[i:i + 1]
            rec = reconstruct(model, grads[i] + noise[i], x.shape[1:], method="dlg", labels=y,
                              iterations=args.dlg_steps, restarts=args.restarts, seed=i, line_search=args.line_search)
            scores = pixel_scores(data, rec.images, x)
            part.append({"dataset": dataset, "defense": name, "sample": int(index[i]), "label": int(y),
                         "noise_norm": float(noise[i].norm()), "rel_noise": float(noise[i].norm() / grads[i].norm()),
                         "predicted_rmse": predicted[i], "mse": scores["mse"][0], "psnr": scores["psnr"][0],
                         "rmse_input": scores["rmse_input"][0]})
        print(f"  {name}: attacked", flush=True)
        rows += part
        classes = {c: statistics.fmean(r["mse"] for r in part if r["label"] == c) for c in sorted({r["label"] for r in part})}
        mses = [r["mse"] for r in part]
        noisy = name != "none"
        summary.append({"dataset": dataset, "defense": name, "tau_or_sigma": level,
                        "mean_noise_norm": statistics.fmean(r["noise_norm"] for r in part),
                        **{f"mse_{k}": v for k, v in spread(mses).items()},
                        "class_max_over_min": max(classes.values()) / min(classes.values()),
                        "worst_class": min(classes, key=classes.get), "best_class": max(classes, key=classes.get),
                        "predicted_rmse_cv": spread(predicted)["cv"] if noisy else float("nan"),
                        "rho_predicted_mse": float(spearmanr(predicted, mses)[0]) if name == "homogeneous"
                        else float("nan"),  # a floor's prediction is constant by construction
                        "rho_noise_norm_mse": float(spearmanr([r["noise_norm"] for r in part], mses)[0])
                        if noisy else float("nan")})
    return rows, summary


def figure(rows, datasets, path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(datasets), 2, figsize=(13, 4 * len(datasets)), squeeze=False)
    names = [n for n in dict.fromkeys(r["defense"] for r in rows) if n != "none"]
    colors = dict(zip(names, ("tab:red", "tab:blue", "tab:green", "tab:purple")))
    width = 0.8 / len(names)
    for d_i, dataset in enumerate(datasets):
        left, right = axes[d_i]
        for k, name in enumerate(names):
            part = [r for r in rows if r["dataset"] == dataset and r["defense"] == name]
            values = sorted(r["mse"] for r in part)
            left.plot(range(len(values)), values, "o-", ms=3, color=colors[name], label=name)
            left.axhline(statistics.fmean(values), color=colors[name], ls="--", lw=1)
            labels = sorted({r["label"] for r in part})
            offset = (k - (len(names) - 1) / 2) * width
            right.bar([c + offset for c in labels], [statistics.fmean(r["mse"] for r in part if r["label"] == c)
                                                    for c in labels], width=width, color=colors[name], alpha=0.5, label=name)
            right.plot([r["label"] + offset for r in part], [r["mse"] for r in part], ".", color=colors[name])
        reference = [r["mse"] for r in rows if r["dataset"] == dataset and r["defense"] == "none"]
        if reference:
            left.axhline(statistics.fmean(reference), color="gray", ls=":", lw=1, label="no noise (attack floor)")
        left.set(yscale="log", xlabel="samples, sorted", ylabel="DLG pixel MSE",
                 title=f"{dataset}: per-sample MSE at equal mean noise norm (dashed: means)")
        right.set(yscale="log", xlabel="class", ylabel="DLG pixel MSE", title=f"{dataset}: per-class mean (bars) and samples")
        left.legend(fontsize=8)
        right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = study_argparser(__doc__)
    parser.add_argument("--datasets", nargs="+", default=None, help="(mnist5k; --full mnist5k lfw-faces)")
    parser.add_argument("--per-class", type=int, default=None, help="samples per class (3; --full 20)")
    parser.add_argument("--reference-per-class", type=int, default=1,
                        help="samples per class also attacked without noise (the attack's own error floor)")
    parser.add_argument("--floor-eps", type=float, nargs="+", default=[1e-2],
                        help="guard ε values (relative to λmax), one floor defense each (default: flguard's 1e-2)")
    parser.add_argument("--name", default="fairness", help="output name: docs/figures/<name>.png, results/<name>.csv")
    parser.add_argument("--sigma-rel", type=float, default=0.1, help="σ / median per-sample gradient RMS entry")
    parser.add_argument("--dlg-steps", type=int, default=None, help="L-BFGS step calls of 20 its (10; --full 30)")
    parser.add_argument("--restarts", type=int, default=None, help="(1; --full 2)")
    parser.add_argument("--line-search", default="strong_wolfe", type=lambda s: None if s == "none" else s,
                        help="DLG's L-BFGS line search: strong_wolfe (default) or none (the published DLG)")
    args = parse_study_args(parser,
                            full={"datasets": ["mnist5k", "lfw-faces"], "per_class": 20, "dlg_steps": 30, "restarts": 2},
                            cpu={"datasets": ["mnist5k"], "per_class": 3, "dlg_steps": 10, "restarts": 1})
    start = time.perf_counter()
    print(f"Fairness study: LeNet uniform init, B=1, {args.per_class} per class, σ = {args.sigma_rel} × median gradient "
          f"RMS, DLG {args.dlg_steps}×20 L-BFGS, restarts {args.restarts}", flush=True)
    rows, summary = [], []
    for dataset in args.datasets:
        r, s = run(dataset, args)
        rows += r
        summary += s
    figure_path, table_path = study_paths(args.name)
    write_table(rows, table_path.with_name(f"{args.name}_samples.csv"))
    print(write_table(summary, table_path, ["dataset", "defense", "tau_or_sigma", "mean_noise_norm", "mse_mean", "mse_min",
                                            "mse_max", "mse_max_over_min", "mse_cv", "mse_worst_decile",
                                            "class_max_over_min", "worst_class", "predicted_rmse_cv",
                                            "rho_predicted_mse", "rho_noise_norm_mse"], digits=3))
    figure(rows, args.datasets, figure_path)
    print(f"\nfigure {figure_path}\ntable {table_path}\nwall time {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
