"""Fishing in ``flguard compare``: a synthetic finished run (its summary.json and attacks.csv, as the
malicious server writes them) with one probe, one fished client per round and a fished reply the
guard withheld, merged by ``build_tables`` and drawn by ``write_report`` — fishing rows are a third
kind beside probes and real uploads, fished replies are reported (marked) but not counted as
aggregated updates, and the report explains and shows them."""

from __future__ import annotations

import csv
import json
import tomllib
from pathlib import Path

import pytest

from flguard.compare.config import CompareConfig
from flguard.compare.figures import ATTACK_KINDS, attack_kind
from flguard.compare.report import write_report
from flguard.compare.runner import run_directory
from flguard.compare.tables import ATTACK_TARGETS, EXTRA_ROUND_COLUMNS, SUMMARY_COLUMNS, build_tables
from flguard.apps import SUMMARY_FILE
from flguard.server.results import ROW_FIELDS
from conftest import TINY_COMPARISON

pytestmark = pytest.mark.usefixtures("one_thread")
TINY = TINY_COMPARISON.replace("victim_local_steps = 1", 'victim_local_steps = 1\nfishing = "class"')
NODES = {11: 0, 22: 1}  # node id -> partition id
WITHHELD = "update withheld: suspicious parameters: no sample's input moves its gradient"


def _attack(server_round: int, node: int, target: str, psnr: float, samples: str, **extra) -> dict:
    return {"round": server_round, "node_id": node, "partition_id": NODES[node], "attack": "gs", "method": "gs",
            "attack_target": target, "batch_size": 1 if target == "probe" else 4, "local_steps": 1, "scored": True,
            "psnr": psnr, "rmse_input": sum(map(float, samples.split())) / len(samples.split()),
            "rmse_input_samples": samples, "status": "ok", **extra}


def _reply(rel_noise: float, *, partition: int) -> dict:
    return {"partition-id": partition, "grad-norm": 1.0, "num-examples": 4, "train-loss": 0.5, "train-seconds": 1.0,
            "guard_noise_norm": rel_noise, "guard_rel_noise": rel_noise, "guard_seconds": 2.0, "guard_met": 1.0,
            "guard_min_rmse_after": 0.3}


def write_run(out: Path, config: CompareConfig, name: str) -> Path:
    """Round 1: node 11 probed, node 22 fished (class 0, 3 targets, one attack of two methods);
    round 2: node 22 probed, node 11 fished and its guard withheld the update (no attack row)."""
    spec = config.defense(name)
    directory = run_directory(out, spec)
    directory.mkdir(parents=True)
    evaluate = {str(r): {str(n): {"eval-acc": 0.5 + 0.1 * r, "eval-loss": 1.0, "partition-id": p}
                         for n, p in NODES.items()} for r in (1, 2)}
    summary = {"rounds": 2, "seconds": 9.0, "run_config": config.run_config(spec),
               "partitions": {str(n): p for n, p in NODES.items()},
               "train_replies": {"1": {"11": _reply(2.0, partition=0)}, "2": {"22": _reply(4.0, partition=1)}},
               "fished_replies": {"1": {"22": _reply(100.0, partition=1)}, "2": {"11": {"error": WITHHELD}}},
               "evaluate_replies": evaluate, "evaluate_metrics": {"1": {"eval-acc": 0.6}, "2": {"eval-acc": 0.7}}}
    (directory / SUMMARY_FILE).write_text(json.dumps(summary))
    rows = [_attack(1, 11, "probe", 20.0, "0.1"),
            _attack(1, 22, "fishing", 15.0, "0.15 0.25 0.35", fished_class=0, targets=3, true_targets=3),
            _attack(1, 22, "fishing", 9.0, "0.5 0.6 0.7", fished_class=0, targets=3, true_targets=3),  # not the best
            _attack(2, 22, "probe", 12.0, "0.5")]
    with (directory / "attacks.csv").open("w", newline="", encoding="utf-8") as handle:
        writer = csv.DictWriter(handle, fieldnames=ROW_FIELDS)
        writer.writeheader()
        writer.writerows({k: row.get(k, "") for k in ROW_FIELDS} for row in rows)
    return directory


@pytest.fixture(scope="module")
def merged(tmp_path_factory) -> tuple[Path, list[dict], list[dict]]:
    config = CompareConfig(**tomllib.loads(TINY))
    out = tmp_path_factory.mktemp("fishing") / "out"
    write_run(out, config, "guarded")
    (out / "config.toml").write_text(TINY, encoding="utf-8")
    rows, summaries = build_tables(config, out)
    return out, rows, summaries


def test_attack_kinds_are_the_servers() -> None:
    from flguard.server.uploads import FISHED, PROBE, UPLOAD

    assert ATTACK_TARGETS == (PROBE, UPLOAD, FISHED) == tuple(ATTACK_KINDS)
    assert attack_kind({"attack_target": ""}) == "probe"  # runs from before the column


def test_fishing_rows_are_a_third_kind_and_fished_replies_are_marked(merged) -> None:
    out, rows, _ = merged
    with (out / "rounds.csv").open(newline="", encoding="utf-8") as handle:
        written = list(csv.DictReader(handle))
    assert len(written) == len(rows) == 4  # 2 rounds × 2 clients: fished clients are not dropped
    by = {(int(r["round"]), int(r["client"])): r for r in written}
    assert {k: r["attack_target"] for k, r in by.items()} == \
        {(1, 0): "probe", (1, 1): "fishing", (2, 0): "", (2, 1): "probe"}
    assert {k: r["fished"] for k, r in by.items()} == {(1, 0): "0", (1, 1): "1", (2, 0): "1", (2, 1): "0"}
    fished = by[(1, 1)]  # the best of its two attacks, with what the server counted and the truth
    assert (float(fished["attack_psnr"]), fished["attack_rmse_samples"]) == (15.0, "0.15 0.25 0.35")
    assert (fished["fished_class"], fished["attack_targets"], fished["attack_true_targets"]) == ("0", "3", "3")
    # the fished reply's own metrics (the guard ran on the fished model), not an absent train reply
    assert float(fished["guard_met"]) == 1.0 and float(fished["rel_noise"]) == 100.0
    assert float(fished["min_pred_rmse"]) == 0.3 and fished["error"] == ""
    withheld = by[(2, 0)]
    assert withheld["error"] == WITHHELD and withheld["attack_method"] == "" and withheld["rel_noise"] == ""
    assert float(withheld["test_accuracy"]) == pytest.approx(0.7)
    for (r, c), row in by.items():
        assert (row["fished_class"], row["attack_targets"]) == (("0", "3") if (r, c) == (1, 1) else ("", ""))
    assert list(csv.DictReader((out / "rounds.csv").open()).fieldnames)[-len(EXTRA_ROUND_COLUMNS):] == \
        list(EXTRA_ROUND_COLUMNS)


def test_summary_counts_each_kind_and_keeps_fished_replies_out_of_the_costs(merged) -> None:
    out, _, summaries = merged
    (s,) = summaries
    assert s["tau"] == pytest.approx(0.2)
    assert (s["attacks"], s["probe_attacks"], s["upload_attacks"], s["fishing_attacks"]) == (3, 2, 0, 1)
    assert s["fishing_attack_psnr_best"] == 15.0 and s["fishing_attack_rmse_min"] == 0.15
    assert s["fishing_tau_met_share"] == pytest.approx(2 / 3)  # 0.25, 0.35 ≥ τ; 0.15 not
    assert s["probe_tau_met_share"] == pytest.approx(1 / 2)    # 0.5 ≥ τ; 0.1 not
    assert s["tau_met_share"] == pytest.approx(3 / 5)          # per sample, over every kind
    assert s["attack_psnr_best"] == 20.0
    # FedAvg saw the two train replies only: the fished ones are neither noise, cost nor dropped updates
    assert s["mean_rel_noise"] == pytest.approx(3.0) and s["guard_seconds"] == pytest.approx(4.0)
    assert (s["dropped_updates"], s["fished_withheld"]) == (0, 1)
    with (out / "summary.csv").open(newline="", encoding="utf-8") as handle:
        reader = csv.DictReader(handle)
        assert tuple(reader.fieldnames or ()) == SUMMARY_COLUMNS
        (row,) = list(reader)
    assert (row["fishing_attacks"], row["fished_withheld"], row["fishing_attack_psnr_best"]) == ("1", "1", "15.0")


def test_report_explains_and_shows_fishing(merged) -> None:
    out, _, _ = merged
    page = write_report(out).read_text(encoding="utf-8")
    table = page[page.index("<table>"):page.index("</table>")]
    for header in ("fishing attacks", "best fished PSNR (dB)", "τ met, fished", "fished replies withheld"):
        assert f"<th>{header}</th>" in table
    row = next(r for r in table.split("<tr>") if r.startswith("<td>guarded</td>"))
    assert ">15.00</td>" in row and ">66.7%</td>" in row  # best fished PSNR; τ met over the fished samples
    assert "Three kinds of attack" in page and "<code>fishing</code>" in page and "never aggregated" in page
    assert "half-filled" in page  # the attack figure's caption names the fished markers
    assert (out / "figures" / "attack_psnr.png").exists()
