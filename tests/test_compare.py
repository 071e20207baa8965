"""``flguard compare``: config validation, and a tiny comparison end to end through Flower's simulation
engine (Ray backend) via the real CLI — all output files with their fixed columns, numbers that
must hold (the guard's floor, LocalDpMod's measured noise against its closed form, the victim's
one-sample upload), and resume skipping finished runs."""

from __future__ import annotations

import csv
import json
import math
import tomllib
from pathlib import Path

import pytest
from typer.testing import CliRunner

from flguard.cli import app
from flguard.compare.config import DEFAULT_CONFIG, CompareConfig, load_config
from flguard.compare.tables import ROUND_COLUMNS, SUMMARY_COLUMNS
from flguard.config import ConfigError
from flguard.models import create
from conftest import SIMULATIONS, TINY_COMPARISON as TINY


def _write(tmp_path: Path, text: str, name: str = "config.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


# ---- config -------------------------------------------------------------------------------
def test_shipped_configs_are_valid() -> None:
    demo = load_config(DEFAULT_CONFIG)
    assert (demo.task.model, demo.task.dataset, demo.task.clients, demo.task.partitioning, demo.task.alpha) == \
        ("cnn", "mnist5k", 4, "dirichlet", 0.5)
    assert [d.defense for d in demo.defenses] == ["none", "localdp", "gaussian", "eigen"]
    taus = {d.min_rmse for d in demo.defenses if d.defense in ("gaussian", "eigen")}
    assert len(taus) == 1 and demo.attack.method == "gs" and demo.attack.clients_per_round == 1
    assert (demo.attack.fishing, demo.attack.fishing_clients) == ("class", 1)  # the demo shows all three kinds
    lfw = load_config(SIMULATIONS / "lfw.toml").task
    assert (lfw.model, lfw.dataset) == ("cnn", "lfw-faces")


def test_every_shipped_comparison_loads_and_the_warm_frontier_differs_only_in_its_start() -> None:
    """Every comparison in simulations/ validates; frontier_warm.toml is frontier.toml's task with a one-epoch warm
    start, 8 rounds at lr 0.05, and a subset of its defenses defined exactly as there (P5's two studies compare)."""
    comparisons = {path.name: load_config(path) for path in sorted(SIMULATIONS.glob("*.toml"))
                   if path.name not in ("pyproject.toml", "flwr-config.toml")}
    assert {"default.toml", "frontier.toml", "frontier_warm.toml", "lfw.toml", "resnet.toml"} <= set(comparisons)
    cold, warm = comparisons["frontier.toml"], comparisons["frontier_warm.toml"]
    changed = {k: v for k, v in warm.task.model_dump().items() if cold.task.model_dump()[k] != v}
    assert changed == {"pretrain_epochs": 1, "rounds": 8, "lr": 0.05}
    assert warm.attack == cold.attack
    rows = {d.name: d for d in cold.defenses}
    assert [d.name for d in warm.defenses] == ["none", "localdp-e700", "localdp-e2100", "localdp-e7000", "eigen-15dB",
                                               "auto-15dB", "auto-20dB"]
    assert all(d == rows[d.name] for d in warm.defenses)


@pytest.mark.parametrize("old, new, message", [
    ("rounds = 2", "rounds = 0", "CompareConfig.task.rounds"),
    ("rounds = 2", "roundz = 2", "CompareConfig.task.roundz.*unknown field"),
    ('model = "mlp"', 'model = "mpl"', "CompareConfig.task.model.*unknown model"),
    ('method = "gs"', 'method = "magic"', "CompareConfig.attack.method"),
    ("iterations = 8", "iterations = [8, 9]", "iterations"),
    ("seed = 0\n[task]", 'seed = 0\ndevice = "tpu"\n[task]', "CompareConfig.device"),
    ("epsilon = 20.0", "", "epsilon"),
    ("min_rmse = 0.2", "min_rmse = -1.0", "min_rmse"),
    ("min_rmse = 0.2", "min_rmse = 0.2\nepsilon = 1.0", "epsilon"),
    ('name = "dp"', 'name = "none"', "unique"),
])
def test_bad_configs_name_the_field(tmp_path: Path, old: str, new: str, message: str) -> None:
    assert old in TINY
    with pytest.raises(ConfigError, match=message):
        load_config(_write(tmp_path, TINY.replace(old, new, 1)))


def test_several_attack_methods_each_with_its_iterations() -> None:
    config = CompareConfig(**tomllib.loads(TINY.replace('method = "gs"', 'method = ["gs", "dlg"]')
                                           .replace("iterations = 8", "iterations = [8, 2]")))
    emitted = config.run_config(config.defenses[0])
    assert (emitted["attack-method"], emitted["attack-iterations"]) == ("gs,dlg", "8,2")


def test_fishing_maps_to_the_run_config_keys() -> None:
    plain = CompareConfig(**tomllib.loads(TINY))
    emitted = plain.run_config(plain.defenses[0])
    assert (emitted["attack-fishing"], emitted["attack-fishing-clients"]) == ("none", 1)
    fishing = CompareConfig(**tomllib.loads(TINY.replace("victim_local_steps = 1", 'victim_local_steps = 1\n'
                                                         'fishing = "class"\nfishing_clients = 1')))
    assert (fishing.attack.fishing, fishing.attack.fishing_clients) == ("class", 1)
    for spec in fishing.defenses:
        emitted = fishing.run_config(spec)
        assert (emitted["attack-fishing"], emitted["attack-fishing-clients"]) == ("class", 1)
        assert fishing.fingerprint(spec) != plain.fingerprint(spec)  # a run without fishing is not resumed


@pytest.mark.parametrize("fishing, message", [
    ('fishing = "feature"', r"CompareConfig\.attack\.fishing: value='feature'.*fish_feature"),
    ('fishing = "net"', r"CompareConfig\.attack\.fishing: .*'none', 'class' or 'feature'"),
    ('fishing = "class"\nfishing_clients = 0', r"CompareConfig\.attack\.fishing_clients.*greater than or equal to 1"),
    # 2 clients, 1 probed per round: one is left to fish, not two
    ('fishing = "class"\nfishing_clients = 2', r"attack\.fishing_clients=2: .* 2 - 1 .* = 1 of task\.clients"),
])
def test_bad_fishing_names_the_field(tmp_path: Path, fishing: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(_write(tmp_path, TINY.replace("victim_local_steps = 1", f"victim_local_steps = 1\n{fishing}")))


def test_unreadable_configs(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(_write(tmp_path, "[task\n"))
    with pytest.raises(ConfigError, match="no such config file"):
        load_config(tmp_path / "missing.toml")
    with pytest.raises(ConfigError, match="defenses"):
        load_config(_write(tmp_path, "[task]\nrounds = 2\n"))


def test_run_config_keys_are_declared_by_the_flower_app() -> None:
    """Flower rejects --run-config keys the app does not declare: every key a comparison emits must be
    in simulations/pyproject.toml, or the deployment-engine command would fail."""
    declared = tomllib.loads((SIMULATIONS / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]
    config = CompareConfig(**tomllib.loads(TINY))
    for spec in config.defenses:
        emitted = config.run_config(spec)
        assert set(emitted) <= set(declared), set(emitted) - set(declared)
    guarded = config.run_config(config.defense("guarded"))
    assert guarded["guard-defense"] == "gaussian" and guarded["guard-min-rmse"] == 0.2
    assert guarded["guard-input-bounds"] == "batch"
    assert config.run_config(config.defense("none"))["guard-defense"] == ""
    assert config.run_config(config.defense("dp"))["localdp-epsilon"] == 20.0


# ---- end to end ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def comparison(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, str]:
    import ray

    tmp = tmp_path_factory.mktemp("compare")
    config, out = _write(tmp, TINY), tmp / "out"
    try:
        result = CliRunner().invoke(app, ["compare", str(config), "--out", str(out)])
    finally:
        if ray.is_initialized():
            ray.shutdown()
    assert result.exit_code == 0, result.output + repr(result.exception)
    return config, out, result.output


def _rows(path: Path) -> tuple[list[str], list[dict[str, str]]]:
    with path.open(newline="") as handle:
        reader = csv.DictReader(handle)
        return list(reader.fieldnames or []), list(reader)


def test_comparison_writes_every_file_with_the_fixed_columns(comparison, one_thread) -> None:
    _, out, output = comparison
    for name in ("rounds.csv", "summary.csv", "classes.csv", "report.html", "config.toml"):
        assert (out / name).stat().st_size > 0, name
    columns, rows = _rows(out / "rounds.csv")
    assert tuple(columns[:len(ROUND_COLUMNS)]) == ROUND_COLUMNS
    assert len(rows) == 2 * 3 * 2  # rounds × defenses × clients
    assert {(int(r["round"]), r["defense"], int(r["client"])) for r in rows} == \
        {(t, d, c) for t in (1, 2) for d in ("none", "dp", "guarded") for c in (0, 1)}
    attacked = [r for r in rows if r["attack_target"] == "probe"]
    uploads = [r for r in rows if r["attack_target"] == "fedavg-upload"]
    withheld = [r for r in rows if r["error"]]
    # A one-sample victim update whose floor needs more noise than max_rel_noise allows is withheld
    # (fail closed): it shows as an error row without an upload, and nothing is attacked.
    for r in withheld:
        assert r["defense"] == "guarded" and "update withheld" in r["error"] and r["noise_norm"] == ""
    # one victim per round, the same client in every defense's run (rotating by partition id)
    victims = {1: 0, 2: 1}
    probed = attacked + [r for r in withheld if int(r["client"]) == victims[int(r["round"])]]
    assert sorted((int(r["round"]), r["defense"]) for r in probed) == \
        sorted((t, d) for t in (1, 2) for d in ("none", "dp", "guarded"))
    assert all(victims[int(r["round"])] == int(r["client"]) for r in probed)
    # ... and the other client's real 2-step upload of 4 samples, attacked by unrolling (attack-uploads)
    assert {(int(r["round"]), r["defense"]) for r in uploads} >= {(t, d) for t in (1, 2) for d in ("none", "dp")}
    for r in uploads:
        assert victims[int(r["round"])] != int(r["client"]) and float(r["attack_batch_size"]) == 8.0
        assert len(r["attack_rmse_samples"].split()) == 8 and math.isfinite(float(r["attack_psnr"]))
    for r in attacked:
        assert r["attack_method"] == "gs" and float(r["attack_batch_size"]) == 1.0  # the victim config held
        assert float(r["num_examples"]) == 1.0 and math.isfinite(float(r["attack_psnr"]))
    for r in rows:
        assert 0.0 <= float(r["test_accuracy"]) <= 1.0 and (r["error"] or float(r["grad_norm"]) > 0)
    columns, summary = _rows(out / "summary.csv")
    assert tuple(columns) == SUMMARY_COLUMNS and [s["defense"] for s in summary] == ["none", "dp", "guarded"]
    assert [int(s["dropped_updates"]) for s in summary] == [0, 0, len(withheld)]
    for s in summary:  # the promise per kind of attack, per sample
        assert int(s["probe_attacks"]) + int(s["upload_attacks"]) == int(s["attacks"])
        assert s["defense"] == "guarded" or (int(s["upload_attacks"]) == 2 and s["upload_tau_met_share"] != "")
    assert "guarded" in output and "best PSNR" in output  # the printed summary table


def test_comparison_numbers(comparison, one_thread) -> None:
    _, out, _ = comparison
    _, rows = _rows(out / "rounds.csv")
    by = {d: [r for r in rows if r["defense"] == d] for d in ("none", "dp", "guarded")}
    assert all(float(r["noise_norm"]) == 0.0 and float(r["min_pred_rmse"]) == 0.0 for r in by["none"])
    for r in (r for r in by["guarded"] if not r["error"]):  # the guard's promise per upload; its cost measured
        assert float(r["guard_met"]) == 1.0 and float(r["min_pred_rmse"]) >= 0.2 * (1 - 1e-6)
        assert float(r["noise_norm"]) > 0 and float(r["guard_seconds"]) > 0
    # LocalDpMod's measured noise against its closed form: E‖n‖ ≈ std·√d, std = Δ·√(2 ln(1.25/δ))/ε.
    dims = sum(p.numel() for p in create("mlp", in_channels=1, num_classes=10, image_size=8).state_dict().values())
    std = 1.0 * math.sqrt(2 * math.log(1.25 / 1e-5)) / 20.0
    for r in by["dp"]:
        steps_lr = 0.1 * (1 if r["attack_target"] == "probe" else 2)  # the victim ran 1 step, the others 2
        assert float(r["noise_norm"]) * steps_lr == pytest.approx(std * math.sqrt(dims), rel=0.05)
        assert r["min_pred_rmse"] == ""  # LocalDpMod's noise is not scored by flguard


def test_resume_skips_finished_runs_and_redoes_an_interrupted_one(comparison, one_thread) -> None:
    import ray

    config, out, _ = comparison
    runs = out / "runs"
    before = {d: (runs / d / "summary.json").stat().st_mtime_ns for d in ("none", "dp", "guarded")}
    (runs / "dp" / "summary.json").unlink()  # as if the run had been interrupted
    try:
        result = CliRunner().invoke(app, ["compare", str(config), "--out", str(out)])
    finally:
        if ray.is_initialized():
            ray.shutdown()
    assert result.exit_code == 0, result.output
    after = {d: (runs / d / "summary.json").stat().st_mtime_ns for d in ("none", "dp", "guarded")}
    assert after["none"] == before["none"] and after["guarded"] == before["guarded"]
    assert (runs / "dp" / "summary.json").exists() and json.loads((runs / "dp" / "summary.json").read_text())["rounds"] == 2
    assert "resumed" in result.output
    _, rows = _rows(out / "rounds.csv")
    assert len(rows) == 12


def test_run_config_for_the_deployment_engine(comparison) -> None:
    config, out, _ = comparison
    result = CliRunner().invoke(app, ["compare", str(config), "--out", str(out), "--run-config", "guarded"])
    assert result.exit_code == 0, result.output
    assert 'guard-defense="gaussian"' in result.output and "sim-truth-dir" not in result.output
    assert f'out-dir="{(out / "runs" / "guarded").resolve()}"' in result.output


def test_seed_option_replaces_the_configs_seed(comparison) -> None:
    """``--seed`` repeats a study with another seed: the Flower run config the defense gets carries it."""
    config, out, _ = comparison
    plain = CliRunner().invoke(app, ["compare", str(config), "--out", str(out), "--run-config", "guarded"])
    seeded = CliRunner().invoke(app, ["compare", str(config), "--out", str(out), "--run-config", "guarded",
                                      "--seed", "7"])
    assert plain.exit_code == 0 and seeded.exit_code == 0, plain.output + seeded.output
    assert "seed=7" in seeded.output.replace(" ", "") and "seed=7" not in plain.output.replace(" ", "")
