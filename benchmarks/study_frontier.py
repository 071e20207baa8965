"""P5 (issue 23 §4): does the per-sample guard buy accuracy at equal protection, where FL trains the model?

Reads a finished comparison of ``simulations/frontier.toml`` (``flguard compare simulations/frontier.toml
--out DIR``; ``--run`` starts it first) and, for each guard, compares its final accuracy with LocalDpMod's
*at the guard's best-attack PSNR*: LocalDpMod's (best-attack PSNR, final accuracy) points at its three
ε, linearly interpolated in PSNR. P5 = guard accuracy − interpolated LocalDpMod accuracy, in points;
a guard whose PSNR lies outside LocalDpMod's range is compared with the nearest ε and marked so.
Two attackers: every attack of the run (``attack_psnr_best``, passive probes and fishing together)
and the fishing attacker alone (``fishing_attack_psnr_best``).

    python benchmarks/study_frontier.py --run --out frontier-out      # CPU: about an hour
    python benchmarks/study_frontier.py --out frontier-out            # the table of a finished run
    python benchmarks/study_frontier.py --run --seed 1 --out frontier-seed1 --tag _seed1 --only none localdp-e700 \
        localdp-e2100 localdp-e7000 eigen-15dB eigen-15dB-unclipped clip-only    # the study repeated, a subset
    python benchmarks/study_frontier.py --run --config simulations/frontier_warm.toml --seed 1 --out frontier-warm-s1 \
        --tag _warm_s1                                                  # from a one-epoch warm start (8 rounds)
"""

from __future__ import annotations

import argparse
import csv
import subprocess
import sys
from pathlib import Path

from _common import ROOT, study_paths, write_table

GUARDS = ("gaussian", "rowspace", "eigen", "auto")


def _float(value: str | None) -> float | None:
    try:
        out = float(value) if value not in (None, "") else None
    except ValueError:
        return None
    return out if out is None or out == out else None


def interpolate(points: list[tuple[float, float]], psnr: float) -> tuple[float, bool]:
    """LocalDpMod's accuracy at ``psnr`` (linear in PSNR between its ε), and whether ``psnr`` is inside
    their range (else the nearest point's accuracy)."""
    points = sorted(points)
    if psnr <= points[0][0]:
        return points[0][1], psnr == points[0][0]
    if psnr >= points[-1][0]:
        return points[-1][1], psnr == points[-1][0]
    for (p0, a0), (p1, a1) in zip(points, points[1:]):
        if p0 <= psnr <= p1:
            return a0 + (a1 - a0) * (psnr - p0) / (p1 - p0) if p1 > p0 else max(a0, a1), True
    raise AssertionError("unreachable")


def p5_table(rows: list[dict], column: str) -> list[dict]:
    """Each guard's P5 against every attack or the fishing attacker alone (``column``), and its ceiling: the P5
    a defense with the undefended run's accuracy would get at the same PSNR (``none`` minus LocalDpMod there, in
    points; absent without a ``none`` row). Where LocalDpMod's ε cost no accuracy the ceiling is near zero, and no
    defense that does not train better than no defense reaches P5's goal (≥ +5)."""
    dp = [(_float(r[column]), _float(r["final_accuracy"])) for r in rows if r["kind"] == "localdp"]
    undefended = next((_float(r["final_accuracy"]) for r in rows if r["kind"] == "none"), None)
    dp = [(p, a) for p, a in dp if p is not None and a is not None]
    table = []
    for row in rows:
        if row["kind"] not in GUARDS:
            continue
        psnr, accuracy = _float(row[column]), _float(row["final_accuracy"])
        entry = {"defense": row["defense"], "attacker": column, "psnr": psnr, "accuracy": accuracy}
        if psnr is not None and accuracy is not None and len(dp) >= 2:
            reference, inside = interpolate(dp, psnr)
            entry.update(localdp_accuracy=reference, p5_points=100 * (accuracy - reference), inside_localdp_range=inside)
            if undefended is not None:
                entry["p5_ceiling"] = 100 * (undefended - reference)
        table.append(entry)
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="frontier-out", help="the comparison's output folder")
    parser.add_argument("--config", default=str(ROOT / "simulations" / "frontier.toml"))
    parser.add_argument("--run", action="store_true", help="run the comparison first")
    parser.add_argument("--seed", type=int, help="with --run: the config's seed replaced (the study repeated)")
    parser.add_argument("--only", nargs="*", help="with --run: these defenses only")
    parser.add_argument("--tag", default="", help="suffix of the P5 table's file (study_frontier<tag>.csv)")
    args = parser.parse_args()
    out = Path(args.out)
    if args.run:
        extra = ([] if args.seed is None else ["--seed", str(args.seed)]) + [a for d in args.only or [] for a in ("--only", d)]
        subprocess.run([sys.executable, "-m", "flguard.cli", "compare", args.config, "--out", str(out), *extra], check=True)
    with open(out / "summary.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    print(write_table(rows, None, columns=["defense", "kind", "final_accuracy", "attack_psnr_best",
                                           "fishing_attack_psnr_best", "tau_met_share", "mean_rel_noise",
                                           "guard_overhead", "dropped_updates"]))
    table = p5_table(rows, "attack_psnr_best") + p5_table(rows, "fishing_attack_psnr_best")
    _, path = study_paths(f"study_frontier{args.tag}")
    print(write_table(table, path))


if __name__ == "__main__":
    main()
