"""``flguard attack`` end to end through typer's CliRunner, with tiny attack settings."""

from __future__ import annotations

import csv
import json
import math
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from flguard.cli import app

runner = CliRunner()


def _text(output: str) -> str:
    """CLI output without rich's box drawing and line wrapping."""
    return " ".join(re.sub(r"[\u2500-\u257f]", " ", output).split())


def test_attack_writes_grid_and_metrics(tmp_path: Path) -> None:
    out = tmp_path / "out"
    result = runner.invoke(app, ["attack", "--model", "lenet", "--dataset", "lfw-faces", "--method", "gs",
                                 "--defense", "none", "--samples", "2", "--iterations", "5", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert (out / "reconstruction.png").stat().st_size > 0
    summary = json.loads((out / "metrics.json").read_text())
    assert summary["method"] == "gs" and summary["defense"] == "none" and summary["samples"] == 2
    assert len(summary["per_sample"]) == 2 and math.isfinite(summary["mean_psnr"])
    with open(out / "metrics.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert len(rows) == 2 and {"index", "label", "recovered_label", "psnr", "ssim", "mse"} <= set(rows[0])
    assert all(math.isfinite(float(row["psnr"])) for row in rows)


# R-GAP on a c(M) = 0 tanh net is closed form: exact on the raw gradient, and fast.
RGAP = ["attack", "--model", "cnn2_v1", "--dataset", "lfw-faces", "--method", "rgap"]


def test_attack_with_a_defense_attacks_only_what_the_guard_sends(tmp_path: Path) -> None:
    """``--defense`` puts the client's guard before the attack: the exact attack on the raw upload
    fails on the guarded one, and each sample's measured error sits beside the guard's promise."""
    raw = runner.invoke(app, [*RGAP, "--out", str(tmp_path / "raw")])
    assert raw.exit_code == 0, raw.output
    unguarded = json.loads((tmp_path / "raw" / "metrics.json").read_text())
    assert "guard" not in unguarded and unguarded["mean_psnr"] > 60  # R-GAP inverts the raw gradient exactly
    assert unguarded["per_sample"][0]["rmse_input"] < 1e-3

    tau = 0.01
    guarded = runner.invoke(app, [*RGAP, "--defense", "gaussian", "--guard", f"min_rmse={tau}", "--guard", "seed=0",
                                  "--out", str(tmp_path / "guarded")])
    assert guarded.exit_code == 0, guarded.output
    summary = json.loads((tmp_path / "guarded" / "metrics.json").read_text())
    report = summary["guard"]
    assert summary["defense"] == "gaussian" and report["sent"] and report["guard_met"] == 1.0
    assert report["min_rmse"] == tau and report["guard_rel_noise"] > 0
    (sample,) = summary["per_sample"]
    assert sample["predicted_rmse"] >= tau * (1 - 1e-3)  # the promise, per sample
    assert sample["rmse_input"] >= tau  # ... which the attack on the sent update does not beat
    assert summary["mean_psnr"] < 20  # the same attack, on what the guard let through
    with open(tmp_path / "guarded" / "metrics.csv", newline="") as handle:
        (row,) = csv.DictReader(handle)
    assert float(row["predicted_rmse"]) == pytest.approx(sample["predicted_rmse"])


def test_attack_with_a_defense_is_not_run_on_a_withheld_update(tmp_path: Path) -> None:
    """A floor the noise budget cannot meet: the guard fails closed, so nothing is attacked."""
    result = runner.invoke(app, [*RGAP, "--defense", "gaussian", "--guard", "min_rmse=0.5", "--guard",
                                 "max_rel_noise=10", "--guard", "seed=0", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert "withheld the upload" in _text(result.output)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.json"]
    report = json.loads((tmp_path / "metrics.json").read_text())["guard"]
    assert not report["sent"] and report["guard_dropped"] == 1.0 and report["guard_met"] == 0.0
    assert "max_rel_noise" in report["reason"]


def test_attack_defense_options_are_validated_before_anything_runs(tmp_path: Path) -> None:
    unknown = runner.invoke(app, [*RGAP, "--defense", "bogus", "--out", str(tmp_path)])
    assert unknown.exit_code != 0 and "defense" in _text(unknown.output) and "bogus" in _text(unknown.output)
    orphan = runner.invoke(app, [*RGAP, "--guard", "min_rmse=0.1", "--out", str(tmp_path)])
    assert orphan.exit_code != 0 and "--defense" in _text(orphan.output)
    typo = runner.invoke(app, [*RGAP, "--defense", "gaussian", "--guard", "min_rmsee=0.1", "--out", str(tmp_path)])
    assert typo.exit_code != 0 and "min_rmsee" in _text(typo.output)
    assert not any(tmp_path.iterdir())


def test_attack_rejects_unknown_method_and_hyperparameter(tmp_path: Path) -> None:
    unknown = runner.invoke(app, ["attack", "--method", "nope", "--out", str(tmp_path)])
    assert unknown.exit_code != 0 and "nope" in _text(unknown.output)
    bad_hp = runner.invoke(app, ["attack", "--dataset", "digits", "--iterations", "1", "--hp", "nope=1",
                                 "--out", str(tmp_path)])
    assert bad_hp.exit_code != 0 and "nope" in _text(bad_hp.output)
