"""The comparison's report: ``DIR/report.html``, one self-contained page to look at first.

The page carries everything inline — the figures as base64 ``data:`` URIs, the CSS in a ``<style>``
element, no script, font, or network reference — so it opens offline, from a mail attachment or a
CI artifact, and renders the same anywhere. Sections: the headline (key facts and the summary
table with the best value per column highlighted), the figures with one-sentence captions, how to
read them, and the config exactly as it was run.
"""

from __future__ import annotations

import base64
import html
import tomllib
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from flguard.compare.figures import build_figures, number, read_table

REPORT_FILE = "report.html"

_PCT: Callable[[float], str] = lambda v: f"{v * 100:.1f}%"  # noqa: E731
_DB: Callable[[float], str] = lambda v: f"{v:.2f}"  # noqa: E731
_G3: Callable[[float], str] = lambda v: f"{v:.3g}"  # noqa: E731
_INT: Callable[[float], str] = lambda v: f"{v:.0f}"  # noqa: E731
_SEC: Callable[[float], str] = lambda v: f"{v:.1f}"  # noqa: E731

Column = tuple[str, str, Callable[[float], str] | None, str | None]
#: The summary as two tables of (column, header, format, better): ``better`` is "max"/"min" where one end
#: is unambiguously good for privacy or utility, ``None`` where a value is a cost or a setting, not a score.
PRIVACY_UTILITY: tuple[Column, ...] = (
    ("defense", "defense", None, None),
    ("kind", "kind", None, None),
    ("final_accuracy", "final accuracy", _PCT, "max"),
    ("final_loss", "final loss", _G3, "min"),
    ("attacks", "attacks", _INT, None),
    ("attack_psnr_min", "attack PSNR min (dB)", _DB, "min"),
    ("attack_psnr_median", "attack PSNR median (dB)", _DB, "min"),
    ("attack_psnr_best", "best attack PSNR (dB)", _DB, "min"),
    ("attack_ssim_best", "best attack SSIM", _G3, "min"),
    ("attack_rmse_min", "min attack RMSE (input units)", _G3, "max"),
    ("tau", "τ (input units)", _G3, None),
    ("tau_met_share", "τ met", _PCT, "max"),
    ("probe_tau_met_share", "τ met, probes", _PCT, "max"),
    ("upload_attacks", "real-upload attacks", _INT, None),
    ("upload_attack_psnr_best", "best real-upload PSNR (dB)", _DB, "min"),
    ("upload_tau_met_share", "τ met, real uploads", _PCT, "max"),
    ("fishing_attacks", "fishing attacks", _INT, None),
    ("fishing_attack_psnr_best", "best fished PSNR (dB)", _DB, "min"),
    ("fishing_tau_met_share", "τ met, fished", _PCT, "max"),
    ("fished_withheld", "fished replies withheld", _INT, None),
)
COSTS: tuple[Column, ...] = (
    ("defense", "defense", None, None),
    ("rounds", "rounds", _INT, None),
    ("mean_rel_noise", "noise / gradient", _G3, None),
    ("mean_noise_norm", "noise norm", _G3, None),
    ("guard_overhead", "guard overhead (× train time)", _G3, None),
    ("guard_seconds", "guard (s)", _SEC, None),
    ("train_seconds", "train (s)", _SEC, None),
    ("dropped_updates", "dropped updates", _INT, "min"),
    ("excluded_share", "samples left out", _PCT, "min"),
    ("run_seconds", "run (s)", _SEC, None),
)

#: name → (heading, one-sentence caption saying how to read the figure).
CAPTIONS: Mapping[str, tuple[str, str]] = {
    "accuracy": ("Utility: test accuracy per round",
                 "Each line is a defense's accuracy averaged over clients (weighted by their examples), the faint "
                 "band and dots are the individual clients: the closer a defense stays to “none”, the less it "
                 "costs."),
    "attack_psnr": ("Privacy: attack quality per round",
                    "Each marker is one attacked client's reconstruction: higher PSNR means a closer copy of the "
                    "private data, so lower markers mean better privacy. Filled markers are probes (the one-sample "
                    "upload the server asked for), hollow ones honest clients' real multi-step uploads, half-filled "
                    "ones fished uploads (one step on a model the server rigged to isolate one class; never "
                    "aggregated)."),
    "privacy_utility": ("Trade-off",
                        "One point per defense, its final accuracy against the best attack it suffered: the best "
                        "defenses sit up and to the left."),
    "calibration": ("Calibration: predicted floor vs measured error",
                    "Each point is one attack, the guard's predicted minimum per-sample RMSE against the RMSE the "
                    "attack actually achieved: points on or above the diagonal kept the guard's promise, and points "
                    "above the dotted τ line were not reconstructed closer than the floor."),
    "reconstructions": ("What the attacker saw",
                        "Each row is a round: the victim's private batch, then what the malicious server reconstructed "
                        "under each defense, with the PSNR underneath — noise-like images mean the attack failed."),
    "class_risk": ("Risk by class",
                   "Bars show the Gaussian σ each class needs for its median sample to reach τ (taller = leakier: a "
                   "single σ protects classes unequally) and, where attacked, the mean attack PSNR per class."),
}

HOW_TO_READ = """
<ul>
<li><b>τ (tau)</b> is the privacy floor the guard is asked to hold: no reconstruction of a training sample should
come closer than a per-sample RMSE of τ, in the model's input units (the normalised pixels the model sees).</li>
<li><b>PSNR</b> (dB) measures how close an attack's reconstruction is to the private data: <b>higher = better
reconstruction = worse privacy</b>. Around 10 dB looks like noise; reconstructions usually become recognisable
from about 15–20 dB; ∞ is an exact copy.</li>
<li><b>Predicted vs measured</b>: the guard <em>predicts</em> a floor on the reconstruction error before an update
leaves the client; the malicious server's attack <em>measures</em> the error it really achieves. Measured ≥ predicted
means the promise was kept. Flower's LocalDpMod makes no prediction, so it has measured values only.</li>
<li><b>Three kinds of attack.</b> A <em>probe</em> is the upload the malicious server asks its victim for (one
sample, one local step: the easiest to invert); a <em>real upload</em> (<code>fedavg-upload</code>) is an honest
client's ordinary multi-step FedAvg update, attacked by unrolling its known local SGD steps with a bounded number of
iterations; a <em>fished upload</em> (<code>fishing</code>, when the config sets <code>fishing = "class"</code>) is one
local step on a model the server altered before sending it: its last layer is rewritten so that only one class's
samples reach the layers before it (Wen et al. 2022), and the server inverts those samples. A fished reply is
sabotage, never aggregated: it costs the training nothing but is not the client's real update either. A fished
batch without a sample of the class, or one whose count of them the server misread (it reads the count off the
classifier's bias gradient, which a defense's noise blurs), yields an attack without a score: counted among the
fishing attacks, with no PSNR.
<b>τ met</b> is the share of attacked <em>samples</em> whose measured RMSE is at least τ: over all attacks, and over
probes, real uploads and fished uploads separately. <b>Fished replies withheld</b> counts fished models on which the
client's guard sent nothing (e.g. it found no floor it could certify).</li>
<li>In the table the <mark>highlighted</mark> cell is the best value of its column (higher accuracy, lower attack
PSNR/SSIM, higher attack RMSE, more τ met); costs and settings are not ranked.</li>
</ul>
"""

CSS = """
:root { color-scheme: light; --ink: #1d2430; --muted: #5b6472; --line: #dde2ea; --accent: #2458c6; }
* { box-sizing: border-box; }
body { margin: 0; font: 15px/1.55 system-ui, -apple-system, "Segoe UI", Roboto, "DejaVu Sans", sans-serif;
       color: var(--ink); background: #f5f7fa; }
main { max-width: 1180px; margin: 0 auto; padding: 24px 20px 60px; }
header h1 { margin: 0 0 4px; font-size: 1.7rem; }
header p { margin: 0; color: var(--muted); }
h2 { margin: 36px 0 12px; font-size: 1.25rem; border-bottom: 2px solid var(--line); padding-bottom: 4px; }
.cards { display: grid; grid-template-columns: repeat(auto-fit, minmax(min(220px, 100%), 1fr)); gap: 12px;
         margin: 18px 0; }
.card { background: #fff; border: 1px solid var(--line); border-radius: 10px; padding: 12px 16px; }
.card .k { color: var(--muted); font-size: .85rem; } .card .v { font-size: 1.35rem; font-weight: 650; }
.card .s { color: var(--muted); font-size: .85rem; }
.table-wrap { overflow-x: auto; background: #fff; border: 1px solid var(--line); border-radius: 10px; }
table { border-collapse: collapse; width: 100%; font-size: .85rem; font-variant-numeric: tabular-nums; }
th, td { padding: 6px 10px; text-align: right; white-space: nowrap; border-bottom: 1px solid var(--line); }
th { background: #eef1f6; font-weight: 600; white-space: normal; vertical-align: bottom; }
h3 { font-size: 1rem; margin: 18px 0 8px; }
th:first-child, td:first-child, th:nth-child(2), td:nth-child(2) { text-align: left; }
td.best { background: #dff3e3; font-weight: 700; color: #14532d; }
td.na { color: #a0a7b2; }
.figures { display: grid; grid-template-columns: repeat(auto-fit, minmax(min(460px, 100%), 1fr)); gap: 16px; }
figure { margin: 0; background: #fff; border: 1px solid var(--line); border-radius: 10px; padding: 12px; }
figure.wide { grid-column: 1 / -1; }
figure h3 { margin: 0 0 8px; font-size: 1rem; }
figure img { display: block; max-width: 100%; height: auto; margin: 0 auto; }
figcaption { color: var(--muted); font-size: .9rem; margin-top: 8px; }
.missing { color: var(--muted); font-style: italic; }
pre { background: #10151d; color: #e6edf3; padding: 14px 16px; border-radius: 10px; overflow-x: auto;
      font: 13px/1.45 ui-monospace, "DejaVu Sans Mono", Menlo, Consolas, monospace; }
mark { background: #dff3e3; color: #14532d; padding: 0 3px; border-radius: 3px; }
@media (max-width: 560px) { .figures { grid-template-columns: 1fr; } main { padding: 14px 10px 40px; } }
"""

_WIDE = ("reconstructions", "class_risk")


def _best(rows: Sequence[Mapping[str, str]], column: str, better: str | None) -> set[int]:
    """Indices of the rows holding the best value of a column; none when the column is unranked or flat."""
    values = {i: v for i, r in enumerate(rows) if (v := number(r.get(column))) is not None}
    if better is None or len(set(values.values())) < 2:
        return set()
    target = (max if better == "max" else min)(values.values())
    return {i for i, v in values.items() if v == target}


def summary_table(rows: Sequence[Mapping[str, str]], columns: Sequence[Column] = PRIVACY_UTILITY) -> str:
    """Summary rows as an HTML table: formatted numbers, the best cell of each ranked column highlighted."""
    head = "".join(f"<th>{html.escape(header)}</th>" for _, header, _, _ in columns)
    best = {column: _best(rows, column, better) for column, _, _, better in columns}
    body = []
    for i, row in enumerate(rows):
        cells = []
        for column, _, fmt, _ in columns:
            raw, value = row.get(column) or "", number(row.get(column))
            if raw.strip().lower() in ("inf", "+inf"):
                text, cls = "∞", ""  # an exact reconstruction: the worst PSNR, never the best
            elif fmt is None or value is None:
                text, cls = (raw or "—"), ("" if raw else "na")
            else:
                text, cls = fmt(value), ("best" if i in best[column] else "")
            cells.append(f'<td class="{cls}">{html.escape(text)}</td>' if cls else f"<td>{html.escape(text)}</td>")
        body.append("<tr>" + "".join(cells) + "</tr>")
    return (f'<div class="table-wrap"><table><thead><tr>{head}</tr></thead><tbody>{"".join(body)}</tbody></table>'
            "</div>")


def _card(key: str, value: str, sub: str) -> str:
    return (f'<div class="card"><div class="k">{html.escape(key)}</div><div class="v">{html.escape(value)}</div>'
            f'<div class="s">{html.escape(sub)}</div></div>')


def headline_cards(rows: Sequence[Mapping[str, str]], attacked_rounds: int) -> str:
    """Three facts at a glance: the most private defense, the most accurate one, and what was run."""
    cards = []
    private = [(v, r["defense"]) for r in rows if (v := number(r.get("attack_psnr_best"))) is not None]
    if private:
        psnr, name = min(private)
        cards.append(_card("Best privacy", name, f"strongest attack reached only {psnr:.2f} dB PSNR"))
    accurate = [(v, r["defense"]) for r in rows if (v := number(r.get("final_accuracy"))) is not None]
    if accurate:
        acc, name = max(accurate)
        cards.append(_card("Best accuracy", name, f"final test accuracy {_PCT(acc)}"))
    rounds = max((number(r.get("rounds")) or 0 for r in rows), default=0)
    attacks = sum(number(r.get("attacks")) or 0 for r in rows)
    cards.append(_card("Compared", f"{len(rows)} defenses", f"{rounds:.0f} rounds, {attacks:.0f} attacks "
                                                             f"in {attacked_rounds} attacked rounds"))
    return f'<div class="cards">{"".join(cards)}</div>'


def _data_uri(path: Path) -> str:
    return "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode("ascii")


def figure_blocks(figures: Mapping[str, Path | None]) -> str:
    """One ``<figure>`` per drawn figure (image inline), a short note for each figure that had no data."""
    blocks = []
    for name, path in figures.items():
        heading, caption = CAPTIONS.get(name, (name, ""))
        if path is None:
            blocks.append(f'<figure><h3>{html.escape(heading)}</h3><p class="missing">Not drawn: this comparison '
                          f"has no data for it (no attacks, no predictions or no classes.csv).</p></figure>")
            continue
        wide = ' class="wide"' if name in _WIDE else ""
        blocks.append(f'<figure id="fig-{name}"{wide}><h3>{html.escape(heading)}</h3>'
                      f'<img src="{_data_uri(path)}" alt="{html.escape(heading)}" data-figure="{name}">'
                      f"<figcaption>{html.escape(caption)}</figcaption></figure>")
    return f'<div class="figures">{"".join(blocks)}</div>'


def _config_name(config_text: str | None) -> str | None:
    try:
        name = tomllib.loads(config_text or "").get("name")
    except tomllib.TOMLDecodeError:
        return None
    return name if isinstance(name, str) and name else None


def write_report(out_dir: Path, *, title: str | None = None) -> Path:
    """Draw every figure of ``out_dir`` and write the self-contained ``out_dir/report.html``; returns its path.

    ``title`` names the comparison in the page's heading (default: ``name`` in ``config.toml``, else the
    directory's name). Missing inputs leave a note in place of their figure instead of failing."""
    out_dir = Path(out_dir)
    figures = build_figures(out_dir)
    summary, rounds = read_table(out_dir / "summary.csv"), read_table(out_dir / "rounds.csv")
    config_path = out_dir / "config.toml"
    config_text = config_path.read_text(encoding="utf-8") if config_path.exists() else None
    page_title = f"flguard comparison: {title or _config_name(config_text) or out_dir.resolve().name}"
    attacked_rounds = len({r["round"] for r in rounds if r.get("attack_method")})
    tables = (f"<h3>Privacy and utility</h3>{summary_table(summary)}<h3>Cost</h3>{summary_table(summary, COSTS)}"
              if summary else '<p class="missing">summary.csv was not found.</p>')
    config_block = (f"<pre><code>{html.escape(config_text)}</code></pre>" if config_text is not None
                    else '<p class="missing">config.toml was not found in this directory.</p>')
    page = f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{html.escape(page_title)}</title>
<link rel="icon" href="data:,">
<style>{CSS}</style>
</head>
<body>
<main>
<header><h1>{html.escape(page_title)}</h1>
<p>Federated training under a simulated malicious server that runs gradient-inversion attacks on its clients,
one Flower simulation per defense. Generated by flguard from <code>{html.escape(str(out_dir.resolve()))}</code>.</p>
</header>
<section id="headline"><h2>Headline</h2>
{headline_cards(summary, attacked_rounds)}
{tables}
</section>
<section id="figures"><h2>Figures</h2>
{figure_blocks(figures)}
</section>
<section id="how-to-read"><h2>How to read this report</h2>
{HOW_TO_READ}
</section>
<section id="config"><h2>Configuration (as run)</h2>
{config_block}
</section>
</main>
</body>
</html>
"""
    path = out_dir / REPORT_FILE
    path.write_text(page, encoding="utf-8")
    return path
