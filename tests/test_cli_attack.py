"""``flguard attack`` end to end through typer's CliRunner, with tiny attack settings."""

from __future__ import annotations

import csv
import json
import math
import re
from pathlib import Path

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


def test_attack_refuses_defenses_until_the_guard_exists(tmp_path: Path) -> None:
    result = runner.invoke(app, ["attack", "--defense", "gaussian", "--out", str(tmp_path)])
    assert result.exit_code != 0
    assert "arrive with the guard" in _text(result.output)
    assert not any(tmp_path.iterdir())


def test_attack_rejects_unknown_method_and_hyperparameter(tmp_path: Path) -> None:
    unknown = runner.invoke(app, ["attack", "--method", "nope", "--out", str(tmp_path)])
    assert unknown.exit_code != 0 and "nope" in _text(unknown.output)
    bad_hp = runner.invoke(app, ["attack", "--dataset", "digits", "--iterations", "1", "--hp", "nope=1",
                                 "--out", str(tmp_path)])
    assert bad_hp.exit_code != 0 and "nope" in _text(bad_hp.output)
