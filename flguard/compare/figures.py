"""The comparison's figures: one PNG each in ``DIR/figures/``, drawn from the tables the runner wrote.

Each ``plot_*`` function takes the comparison directory (or an already loaded :class:`Comparison`),
writes one figure and returns its path — or ``None`` when the inputs it needs are absent (nobody was
attacked, no ``classes.csv``), so a report can always be built from whatever a run left behind.
Figures are drawn on bare :class:`matplotlib.figure.Figure` objects (Agg canvas, no pyplot state),
and a defense keeps one colour and marker in every figure: those of its position in ``summary.csv``.
"""

from __future__ import annotations

import csv
import math
import statistics
from collections import defaultdict
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from matplotlib import colormaps
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, MaxNLocator, NullFormatter

FIGURES_DIR = "figures"
MAX_RECONSTRUCTION_ROWS = 12
MARKERS = "os^DvP*Xhp"
#: Accuracy as a percentage with up to three significant digits ("9.6%", "95.2%").
PERCENT = FuncFormatter(lambda value, _: f"{value * 100:.3g}%")
GREY = "#777777"
PSNR_EXACT = 60.0  # dB: where an exact reconstruction (PSNR = +inf, the worst privacy) is drawn


def number(value: Any) -> float | None:
    """A finite float, or ``None`` for empty cells, text and NaN/inf."""
    try:
        result = float(value)
    except (TypeError, ValueError):
        return None
    return result if math.isfinite(result) else None


def psnr(value: Any) -> float | None:
    """An attack PSNR to draw: +inf (exact reconstruction) at ``PSNR_EXACT`` rather than dropped."""
    return PSNR_EXACT if str(value).strip().lower() in ("inf", "+inf") else number(value)


def read_table(path: Path) -> list[dict[str, str]]:
    """A CSV's rows as dicts of strings; ``[]`` when the file is absent."""
    if not path.exists():
        return []
    with path.open(encoding="utf-8", newline="") as handle:
        return list(csv.DictReader(handle))


class Comparison:
    """The tables of one comparison directory, read once and shared by every figure."""

    def __init__(self, directory: Path):
        self.directory = Path(directory)
        self.rounds = read_table(self.directory / "rounds.csv")
        self.summary = read_table(self.directory / "summary.csv")
        self.classes = read_table(self.directory / "classes.csv")
        self.defenses = list(dict.fromkeys([r["defense"] for r in self.summary + self.rounds]))

    def style(self, defense: str) -> dict[str, str]:
        """The defense's colour and marker, the same in every figure."""
        i = self.defenses.index(defense)
        return {"color": colormaps["tab10"].colors[i % 10], "marker": MARKERS[i % len(MARKERS)]}

    def attacked(self, defense: str | None = None) -> list[dict[str, str]]:
        """Rows where the malicious server attacked and scored the client."""
        return [r for r in self.rounds if (defense is None or r["defense"] == defense) and r.get("attack_method")
                and psnr(r.get("attack_psnr")) is not None]

    def taus(self) -> list[float]:
        return sorted({t for t in (number(r.get("tau")) for r in self.summary) if t is not None and t > 0})

    def save(self, fig: Figure, name: str) -> Path:
        path = self.directory / FIGURES_DIR / f"{name}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=110, bbox_inches="tight", facecolor="white")
        return path


#: attack_target → how its markers are filled in the attack figure (the legend's words).
ATTACK_KINDS = {"probe": "probe (filled)", "fedavg-upload": "real upload (hollow)",
                "fishing": "fished upload (half-filled)"}


def attack_kind(row: dict[str, str]) -> str:
    """A rounds.csv row's kind of attack: ``probe`` (also for rows of runs older than the column),
    ``fedavg-upload`` or ``fishing``."""
    return row.get("attack_target") or "probe"


def _kind_markers(ax, points: list[tuple[float, float]], kind: str, style: dict[str, str], label: str | None) -> None:
    """One defense's markers of one kind of attack: probes filled, real uploads hollow, fished uploads
    half-filled (the defense's colour and marker throughout)."""
    xs, ys = [x for x, _ in points], [y for _, y in points]
    fill = {"probe": "full", "fedavg-upload": "none"}.get(kind, "left")
    ax.plot(xs, ys, ls="none", marker=style["marker"], ms=6.5, color=style["color"], fillstyle=fill,
            markerfacecoloralt="white", markeredgecolor="white" if fill == "full" else style["color"],
            mew=0.6 if fill == "full" else 1.2, label=label, zorder=3)


def _data(source: Path | Comparison) -> Comparison:
    return source if isinstance(source, Comparison) else Comparison(Path(source))


def _legend(ax, title: str | None = "defense") -> None:
    """The legend outside on the right, where it never hides data."""
    ax.legend(title=title, fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))


def _rounds_axis(ax) -> None:
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("round")
    ax.grid(alpha=0.3)
    _legend(ax)


def plot_accuracy(source: Path | Comparison) -> Path | None:
    """Test accuracy after each round: mean over clients weighted by their examples, clients faint."""
    data = _data(source)
    fig = Figure(figsize=(7.0, 4.0))
    ax = fig.add_subplot()
    for i, defense in enumerate(data.defenses):
        per_round: dict[int, list[tuple[float, float]]] = defaultdict(list)
        for row in (r for r in data.rounds if r["defense"] == defense):
            if (acc := number(row.get("test_accuracy"))) is not None:
                per_round[int(row["round"])].append((acc, max(number(row.get("num_examples")) or 0.0, 0.0)))
        if not per_round:
            continue
        xs, style = sorted(per_round), data.style(defense)
        means = [sum(a * w for a, w in per_round[x]) / sum(w for _, w in per_round[x])
                 if sum(w for _, w in per_round[x]) > 0 else statistics.fmean(a for a, _ in per_round[x]) for x in xs]
        ax.fill_between(xs, [min(a for a, _ in per_round[x]) for x in xs],
                        [max(a for a, _ in per_round[x]) for x in xs], color=style["color"], alpha=0.12, lw=0)
        ax.scatter(*zip(*[(x, a) for x in xs for a, _ in per_round[x]]), s=12, color=style["color"], alpha=0.35, lw=0)
        ax.plot(xs, means, ls=("-", "--", "-.", ":")[i % 4], label=defense, **style)
    if not ax.lines:
        return None
    ax.yaxis.set_major_formatter(PERCENT)
    ax.set_ylabel("test accuracy (%)")
    ax.set_title("Test accuracy per round\nline: mean weighted by client examples · band/dots: clients")
    _rounds_axis(ax)
    return data.save(fig, "accuracy")


def plot_attack_psnr(source: Path | Comparison) -> Path | None:
    """Attack PSNR per round and defense (one marker per attacked client): higher = worse privacy."""
    data = _data(source)
    if not data.attacked():
        return None
    fig = Figure(figsize=(7.0, 4.0))
    ax = fig.add_subplot()
    for i, defense in enumerate(data.defenses):
        per_round: dict[int, list[float]] = defaultdict(list)
        for row in data.attacked(defense):
            per_round[int(row["round"])].append(psnr(row["attack_psnr"]))
        if not per_round:
            ax.plot([], [], " ", label=f"{defense} (not attacked)")
            continue
        shift, style = (i - (len(data.defenses) - 1) / 2) * 0.06, data.style(defense)  # side by side in a round
        points: dict[str, list[tuple[float, float]]] = defaultdict(list)
        for row in data.attacked(defense):
            points[attack_kind(row)].append((int(row["round"]) + shift, psnr(row["attack_psnr"])))
        label: str | None = defense
        for kind in (k for k in ATTACK_KINDS if points.get(k)):
            _kind_markers(ax, points[kind], kind, style, label)
            label = None  # the defense once in the legend, on its first kind
        ax.plot([x + shift for x in sorted(per_round)], [statistics.median(v) for _, v in sorted(per_round.items())],
                color=style["color"], alpha=0.5, lw=1)  # the round's median, to follow a defense across rounds
    kinds = [k for k in ATTACK_KINDS if any(attack_kind(r) == k for r in data.attacked())]
    if kinds != ["probe"]:  # a key to the marker fills, in grey, after the defenses
        for kind in kinds:
            _kind_markers(ax, [], kind, {"color": GREY, "marker": "o"}, ATTACK_KINDS[kind])
    ax.set_ylabel("attack PSNR (dB)  ↑ worse privacy")
    if any(str(r.get("attack_psnr")).strip().lower() in ("inf", "+inf") for r in data.attacked()):
        ax.axhline(PSNR_EXACT, color=GREY, ls=":", lw=1, label=f"exact (∞ dB, drawn at {PSNR_EXACT:g})")
    ax.set_title("Reconstruction quality of the malicious server's attacks\nhigher PSNR = better reconstruction")
    _rounds_axis(ax)
    return data.save(fig, "attack_psnr")


def plot_calibration(source: Path | Comparison) -> Path | None:
    """The guard's predicted per-sample RMSE floor against the attack's measured RMSE (log-log).

    A prediction of 0 (no defense) cannot sit on a log axis: those points are drawn on the left spine;
    a defense without a prediction (Flower's LocalDpMod) as ``>`` markers just inside it."""
    data = _data(source)
    scored, unscored = defaultdict(list), defaultdict(list)
    for row in data.attacked():
        measured, predicted = number(row.get("attack_rmse")), number(row.get("min_pred_rmse"))
        if measured is not None and measured > 0:
            if predicted is None:
                unscored[row["defense"]].append(measured)
            else:
                scored[row["defense"]].append((predicted, measured))
    if not scored and not unscored:
        return None
    fig = Figure(figsize=(6.6, 5.2))
    ax = fig.add_subplot()
    values = [v for pts in scored.values() for p in pts for v in p] + [v for m in unscored.values() for v in m]
    lo, hi = min(v for v in values + data.taus() if v > 0) / 2, max(values + data.taus()) * 2
    ax.set_xscale("log"), ax.set_yscale("log"), ax.set_xlim(lo, hi), ax.set_ylim(lo, hi)
    for axis in (ax.xaxis, ax.yaxis):  # plain numbers; 2s and 5s between decades when they are few
        axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        axis.set_minor_formatter(FuncFormatter(lambda v, _: f"{v:g}" if f"{v:.0e}"[0] in "25" else "")
                                 if math.log10(hi / lo) < 2.5 else NullFormatter())
    diagonal = [lo * (hi / lo) ** (k / 50) for k in range(51)]
    ax.fill_between(diagonal, diagonal, hi, color="#2ca02c", alpha=0.07, lw=0, label="promise kept (measured ≥ "
                                                                                     "predicted)")
    ax.plot(diagonal, diagonal, color="black", lw=1, label="y = x")
    for k, tau in enumerate(data.taus()):
        ax.axhline(tau, color="#555555", ls=":", lw=1.2, label="τ (floor)" if k == 0 else None)
        ax.axvline(tau, color="#555555", ls=":", lw=1.2)
    edge = ax.get_yaxis_transform()  # x in axes fraction, y in data: for points without a positive prediction
    for defense in data.defenses:
        style = {"s": 45, "edgecolor": "white", "lw": 0.6, "zorder": 3, **data.style(defense)}
        if points := [(p, m) for p, m in scored.get(defense, []) if p > 0]:
            ax.scatter(*zip(*points), label=defense, **style)
        if zeros := [m for p, m in scored.get(defense, []) if p <= 0]:
            ax.scatter([0.0] * len(zeros), zeros, transform=edge, clip_on=False,
                       label=f"{defense} (predicted 0: on the axis)", **style)
        if unscored.get(defense):
            ax.scatter([0.04] * len(unscored[defense]), unscored[defense], transform=edge, clip_on=False,
                       label=f"{defense} (not predicted: measured only)", **{**style, "marker": ">"})
    ax.set_xlabel("predicted (guard floor): min per-sample RMSE (model-input units)")
    ax.set_ylabel("measured (attack): per-sample RMSE (model-input units)")
    ax.set_title("Does the guard keep its promise?\nabove the diagonal: the attack did no better than predicted")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=2)  # below: the plot stays square
    return data.save(fig, "calibration")


def plot_class_risk(source: Path | Comparison) -> Path | None:
    """Per class of ``classes.csv``: the Gaussian σ that puts its median sample at τ, and the mean attack
    PSNR of the attacked batches that contained it, per defense (left out when nobody was attacked).
    ``None`` without ``classes.csv``."""
    data = _data(source)
    names = {r["class"]: r.get("label") or r["class"] for r in data.classes if r.get("class")}
    sigma = [(names[r["class"]], s) for r in data.classes
             if r.get("class") and (s := number(r.get("sigma_for_tau"))) is not None]
    by_class: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for row in data.attacked() if names else []:
        for label in set((row.get("attack_labels") or "").split()):
            by_class[names.get(label, label)][row["defense"]].append(psnr(row["attack_psnr"]))
    if not sigma and not by_class:
        return None
    fig = Figure(figsize=(7.6, 3.6 * (bool(sigma) + bool(by_class))))
    axes = iter(fig.subplots(bool(sigma) + bool(by_class), 1, squeeze=False)[:, 0])
    if sigma:
        ax = next(axes)
        ax.bar([n for n, _ in sigma], [s for _, s in sigma], color="#7f7f7f")
        ax.set_ylabel("σ needed for τ (gradient units)")
        ax.set_title("Gaussian noise needed to hold each class's median sample at τ  (↑ = leakier class)")
    if by_class:
        ax = next(axes)
        order = [n for n in names.values() if n in by_class] + sorted(set(by_class) - set(names.values()))
        shown = [d for d in data.defenses if any(by_class[c].get(d) for c in order)]
        for i, defense in enumerate(shown):
            heights = [statistics.fmean(by_class[c][defense]) if by_class[c].get(defense) else math.nan
                       for c in order]
            ax.bar([k + (i - (len(shown) - 1) / 2) * 0.8 / len(shown) for k in range(len(order))], heights,
                   width=0.8 / len(shown), color=data.style(defense)["color"], label=defense)
        ax.set_xticks(range(len(order)), order)
        ax.set_ylabel("mean attack PSNR (dB)")
        ax.set_title("Attack PSNR by class of the attacked samples  (↑ = worse privacy)")
        _legend(ax)
    for ax in fig.axes:
        ax.grid(alpha=0.3, axis="y")
        ax.set_xlabel("class")
    fig.tight_layout()
    return data.save(fig, "class_risk")


def _load_tensors(path: Path) -> dict[str, Any] | None:
    """An attack's ``{"reconstruction", "original"?}`` tensors; ``None`` if missing or unreadable ("no image")."""
    import torch

    try:
        loaded = torch.load(path, map_location="cpu", weights_only=True)
    except Exception:  # noqa: BLE001
        return None
    return loaded if isinstance(loaded, dict) and "reconstruction" in loaded else None


def _tile(batch) -> Any:
    """A batch [N,C,H,W] in [0,1] as one HxWx3 image (a near-square grid of up to 16 samples)."""
    from torchvision.utils import make_grid

    batch = batch.detach().float().clamp(0, 1)[:16]
    return make_grid(batch, nrow=math.ceil(math.sqrt(len(batch))), padding=1, pad_value=1.0).permute(1, 2, 0).numpy()


def plot_reconstructions(source: Path | Comparison) -> Path | None:
    """One row per attacked round: the original batch, then each defense's reconstruction of it.

    When the originals differ across defenses within a round (different victims), every defense gets
    its own original next to its reconstruction instead; without originals (deployments), only the
    reconstructions are shown. At most ``MAX_RECONSTRUCTION_ROWS`` rounds, evenly spread."""
    import torch

    data = _data(source)
    victims: dict[int, dict[str, tuple[dict[str, str], dict[str, Any] | None]]] = defaultdict(dict)
    # round → defense → (its first attacked row with an image, the tensors); a fished upload only where
    # nothing else was attacked (its reconstruction is of one class's samples, not of a whole batch)
    for row in sorted(data.attacked(), key=lambda r: attack_kind(r) == "fishing"):
        if row.get("attack_image") and row["defense"] not in victims[int(row["round"])]:
            victims[int(row["round"])][row["defense"]] = (row, _load_tensors(data.directory / row["attack_image"]))
    if not (rounds := sorted(victims)):
        return None
    if len(rounds) > MAX_RECONSTRUCTION_ROWS:
        rounds = sorted({rounds[round(k * (len(rounds) - 1) / (MAX_RECONSTRUCTION_ROWS - 1))]
                         for k in range(MAX_RECONSTRUCTION_ROWS)})
    originals = {r: [t["original"] for _, t in victims[r].values() if t is not None and t.get("original") is not None]
                 for r in rounds}
    paired = any(any(o.shape != ts[0].shape or not torch.equal(o, ts[0]) for o in ts) for ts in originals.values())
    shared = not paired and any(originals.values())
    columns: list[tuple[str, str | None]] = [("original", None)] if shared else []
    for defense in data.defenses:
        columns += ([("original", defense)] if paired else []) + [("reconstruction", defense)]
    first = next((_tile(t["reconstruction"]) for vs in victims.values() for _, t in vs.values() if t is not None), None)
    aspect = first.shape[0] / first.shape[1] if first is not None else 1.0  # rows as tall as the tiles
    fig = Figure(figsize=(1.55 * len(columns) + 0.4, (1.55 * aspect + 0.45) * len(rounds) + 0.5))
    axes = fig.subplots(len(rounds), len(columns), squeeze=False)
    for i, r in enumerate(rounds):
        cells = [(victims[r].get(defense, (None, None)) if defense else (None, None), what, defense)
                 for what, defense in columns]
        images = [(originals[r] or [None])[0] if d is None else (t or {}).get(w) for (_, t), w, d in cells]
        blank = next((torch.ones_like(x) for x in images if x is not None), None)  # keeps empty cells aligned
        for j, (((row, _), what, defense), image) in enumerate(zip(cells, images)):
            ax = axes[i, j]
            ax.set_xticks([]), ax.set_yticks([])
            if image is not None or blank is not None:
                ax.imshow(_tile(image if image is not None else blank), interpolation="nearest")
            if image is None:
                ax.text(0.5, 0.5, "not attacked" if row is None and defense else "no image", ha="center",
                        va="center", fontsize=8, color=GREY, transform=ax.transAxes)
                ax.spines[:].set_visible(False)
            if what == "reconstruction" and row is not None:
                value = number(row["attack_psnr"])
                kind = {"fedavg-upload": "\nreal upload", "fishing": "\nfished upload"}.get(attack_kind(row), "")
                ax.set_xlabel(f"{'∞' if value is None else f'{value:.1f}'} dB · client {row['client']}{kind}",
                              fontsize=8)
            if i == 0:
                ax.set_title(f"{defense}\n{what}" if paired else defense or "original", fontsize=9,
                             color=data.style(defense)["color"] if defense else "black")
            if j == 0:
                ax.set_ylabel(f"round {r}", fontsize=9)
    fig.suptitle("Private batch vs the malicious server's reconstruction (PSNR below each)", fontsize=11)
    return data.save(fig, "reconstructions")


def plot_privacy_utility(source: Path | Comparison) -> Path | None:
    """Final accuracy against the best attack's PSNR, one labelled point per defense."""
    data = _data(source)
    points = [(r["defense"], x, y) for r in data.summary if (x := psnr(r.get("attack_psnr_best"))) is not None
              and (y := number(r.get("final_accuracy"))) is not None]
    if not points:
        return None
    fig = Figure(figsize=(6.4, 4.6))
    ax = fig.add_subplot()
    offsets = ((7, 6, "left"), (7, -13, "left"), (-7, 6, "right"), (-7, -13, "right"))  # neighbours alternate
    for k, (defense, x, y) in enumerate(sorted(points, key=lambda p: (p[2], p[1]))):
        style = data.style(defense)
        ax.scatter([x], [y], s=70, edgecolor="white", zorder=3, **style)
        ax.annotate(defense, (x, y), xytext=offsets[k % 4][:2], textcoords="offset points", ha=offsets[k % 4][2],
                    fontsize=9, color=style["color"])
    ax.margins(0.25)
    ax.yaxis.set_major_formatter(PERCENT)
    ax.set_xlabel("best attack PSNR (dB)  → worse privacy")
    ax.set_ylabel("final test accuracy (%)")
    ax.set_title("Privacy–utility trade-off (better: up and to the left)")
    ax.text(0.02, 0.97, "↖ better", transform=ax.transAxes, va="top", fontsize=9, color="#2ca02c")
    if missing := [r["defense"] for r in data.summary if r["defense"] not in {p[0] for p in points}]:
        ax.text(0.98, 0.02, "not shown (no attack or accuracy): " + ", ".join(missing), transform=ax.transAxes,
                ha="right", fontsize=8, color=GREY)
    ax.grid(alpha=0.3)
    return data.save(fig, "privacy_utility")


#: The figures in report order: name → function.
FIGURES: dict[str, Callable[[Path | Comparison], Path | None]] = {
    "accuracy": plot_accuracy, "attack_psnr": plot_attack_psnr, "privacy_utility": plot_privacy_utility,
    "calibration": plot_calibration, "reconstructions": plot_reconstructions, "class_risk": plot_class_risk,
}


def build_figures(out_dir: Path, names: Iterable[str] | None = None) -> dict[str, Path | None]:
    """Draw every figure (or those named) of a comparison directory: name → PNG path or ``None``."""
    data, paths = Comparison(Path(out_dir)), {}
    for name in names or FIGURES:
        paths[name] = FIGURES[name](data)
        if paths[name] is None:  # one drawn by an earlier run whose inputs are gone would contradict the tables
            (data.directory / FIGURES_DIR / f"{name}.png").unlink(missing_ok=True)
    return paths
