"""Promise check (issue 7, study 8): does the guard's per-sample floor τ hold against real attacks?

The guard promises that every sample's predicted recovery RMSE (I2F, model-input units) is at
least τ. Here the promise is measured: FedSGD uploads of B = 1 and B = 8 samples are guarded with
the ``gaussian`` and ``eigen`` defenses at several τ, and the server attacks what was sent —
DLG, GS, and for B = 1 (invertible activations) R-GAP and the hybrid attack — with the true labels.
Per sample, the best attack is the one with the lowest RMSE to the truth (model-input units,
Hungarian-matched for B = 8 as ``flguard.flower.malicious.score_batch`` does); the promise is
kept for that sample when this RMSE ≥ τ. The adaptive attacker (``flguard.attacks.adaptive``,
knowing the defense) is scored on its own line, and against all attacks together.

The model is Chen & Campbell's CNN2 V1 (tanh, default init) on MNIST-5k: every attack here
reconstructs an unguarded upload almost exactly (the "none" control row), so an error ≥ τ is the
guard's doing, not an attack failure. ``--full`` adds the I2F LeNet (uniform init), 3 restarts and
longer attacks.

    python benchmarks/study_promise.py                              # CPU, ~8 min
    python benchmarks/study_promise.py --full --device cuda
    python benchmarks/study_promise.py --subspace-size 8 --krylov-steps 32 --no-bounds   # the guard before issue 7
"""

from __future__ import annotations

import argparse
import csv
import statistics
import sys
import time
from pathlib import Path

import torch

from _common import model_and_batch
from flguard import Guard, GuardConfig
from flguard.attacks import metrics, reconstruct

ROOT = Path(__file__).resolve().parents[1]
STANDARD = ("dlg", "gs", "rgap", "hybrid")


def batch_gradient(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    params = [p for p in model.parameters() if p.requires_grad]
    loss = torch.nn.functional.cross_entropy(model(x), y)
    return torch.cat([t.reshape(-1) for t in torch.autograd.grad(loss, params)])


def per_sample_rmse(images: torch.Tensor, truth: torch.Tensor, data) -> torch.Tensor:
    """RMSE per true sample in model-input units after Hungarian matching on clamped pixels."""
    permutation = metrics.match(data.denormalize(images).clamp(0, 1), data.denormalize(truth).clamp(0, 1))
    return (images[permutation] - truth).flatten(1).pow(2).mean(1).sqrt()


def attacks(model, gradient, x, y, data, args, guard_subspace: int) -> dict[str, torch.Tensor]:
    """Every attack's per-sample RMSE on one upload; the adaptive one reuses GS as its first pass."""
    batch = x.shape[0]
    common = dict(labels=y, batch_size=batch, restarts=args.restarts, device=args.device, seed=0)
    gs_hp = dict(mean=data.mean, std=data.std, tv=args.tv)
    out, images = {}, {}
    runs = [("dlg", dict(iterations=args.dlg_steps)), ("gs", dict(iterations=args.gs_iterations, **gs_hp))]
    if batch == 1:
        runs += [("rgap", {}), ("hybrid", dict(iterations=args.hybrid_iterations))]
    for name, hp in runs:
        kw = dict(common, restarts=1) if name in ("rgap", "hybrid") else common
        try:
            rec = reconstruct(model, gradient, x.shape[1:], method=name, **kw, **hp)
            images[name] = rec.images.detach()
            out[name] = per_sample_rmse(images[name], x, data)
        except ValueError as error:  # an architecture the method does not support
            print(f"    {name} skipped: {error}", file=sys.stderr)
    # It knows the defense's subspace_size and covers it with margin (a smaller factor for B = 8,
    # whose 8 subspaces are estimated together, to bound the CPU cost).
    factor = args.adaptive_factor if batch == 1 else max(1, args.adaptive_factor // 2)
    size = factor * guard_subspace
    rec = reconstruct(model, gradient, x.shape[1:], method="adaptive", iterations=args.gs_iterations, base="gs",
                      subspace=size, krylov_steps=2 * size, mean=data.mean, std=data.std,
                      base_hyperparameters={"tv": args.tv}, first_images=images["gs"], **common)
    out["adaptive"] = per_sample_rmse(rec.images.detach(), x, data)
    return out


def run(args) -> list[dict]:
    rows = []
    for model_name, init in args.models:
        for batch, uploads in ((1, args.samples_b1), (8, args.batches_b8)):
            model, xs, ys, data = model_and_batch(model_name, args.dataset, batch * uploads, init=init,
                                                  offset=args.offset, device=args.device)
            bounds = None if args.no_bounds else tuple(float((v - data.mean[0]) / data.std[0]) for v in (0.0, 1.0))
            for u in range(uploads):
                x, y = xs[u * batch:(u + 1) * batch], ys[u * batch:(u + 1) * batch]
                g = batch_gradient(model, x, y)
                cells = [("none", 0.0)] + [(d, t) for d in args.defenses for t in args.taus]
                for defense, tau in cells:
                    start = time.perf_counter()
                    if defense == "none":  # the control: every attack on the unguarded upload
                        result, sent, report = attacks(model, g, x, y, data, args, args.subspace_size), g, None
                    else:
                        own = dict(subspace_size=args.subspace_size, krylov_steps=args.krylov_steps,
                                   gaussian_floor=args.gaussian_floor) if defense == "eigen" else {}
                        cfg = GuardConfig(defense=defense, min_rmse=tau, seed=1000 * u + batch, eps=args.eps,
                                          input_bounds=bounds, **own)
                        guarded = Guard(cfg).protect(model, x, y, g)
                        sent, report = guarded.gradient, guarded.report
                        result = attacks(model, sent, x, y, data, args, args.subspace_size) if sent is not None else {}
                    for i in range(batch):
                        row = {"model": model_name, "batch": batch, "upload": u, "sample": i, "defense": defense,
                               "tau": tau, "sent": sent is not None,
                               "rel_noise": report.rel_noise if report else 0.0,
                               "predicted": float(report.rmse_after[i]) if report else 0.0}
                        row.update({f"rmse_{k}": float(v[i]) for k, v in result.items()})
                        standard = [float(result[k][i]) for k in STANDARD if k in result]
                        row["best"] = min(standard) if standard else float("nan")
                        row["adaptive"] = float(result["adaptive"][i]) if "adaptive" in result else float("nan")
                        row["best_all"] = min(row["best"], row["adaptive"])
                        rows.append(row)
                    print(f"  {model_name} B={batch} upload {u} {defense:<8} τ={tau:<4} "
                          f"{'sent' if sent is not None else 'DROPPED'} {time.perf_counter() - start:5.1f}s",
                          file=sys.stderr, flush=True)
    return rows


def share(rows: list[dict], key: str) -> float:
    return 100.0 * sum(r[key] >= r["tau"] for r in rows) / max(1, len(rows))


def summarise(rows: list[dict]) -> list[dict]:
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        if r["sent"]:
            groups.setdefault((r["model"], r["batch"], r["defense"], r["tau"]), []).append(r)
    table = []
    for (model, batch, defense, tau), rs in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2] != "none", kv[0][2], kv[0][3])):
        ratio = [r["best"] / tau for r in rs] if tau > 0 else [float("nan")]
        table.append({"model": model, "batch": batch, "defense": defense, "tau": tau, "samples": len(rs),
                      "rel_noise": statistics.median(r["rel_noise"] for r in rs),
                      "median_best": statistics.median(r["best"] for r in rs),
                      "min_best_over_tau": min(ratio), "kept": share(rs, "best") if tau > 0 else float("nan"),
                      "kept_adaptive": share(rs, "adaptive") if tau > 0 else float("nan"),
                      "kept_all": share(rs, "best_all") if tau > 0 else float("nan")})
    return table


def figure(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    guarded = [r for r in rows if r["sent"] and r["defense"] != "none"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for ax, key, title in ((axes[0], "best", "best of DLG / GS / R-GAP / hybrid"), (axes[1], "adaptive", "adaptive attacker")):
        groups = ((("gaussian", 1), "o"), (("gaussian", 8), "s"), (("eigen", 1), "^"), (("eigen", 8), "D"))
        for shift, ((defense, batch), marker) in zip((0.91, 0.97, 1.03, 1.09), groups):  # side by side per τ
            pts = [r for r in guarded if r["defense"] == defense and r["batch"] == batch]
            ax.scatter([r["tau"] * shift for r in pts], [r[key] / r["tau"] for r in pts], marker=marker, alpha=0.6,
                       label=f"{defense} B={batch}")
        ax.axhline(1.0, color="k", lw=1)
        ax.set_xscale("log"), ax.set_yscale("log")
        taus = sorted({r["tau"] for r in guarded})
        ax.set_xticks(taus, [f"{t:g}" for t in taus]), ax.minorticks_off()
        ax.set_yticks([0.5, 1, 2, 4, 8], ["0.5", "1", "2", "4", "8"])
        ax.set_xlabel("τ (model-input units)"), ax.set_title(title)
    axes[0].set_ylabel("measured RMSE / τ  (≥ 1: promise kept)")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def write_csv(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    keys = list(dict.fromkeys(k for r in rows for k in r))
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=keys)
        writer.writeheader()
        writer.writerows(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--full", action="store_true", help="GPU scale: LeNet too, 3 restarts, longer attacks")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dataset", default="mnist5k")
    parser.add_argument("--taus", type=float, nargs="+", default=[0.1, 0.3, 0.6])
    parser.add_argument("--defenses", nargs="+", default=["gaussian", "eigen"])
    parser.add_argument("--samples-b1", type=int, default=9, help="B=1 uploads (each guarded per defense and τ)")
    parser.add_argument("--batches-b8", type=int, default=1, help="B=8 uploads (each guarded per defense and τ)")
    parser.add_argument("--offset", type=int, default=300)
    parser.add_argument("--subspace-size", type=int, default=GuardConfig(defense="eigen").subspace_size)
    parser.add_argument("--krylov-steps", type=int, default=GuardConfig(defense="eigen").krylov_steps)
    parser.add_argument("--no-bounds", action="store_true", help="guard without input_bounds")
    parser.add_argument("--gaussian-floor", type=float, default=GuardConfig(defense="eigen").gaussian_floor)
    parser.add_argument("--eps", type=float, default=GuardConfig().eps, help="the guard's ε relative to λmax")
    parser.add_argument("--adaptive-factor", type=int, default=None,
                        help="attacker subspace / defense subspace at B=1 (default 2; 4 with --full)")
    parser.add_argument("--tag", default="", help="suffix of the output files")
    args = parser.parse_args()
    torch.set_num_threads(1)
    args.models = [("cnn2_v1", "default")] + ([("lenet", "uniform")] if args.full else [])
    args.restarts = 3 if args.full else 1
    args.dlg_steps, args.gs_iterations, args.hybrid_iterations = (50, 2400, 1000) if args.full else (20, 300, 100)
    if args.adaptive_factor is None:
        args.adaptive_factor = 4 if args.full else 2
    args.tv = 1e-4
    if args.full:
        args.samples_b1, args.batches_b8 = max(args.samples_b1, 20), max(args.batches_b8, 3)
    start = time.perf_counter()
    rows = run(args)
    minutes = (time.perf_counter() - start) / 60
    stem = "promise" + (f"-{args.tag}" if args.tag else "")
    write_csv(ROOT / "benchmarks" / "results" / f"{stem}.csv", rows)
    table = summarise(rows)
    write_csv(ROOT / "benchmarks" / "results" / f"{stem}_summary.csv", table)
    figure(rows, ROOT / "docs" / "figures" / f"{stem}.png")
    guarded = [r for r in rows if r["defense"] != "none"]
    sent = [r for r in guarded if r["sent"]]
    print(f"Promise check: {', '.join(m for m, _ in args.models)} on {args.dataset}; guard subspace_size="
          f"{args.subspace_size}, krylov_steps={args.krylov_steps}, gaussian_floor={args.gaussian_floor:g}, eps={args.eps:g}·λmax, "
          f"input_bounds={'off' if args.no_bounds else 'pixel box'}; "
          f"restarts {args.restarts}; DLG {args.dlg_steps}×20, GS {args.gs_iterations}, hybrid {args.hybrid_iterations}, "
          f"adaptive subspace {args.adaptive_factor}× the defense's (B=1); {minutes:.1f} min wall, "
          f"{time.process_time() / 60:.1f} min CPU")
    print()
    print("| model | B | defense | τ | samples | median ‖δ‖/‖g‖ | median best RMSE | min best/τ | kept | kept (adaptive) | kept (all) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for t in table:
        pct = lambda v: "—" if v != v else f"{v:.1f}%"  # noqa: E731
        print(f"| {t['model']} | {t['batch']} | {t['defense']} | {t['tau']:g} | {t['samples']} | {t['rel_noise']:.3g} | "
              f"{t['median_best']:.3g} | {t['min_best_over_tau']:.3g} | {pct(t['kept'])} | {pct(t['kept_adaptive'])} | "
              f"{pct(t['kept_all'])} |")
    print()
    print(f"Guarded samples: {len(guarded)}; sent: {len(sent)}; dropped (nothing left the client): {len(guarded) - len(sent)}")
    print(f"Promise kept: {share(sent, 'best'):.1f}%")
    print(f"Promise kept against the adaptive attacker: {share(sent, 'adaptive'):.1f}%")
    print(f"Promise kept against all attacks together: {share(sent, 'best_all'):.1f}%")


if __name__ == "__main__":
    main()
