"""``study_promise.py``'s tables, figure and files: the per-sample rows summarised per (model, B, defense, τ), the
figure of measured RMSE ÷ τ, the CSVs written and read back (``--from-csv``), and the printed report."""

from __future__ import annotations

import csv
import math
import statistics
import time
from pathlib import Path

#: The standard attacks each guarded upload meets (the adaptive attacker runs beside them).
STANDARD = ("dlg", "gs", "rgap", "hybrid")


def share(rows: list[dict], key: str) -> float:
    return 100.0 * sum(r[key] >= r["tau"] for r in rows) / max(1, len(rows))


def summarise(rows: list[dict]) -> list[dict]:
    """Per (model, B, defense, τ): the kept shares over the attacked samples (sent, not left out);
    samples of withheld uploads and left-out samples are counted in their own columns."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["model"], r["batch"], r["defense"], r["tau"]), []).append(r)
    order = {"none": 0, "clip": 1}
    table = []
    for (model, batch, defense, tau), everything in sorted(
            groups.items(), key=lambda kv: (kv[0][0], kv[0][1], order.get(kv[0][2], 2), kv[0][2], kv[0][3])):
        sent = [r for r in everything if r["sent"]]
        rs = [r for r in sent if not r.get("excluded", False)]
        if not rs:
            continue
        ratio = [r["best"] / tau for r in rs] if tau > 0 else [float("nan")]
        left_out = len(sent) - len(rs)
        kept_all = share(rs, "best_all") if tau > 0 else float("nan")
        table.append({"model": model, "batch": batch, "defense": defense, "tau": tau, "samples": len(everything),
                      "withheld": len(everything) - len(sent), "left_out": left_out, "attacked": len(rs),
                      "rel_noise": statistics.median(r["rel_noise"] for r in sent),
                      "median_best": statistics.median(r["best"] for r in rs),
                      "min_best_over_tau": min(ratio), "kept": share(rs, "best") if tau > 0 else float("nan"),
                      "kept_adaptive": share([r for r in rs if r["adaptive"] == r["adaptive"]], "adaptive")
                      if tau > 0 and any(r["adaptive"] == r["adaptive"] for r in rs) else float("nan"),
                      "kept_all": kept_all,
                      "kept_all_with_left_out": (kept_all * len(rs) + 100.0 * left_out) / len(sent)
                      if tau > 0 else float("nan")})
    return table


def figure(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    guarded = [r for r in rows if r["sent"] and r["defense"] != "none"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    names = {"dlg": "DLG", "gs": "GS", "rgap": "R-GAP", "hybrid": "hybrid"}
    best = "best of " + " / ".join(names[k] for k in STANDARD if any(f"rmse_{k}" in r for r in guarded))
    for ax, key, title in ((axes[0], "best", best), (axes[1], "adaptive", "adaptive attacker")):
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


def read_rows(path: Path) -> list[dict]:
    """A run's per-sample CSV back as rows of numbers and booleans (``--from-csv``)."""
    def value(text: str):
        if text in ("True", "False"):
            return text == "True"
        if text == "":
            return float("nan")
        try:
            return int(text)
        except ValueError:
            try:
                return float(text)
            except ValueError:
                return text
    with open(path, newline="") as handle:
        return [{k: value(v) for k, v in row.items()} for row in csv.DictReader(handle)]


def per_sample(rows: list[dict], pct_tau) -> None:
    """One line per sample (issue 12): each cell's best RMSE / τ over all attacks, and which attack."""
    order = {"none": 0, "clip": 1}
    defenses = sorted(dict.fromkeys(r["defense"] for r in rows), key=lambda d: order.get(d, 2))
    cells = {(r["batch"], r["upload"], r["sample"], r["defense"]): r for r in rows}
    print("| B | upload | sample | index | label | " + " | ".join(f"{d}: best/τ (attack)" for d in defenses) + " |")
    print("| --- " * (5 + len(defenses)) + "|")
    for key in dict.fromkeys((r["batch"], r["upload"], r["sample"]) for r in rows):
        first = cells[(*key, defenses[0])]
        out = []
        for d in defenses:
            r = cells.get((*key, d))
            if r is None:
                out.append("")
            elif not r["sent"]:
                out.append("withheld")
            elif r.get("excluded"):
                out.append(f"left out (nearest {pct_tau(r['nearest_any'], r['tau'])})")
            else:
                scores = {k[5:]: r[k] for k in r if k.startswith("rmse_") and r[k] == r[k]}
                attack = min(scores, key=scores.get)
                out.append(f"{pct_tau(scores[attack], r['tau'])} ({attack})")
        print(f"| {key[0]} | {key[1]} | {key[2]} | {first['index']} | {first['label']} | " + " | ".join(out) + " |")


def report(args, rows: list[dict], table: list[dict], minutes: float) -> None:
    guarded = [r for r in rows if r["defense"] not in ("none", "clip")]
    sent = [r for r in guarded if r["sent"]]
    attacked = [r for r in sent if not r.get("excluded", False)]
    if args.trained:
        guards = "; ".join(f"{d}: " + ", ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}"
                                                for k, v in values.items()) for d, values in args.guard_values.items())
        print(f"Promise check on the trained model: {args.model} warm-started as {args.config} does "
              f"({args.settings.public_examples} public examples, {args.settings.pretrain_epochs} epochs), samples "
              f"outside the public split; τ = {args.taus[0]:.4g} input units, pixel box {args.box[0]:.4g}..{args.box[1]:.4g}; "
              f"{guards}; restarts {args.restarts}; DLG {args.dlg_steps}×20, GS strongest (TV sweep) "
              f"{args.gs_iterations} its at B=1 / {args.gs_iterations_batch} at B=8, adaptive on strongest GS, "
              f"subspace {args.adaptive_factor}× the defense's (B=1); {minutes:.1f} min wall, "
              f"{time.process_time() / 60:.1f} min CPU")
    else:
        print(f"Promise check: {', '.join(m for m, _ in args.models)} on {args.dataset}; guard subspace_size="
              f"{args.subspace_size}, krylov_steps={args.krylov_steps}, gaussian_floor={args.gaussian_floor:g}, eps={args.eps:g}·λmax, "
              f"input_bounds={'off' if args.no_bounds else 'pixel box'}; "
              f"restarts {args.restarts}; DLG {args.dlg_steps}×20, GS {args.gs_iterations}, hybrid {args.hybrid_iterations}, "
              f"adaptive subspace {args.adaptive_factor}× the defense's (B=1); {minutes:.1f} min wall, "
              f"{time.process_time() / 60:.1f} min CPU")
    print()
    pct = lambda v: "—" if v != v else f"{v:.1f}%"  # noqa: E731
    if args.trained:
        std = float(args.data_std)
        psnr = lambda rmse: -20 * math.log10(max(rmse * std, 1e-12))  # noqa: E731  (clipped to the box: pixel RMSE)
        print("| B | defense | τ | samples | withheld | left out | attacked | median ‖δ‖/‖g‖ | median best RMSE (dB) | "
              "min best/τ | kept (DLG/GS) | kept (adaptive) | kept (all) | kept, left-out counted |")
        print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
        for t in table:
            print(f"| {t['batch']} | {t['defense']} | {t['tau']:.3g} | {t['samples']} | {t['withheld']} | {t['left_out']} | "
                  f"{t['attacked']} | {t['rel_noise']:.3g} | {t['median_best']:.3g} ({psnr(t['median_best']):.1f}) | "
                  f"{t['min_best_over_tau']:.3g} | {pct(t['kept'])} | {pct(t['kept_adaptive'])} | {pct(t['kept_all'])} | "
                  f"{pct(t['kept_all_with_left_out'])} |")
        print()
        close = [r for r in attacked if r["best_all"] < r["tau"]]
        print(f"Samples where some attack came within τ of the truth (guarded, attacked): {len(close) or 'none'}")
        for r in close:
            attack = min((k for k in r if k.startswith("rmse_")), key=lambda k: r[k] if r[k] == r[k] else 1e9)
            print(f"  B={r['batch']} upload {r['upload']} sample {r['sample']} (index {r['index']}, label {r['label']}) "
                  f"{r['defense']}: {attack[5:]} RMSE {r[attack]:.3g} = {r[attack] / r['tau']:.2f} τ "
                  f"({psnr(r[attack]):.1f} dB); predicted {r['predicted']:.3g}")
        for r in sent:
            if r.get("excluded"):
                print(f"  left out: B={r['batch']} upload {r['upload']} sample {r['sample']} (index {r['index']}, "
                      f"label {r['label']}) {r['defense']}: nearest reconstruction of any attack {r['nearest_any']:.3g} "
                      f"= {r['nearest_any'] / r['tau']:.2f} τ")
        print()
        per_sample(rows, lambda rmse, tau: f"{rmse / tau:.2f}")
        print()
    else:
        print("| model | B | defense | τ | samples | median ‖δ‖/‖g‖ | median best RMSE | min best/τ | kept | kept (adaptive) | kept (all) |")
        print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
        for t in table:
            print(f"| {t['model']} | {t['batch']} | {t['defense']} | {t['tau']:g} | {t['attacked']} | {t['rel_noise']:.3g} | "
                  f"{t['median_best']:.3g} | {t['min_best_over_tau']:.3g} | {pct(t['kept'])} | {pct(t['kept_adaptive'])} | "
                  f"{pct(t['kept_all'])} |")
        print()
    print(f"Guarded samples: {len(guarded)}; sent: {len(sent)}; dropped (nothing left the client): {len(guarded) - len(sent)}"
          + (f"; left out of a sent step (gradient not in the upload): {len(sent) - len(attacked)}" if args.trained else ""))
    print(f"Promise kept: {share(attacked, 'best'):.1f}%")
    print(f"Promise kept against the adaptive attacker: {share(attacked, 'adaptive'):.1f}%")
    print(f"Promise kept against all attacks together: {share(attacked, 'best_all'):.1f}%"
          + (f" of {len(attacked)} attacked samples" if args.trained else ""))
