"""Merge the defense runs into the comparison's tables: ``rounds.csv`` and ``summary.csv``.

``rounds.csv`` has one row per (round, defense, client) — the client's evaluation of the global
model after that round, what its upload cost and carried (gradient norm, noise, predicted floor),
and, where the malicious server attacked that client, how well the attack did. ``summary.csv`` has
one row per defense. Units: ``min_pred_rmse`` and ``attack_rmse`` are per-sample RMSEs in the
model's input units (the unit of the guard's τ); ``attack_rmse_pixels`` is in pixels ([0, 1]).

Three kinds of attack (``attack_target``): ``probe``, an upload the server asked its victim for (one
sample, one step: the easiest to invert); ``fedavg-upload``, an honest client's real multi-step
upload, attacked by unrolling its known local steps; and ``fishing``, a one-step upload of a model
the server fished (its classifier rewritten so that only one class's samples reach the layers
before it, ``flguard.server.fishing``), attacked for that class's samples and never aggregated. The
promise — the share of attacked *samples* reconstructed no closer than τ (``attack_rmse_samples``
holds each sample's RMSE) — is reported for all attacks (``tau_met_share``) and for each kind
(``probe_tau_met_share``, ``upload_tau_met_share``, ``fishing_tau_met_share``).

A fished client's reply is not among the run's ``train_replies`` (FedAvg never saw it) but in
``fished_replies`` of its ``summary.json``: its row in rounds.csv has ``fished`` = 1 and the reply's
own metrics (the guard's outcome on the fished model, or the error it withheld with). The
utility-side columns of summary.csv (noise, guard time, dropped updates, samples left out) stay over
the aggregated replies; ``fished_withheld`` counts the fished replies that carried no update.
"""

from __future__ import annotations

import csv
import json
import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from flguard.compare.config import CompareConfig
from flguard.apps import SUMMARY_FILE

#: Fixed leading columns of rounds.csv (external checks read them); more follow.
ROUND_COLUMNS = ("round", "defense", "client", "test_accuracy", "test_loss", "grad_norm", "noise_norm", "rel_noise",
                 "min_pred_rmse", "attack_method", "attack_psnr", "attack_ssim", "attack_rmse", "guard_seconds",
                 "train_seconds")
# ``error``: why the client's train reply carried no update (e.g. the guard withheld it).
EXTRA_ROUND_COLUMNS = ("kind", "num_examples", "train_loss", "guard_met", "error", "median_pred_rmse",
                       "attack_rmse_pixels", "attack_label_accuracy", "attack_batch_size", "attack_seconds",
                       "attack_labels", "attack_image", "attack_error", "attack_target", "attack_rmse_samples",
                       "excluded_samples", "guarded_samples", "fished", "fished_class", "attack_targets",
                       "attack_true_targets")
SUMMARY_COLUMNS = ("defense", "kind", "tau", "rounds", "final_accuracy", "final_loss", "attacks", "attack_psnr_min",
                   "attack_psnr_median", "attack_psnr_best", "attack_ssim_best", "attack_rmse_min", "tau_met_share",
                   "mean_rel_noise", "mean_noise_norm", "guard_overhead", "guard_seconds", "train_seconds",
                   "dropped_updates", "run_seconds", "probe_attacks", "probe_tau_met_share", "upload_attacks",
                   "upload_attack_psnr_best", "upload_attack_rmse_min", "upload_tau_met_share", "excluded_share",
                   "fishing_attacks", "fishing_attack_psnr_best", "fishing_attack_rmse_min", "fishing_tau_met_share",
                   "fished_withheld")
#: The values of attack_target (flguard.server.uploads PROBE, UPLOAD, FISHED).
PROBE, UPLOAD, FISHING = "probe", "fedavg-upload", "fishing"
ATTACK_TARGETS = (PROBE, UPLOAD, FISHING)


def _number(value: Any) -> float | None:
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(number) else number  # inf stays: an exact reconstruction has PSNR = ∞


def _whole(value: Any) -> int | None:
    number = _number(value)
    return int(number) if number is not None and math.isfinite(number) else None


def read_attack_rows(directory: Path) -> list[dict[str, str]]:
    path = directory / "attacks.csv"
    if not path.exists():
        return []
    with path.open(encoding="utf-8", newline="") as handle:
        return list(csv.DictReader(handle))


def best_attacks(rows: Iterable[Mapping[str, str]]) -> dict[tuple[int, int], Mapping[str, str]]:
    """Per (round, node), the attack row with the best reconstruction (highest PSNR; unscored rows last)."""
    best: dict[tuple[int, int], Mapping[str, str]] = {}
    for row in rows:
        key = (int(row["round"]), int(row["node_id"]))
        score = _number(row.get("psnr"))
        held = _number(best[key].get("psnr")) if key in best else None
        if key not in best or (score is not None and (held is None or score > held)):
            best[key] = row
    return best


def _noise(metrics: Mapping[str, Any]) -> tuple[float, float]:
    """(noise_norm, rel_noise) from the guard's keys or the measured LocalDpMod keys; 0 without a defense."""
    for norm_key, rel_key in (("guard_noise_norm", "guard_rel_noise"), ("dp_noise_norm", "dp_rel_noise")):
        if norm_key in metrics:
            return float(metrics[norm_key]), float(metrics[rel_key])
    return 0.0, 0.0


def _pred(metrics: Mapping[str, Any], key: str, kind: str) -> float | None:
    """The guard's predicted floor; 0 for an undefended update (a perfect attacker recovers it exactly),
    empty where nothing was predicted (LocalDpMod's noise is not scored)."""
    if key in metrics:
        value = float(metrics[key])
        return value if value >= 0 else None
    return 0.0 if kind == "none" else None


def defense_rows(config: CompareConfig, name: str, directory: Path) -> list[dict[str, Any]]:
    """rounds.csv rows of one defense's finished run."""
    spec = config.defense(name)
    summary = json.loads((directory / SUMMARY_FILE).read_text())
    partitions = {int(k): int(v) for k, v in summary.get("partitions", {}).items()}
    attacks = best_attacks(read_attack_rows(directory))
    train = summary.get("train_replies", {})
    evaluate = summary.get("evaluate_replies", {})
    fished = summary.get("fished_replies", {})  # round -> node -> the fished reply's metrics (not aggregated)
    rows = []
    for server_round in sorted({int(r) for r in (*train, *evaluate, *fished)} | {r for r, _ in attacks}):
        replies_t, replies_e = train.get(str(server_round), {}), evaluate.get(str(server_round), {})
        replies_f = fished.get(str(server_round), {})
        attacked_nodes = {n for r, n in attacks if r == server_round}
        for node in sorted({int(n) for n in (*replies_t, *replies_e, *replies_f)} | attacked_nodes):
            was_fished = str(node) in replies_f
            t = replies_f[str(node)] if was_fished else replies_t.get(str(node), {})
            e, attack = replies_e.get(str(node), {}), attacks.get((server_round, node), {})
            reported = _number(t.get("partition-id", e.get("partition-id", attack.get("partition_id"))))
            client = partitions.get(node, int(reported) if reported is not None else -1)
            uploaded = bool(t) and "error" not in t  # a train reply that carried an update
            noise_norm, rel_noise = _noise(t) if uploaded else (None, None)
            row = {
                "round": server_round, "defense": name, "client": client,
                "test_accuracy": _number(e.get("eval-acc")), "test_loss": _number(e.get("eval-loss")),
                "grad_norm": _number(t.get("grad-norm")), "noise_norm": noise_norm, "rel_noise": rel_noise,
                "min_pred_rmse": _pred(t, "guard_min_rmse_after", spec.defense) if uploaded else None,
                "attack_method": attack.get("method") or None, "attack_psnr": _number(attack.get("psnr")),
                "attack_ssim": _number(attack.get("ssim")), "attack_rmse": _number(attack.get("rmse_input")),
                "guard_seconds": _number(t.get("guard_seconds", 0.0 if uploaded else None)),
                "train_seconds": _number(t.get("train-seconds")),
                "kind": spec.defense, "num_examples": _number(t.get("num-examples")),
                "train_loss": _number(t.get("train-loss")), "guard_met": _number(t.get("guard_met")),
                "error": t.get("error") or None, "attack_error": attack.get("error") or None,
                "median_pred_rmse": _pred(t, "guard_median_rmse_after", spec.defense) if uploaded else None,
                "attack_rmse_pixels": _number(attack.get("rmse")),
                "attack_label_accuracy": _number(attack.get("label_accuracy")),
                "attack_batch_size": _number(attack.get("batch_size")), "attack_seconds": _number(attack.get("seconds")),
                "attack_labels": attack.get("true_labels") or None,
                "attack_image": f"runs/{name}/{attack['tensors']}" if attack.get("tensors") else None,
                "attack_target": (attack.get("attack_target") or PROBE) if attack else None,
                "attack_rmse_samples": attack.get("rmse_input_samples") or None,
                # samples left out of the round's steps (max_excluded) and samples guarded in them
                "excluded_samples": _number(t.get("guard_excluded")) if uploaded else None,
                "guarded_samples": _number(t.get("guard_samples")) if uploaded else None,
                # the round's guarded local steps, and those sent with aimed noise (auto's fallback or an aimed defense)
                "guarded_steps": _number(t.get("guard_steps")) if uploaded else None,
                "aimed_steps": _number(t.get("guard_aimed_steps")) if uploaded else None,
                # the server sent this client a fished model this round: its reply was not aggregated
                "fished": int(was_fished or attack.get("attack_target") == FISHING),
                "fished_class": _whole(attack.get("fished_class")),
                "attack_targets": _whole(attack.get("targets")),
                "attack_true_targets": _whole(attack.get("true_targets")),
            }
            rows.append(row)
    return rows


def tau_of(config: CompareConfig, name: str) -> float | None:
    """The floor a defense is held to: its own τ, else the comparison's (largest) guard τ."""
    from flguard.guard.config import GuardConfig, THRESHOLD_DEFENSES

    spec = config.defense(name)
    if spec.defense in THRESHOLD_DEFENSES:  # τ in input units, also for a floor given as max_psnr
        return GuardConfig(defense=spec.defense, **config.guard_values(spec)).floor
    taus = [tau_of(config, d.name) for d in config.defenses if d.defense in THRESHOLD_DEFENSES]
    return max(taus) if taus else None


def _median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def sample_rmses(row: Mapping[str, Any]) -> list[float]:
    """Every attacked sample's RMSE (input units) of a rounds.csv row; the batch mean when not listed."""
    listed = [v for v in (_number(t) for t in str(row.get("attack_rmse_samples") or "").split()) if v is not None]
    if listed:
        return listed
    mean = _number(row.get("attack_rmse"))
    return [] if mean is None else [mean]


def tau_met_share(rows: Iterable[Mapping[str, Any]], tau: float | None) -> float | None:
    """The promise as measured: the share of attacked samples whose RMSE is at least τ."""
    values = [v for row in rows for v in sample_rmses(row)]
    return sum(v >= tau for v in values) / len(values) if values and tau is not None else None


def summary_row(config: CompareConfig, name: str, rows: Sequence[Mapping[str, Any]],
                run_summary: Mapping[str, Any]) -> dict[str, Any]:
    """One defense's summary.csv row from its rounds.csv rows and its run summary."""
    spec, tau = config.defense(name), tau_of(config, name)
    attacked = [r for r in rows if r["attack_method"]]
    psnr = [r["attack_psnr"] for r in attacked if r["attack_psnr"] is not None]
    rmse = [v for r in attacked for v in sample_rmses(r)]  # per sample: the promise is per sample
    ssim = [r["attack_ssim"] for r in attacked if r["attack_ssim"] is not None]
    probes = [r for r in attacked if (r.get("attack_target") or PROBE) == PROBE]
    uploaded = [r for r in attacked if r.get("attack_target") == UPLOAD]
    upload_psnr = [r["attack_psnr"] for r in uploaded if r["attack_psnr"] is not None]
    upload_rmse = [v for r in uploaded for v in sample_rmses(r)]
    fishing = [r for r in attacked if r.get("attack_target") == FISHING]
    fishing_psnr = [r["attack_psnr"] for r in fishing if r["attack_psnr"] is not None]
    fishing_rmse = [v for r in fishing for v in sample_rmses(r)]
    aggregated = [r for r in rows if not r.get("fished")]  # what FedAvg received: the utility side
    uploads = [r for r in aggregated if r["rel_noise"] is not None]
    guard_s = sum(r["guard_seconds"] or 0.0 for r in uploads)
    train_s = sum(r["train_seconds"] or 0.0 for r in uploads)
    last = max((int(k) for k in run_summary.get("evaluate_metrics", {})), default=None)
    final = run_summary.get("evaluate_metrics", {}).get(str(last), {}) if last is not None else {}
    return {
        "defense": name, "kind": spec.defense, "tau": tau, "rounds": config.task.rounds,
        "final_accuracy": _number(final.get("eval-acc")), "final_loss": _number(final.get("eval-loss")),
        "attacks": len(attacked), "attack_psnr_min": min(psnr, default=None), "attack_psnr_median": _median(psnr),
        "attack_psnr_best": max(psnr, default=None), "attack_ssim_best": max(ssim, default=None),
        "attack_rmse_min": min(rmse, default=None),
        "tau_met_share": tau_met_share(attacked, tau),
        "mean_rel_noise": statistics.fmean(r["rel_noise"] for r in uploads) if uploads else None,
        "mean_noise_norm": statistics.fmean(r["noise_norm"] for r in uploads) if uploads else None,
        "guard_overhead": guard_s / train_s if train_s > 0 else None, "guard_seconds": guard_s,
        "train_seconds": train_s, "dropped_updates": sum(1 for r in aggregated if r["error"]),
        "run_seconds": _number(run_summary.get("seconds")),
        "probe_attacks": len(probes), "probe_tau_met_share": tau_met_share(probes, tau),
        "upload_attacks": len(uploaded), "upload_attack_psnr_best": max(upload_psnr, default=None),
        "upload_attack_rmse_min": min(upload_rmse, default=None), "upload_tau_met_share": tau_met_share(uploaded, tau),
        "excluded_share": _share(uploads, "excluded_samples", "guarded_samples"),
        "fishing_attacks": len(fishing), "fishing_attack_psnr_best": max(fishing_psnr, default=None),
        "fishing_attack_rmse_min": min(fishing_rmse, default=None), "fishing_tau_met_share": tau_met_share(fishing, tau),
        "fished_withheld": sum(1 for r in rows if r.get("fished") and r["error"]),
    }


def _share(rows: Sequence[Mapping[str, Any]], part: str, whole: str) -> float | None:
    """Σ part / Σ whole over the rows that report both (None when none does)."""
    pairs = [(r[part], r[whole]) for r in rows if r.get(part) is not None and r.get(whole)]
    return sum(p for p, _ in pairs) / sum(w for _, w in pairs) if pairs else None


def write_csv(path: Path, columns: Sequence[str], rows: Iterable[Mapping[str, Any]]) -> Path:
    with path.open("w", encoding="utf-8", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(columns), extrasaction="ignore")
        writer.writeheader()
        for row in rows:
            writer.writerow({k: "" if row.get(k) is None else row.get(k) for k in columns})
    return path


def build_tables(config: CompareConfig, out: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Write ``rounds.csv`` and ``summary.csv`` for every finished defense run; returns their rows."""
    from flguard.compare.runner import is_finished, run_directory

    out = Path(out)
    all_rows, summaries = [], []
    for spec in config.defenses:
        directory = run_directory(out, spec)
        if not is_finished(config, spec, directory):  # absent, interrupted, or run under other settings
            continue
        rows = defense_rows(config, spec.name, directory)
        all_rows.extend(rows)
        summaries.append(summary_row(config, spec.name, rows, json.loads((directory / SUMMARY_FILE).read_text())))
    all_rows.sort(key=lambda r: (r["round"], [d.name for d in config.defenses].index(r["defense"]), r["client"]))
    write_csv(out / "rounds.csv", ROUND_COLUMNS + EXTRA_ROUND_COLUMNS, all_rows)
    write_csv(out / "summary.csv", SUMMARY_COLUMNS, summaries)
    return all_rows, summaries
