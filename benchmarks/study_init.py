"""Initialization study (seed 000 §5.3, Fig. 8): under the same Gaussian noise on the gradient, is
a uniformly initialised LeNet riskier (lower attack error) than kaiming/xavier?

LeNet on MNIST-5k, B = 1 FedSGD uploads, the same samples and the same noise draws δ_i = σ·z_i for
every initialisation (uniform U(−0.5, 0.5), normal N(0, 0.5), kaiming, xavier — flguard.models.init),
one model seed per init. Measured: DLG (L2; L-BFGS with a strong-Wolfe line
search) and GS (cosine, pixel box, no TV) pixel MSE. Predicted:
flguard's I2F RMSE at its default ε = 1e-2·λmax and the lower bound I_lb = ‖J_iδ‖/λmax
(model-input units), plus λmax and ‖J_i‖²_F. Each attack is also run on the noiseless gradient: I2F
assumes a perfect attacker, so an init whose clean gradient already defeats the attack is "safe"
for a reason I2F does not model. The claim holds if the measured MSE ranks
uniform (riskiest, lowest) below kaiming/xavier.

    python benchmarks/study_init.py                  # CPU default: 6 samples, σ = 1e-2
    python benchmarks/study_init.py --full --device cuda
"""

from __future__ import annotations

import statistics
import time

import torch

from _common import flat_gradient, model_and_batch, pixel_scores, parse_study_args, study_argparser, study_paths, write_table
from flguard.attacks import reconstruct
from flguard.risk import assess

INITS = ("uniform", "normal", "kaiming", "xavier")


def run(init: str, args) -> list[dict]:
    model, xs, ys, data = model_and_batch("lenet", "mnist5k", args.samples, init=init, seed=args.seed,
                                          device=args.device, offset=500)
    rows = []
    for i in range(args.samples):
        x, y = xs[i:i + 1], ys[i:i + 1]
        g = flat_gradient(model, x, y)
        z = torch.randn(g.numel(), generator=torch.Generator().manual_seed(2000 + i)).to(g)
        delta = args.sigma * z
        report = assess(model, x, y, delta=delta,
                        metrics=("grad_norm", "lambda_max", "jacobian_fro2", "rmse_i2f", "rmse_i2f_lb"))
        row = {"init": init, "sample": i, "label": int(y), "grad_norm": float(report.grad_norm),
               "rel_noise": float(delta.norm() / g.norm()), "lambda_max": float(report.lambda_max),
               "jacobian_fro2": float(report.jacobian_fro2), "pred_rmse_i2f": float(report.rmse_i2f),
               "pred_rmse_lb": float(report.rmse_i2f_lb)}
        attacks = {"dlg": dict(method="dlg", iterations=args.dlg_steps, line_search=args.line_search),
                   "gs": dict(method="gs", iterations=args.gs_iterations, mean=data.mean, std=data.std, tv=0.0)}
        for name, kwargs in attacks.items():
            rec = reconstruct(model, g + delta, x.shape[1:], labels=y, restarts=args.restarts, seed=i, **kwargs)
            scores = pixel_scores(data, rec.images, x)
            row[f"{name}_mse"], row[f"{name}_rmse_input"] = scores["mse"][0], scores["rmse_input"][0]
            if args.reference:  # the same attack on the noiseless gradient: is the init hard to attack anyway?
                clean = reconstruct(model, g, x.shape[1:], labels=y, restarts=args.restarts, seed=i, **kwargs)
                row[f"{name}_mse_clean"] = pixel_scores(data, clean.images, x)["mse"][0]
        rows.append(row)
    return rows


def summarise(rows: list[dict]) -> list[dict]:
    out = []
    for init in INITS:
        part = [r for r in rows if r["init"] == init]
        med = lambda key: statistics.median(r[key] for r in part)  # noqa: E731
        clean = {f"{a}_mse_clean": med(f"{a}_mse_clean") for a in ("dlg", "gs") if f"{a}_mse_clean" in part[0]}
        out.append({"init": init, "n": len(part), "dlg_mse": med("dlg_mse"), "gs_mse": med("gs_mse"), **clean,
                    "dlg_rmse_input": med("dlg_rmse_input"), "pred_rmse_i2f": med("pred_rmse_i2f"),
                    "pred_rmse_lb": med("pred_rmse_lb"), "lambda_max": med("lambda_max"),
                    "jacobian_fro2": med("jacobian_fro2"), "grad_norm": med("grad_norm"), "rel_noise": med("rel_noise")})
    return out


def figure(rows, path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = (("dlg_mse", "DLG pixel MSE (measured)"), ("gs_mse", "GS pixel MSE (measured)"),
              ("pred_rmse_i2f", "I2F RMSE, ε=1e-2·λmax (predicted)"), ("pred_rmse_lb", "I_lb RMSE (predicted)"))
    fig, axes = plt.subplots(1, len(panels), figsize=(16, 3.8))
    for ax, (key, title) in zip(axes, panels):
        values = [[r[key] for r in rows if r["init"] == init] for init in INITS]
        ax.boxplot(values, showfliers=False)
        for k, v in enumerate(values, start=1):
            ax.plot([k] * len(v), v, ".", color="tab:blue", label="with noise σ" if k == 1 else None)
        if f"{key}_clean" in rows[0]:
            for k, init in enumerate(INITS, start=1):
                clean = [r[f"{key}_clean"] for r in rows if r["init"] == init]
                ax.plot([k + 0.25] * len(clean), clean, "x", color="gray", label="no noise" if k == 1 else None)
            ax.legend(fontsize=8)
        ax.set_xticks(range(1, len(INITS) + 1), INITS)
        ax.set(yscale="log", title=title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = study_argparser(__doc__)
    parser.add_argument("--samples", type=int, default=None, help="(6; --full 10, as seed 000)")
    parser.add_argument("--sigma", type=float, default=1e-2, help="noise std per gradient entry (absolute, all inits)")
    parser.add_argument("--dlg-steps", type=int, default=None, help="L-BFGS step calls of 20 its (8; --full 30)")
    parser.add_argument("--gs-iterations", type=int, default=None, help="(200; --full 2000)")
    parser.add_argument("--restarts", type=int, default=None, help="(1; --full 3, as seed 000)")
    parser.add_argument("--line-search", default="strong_wolfe", type=lambda s: None if s == "none" else s,
                        help="DLG's L-BFGS line search: strong_wolfe (default) or none (the published DLG)")
    parser.add_argument("--no-reference", dest="reference", action="store_false",
                        help="skip the noiseless attacks (the attack's own error per init)")
    args = parse_study_args(parser, full={"samples": 10, "dlg_steps": 30, "gs_iterations": 2000, "restarts": 3},
                            cpu={"samples": 6, "dlg_steps": 8, "gs_iterations": 200, "restarts": 1})
    start = time.perf_counter()
    print(f"Initialization study: LeNet, MNIST-5k, B=1, {args.samples} samples, σ = {args.sigma} (same draws for "
          f"every init), DLG {args.dlg_steps}×20 L-BFGS, GS {args.gs_iterations} its, restarts {args.restarts}", flush=True)
    rows = []
    for init in INITS:
        rows += run(init, args)
        print(f"  {init}: done", flush=True)
    figure_path, table_path = study_paths("init")
    write_table(rows, table_path.with_name("init_samples.csv"))
    print("medians over samples:")
    print(write_table(summarise(rows), table_path, digits=3))
    figure(rows, figure_path)
    print(f"\nfigure {figure_path}\ntable {table_path}\nwall time {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
