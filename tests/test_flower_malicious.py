"""The malicious server (``flguard.server``) in a real Flower simulation, and the pieces it rests on.

The simulation test runs Flower's Simulation Engine in-process (Ray backend, 2 SuperNodes,
2 rounds, LeNet on MNIST-5k, GS with a few iterations) and checks what lands on disk and what
reaches aggregation. Ray is shut down afterwards, whatever happens. The client import path
(``flguard.flower``) is checked, in a fresh interpreter, to load none of the server's code.
"""

from __future__ import annotations

import csv
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from flwr.app import Context, RecordDict

from flguard.simulation import TRUTH_DIR_KEY, TruthChannelRefused, in_simulation_runtime, record_batch, task
from flguard.server import AttackSpec, MaliciousServer, TrueBatch, TruthReader, delta_to_gradient
from flguard.server.uploads import UPLOAD, UploadAttack, upload_attack_from_config
from flguard.server.victims import first_clients, honest_targets

def _context(run_config: dict | None = None) -> Context:
    return Context(run_id=7, node_id=11, node_config={"partition-id": 0, "num-partitions": 2},
                   state=RecordDict(), run_config=run_config or {})


def test_fedsgd_upload_decodes_to_the_batch_gradient() -> None:
    """One local SGD step: (θ0 − θ1)/lr is the batch gradient the attacks invert."""
    settings = task.TaskSettings(batch_size=3, lr=0.05, local_steps=1)
    train, _ = task.load_partition(settings, 0, 2)
    model = task.make_model(settings)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    update = task.local_sgd(model, train, lr=settings.lr, steps=1, batch_size=3,
                            generator=task.batch_generator(settings, 1, 0))
    decoded = delta_to_gradient(task.make_model(settings), before, model.state_dict(),
                                dict(settings.train_config()))

    reference = task.make_model(settings)
    loss = torch.nn.functional.cross_entropy(reference(update.inputs), update.labels)
    expected = torch.autograd.grad(loss, list(reference.parameters()))
    assert decoded.batch_size == 3 and decoded.local_steps == 1
    for got, want in zip(decoded.gradient, expected):
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-3)


def test_multi_step_upload_keeps_the_raw_update() -> None:
    settings = task.TaskSettings(batch_size=2, lr=0.1, local_steps=3)
    train, _ = task.load_partition(settings, 1, 2)
    model = task.make_model(settings)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    update = task.local_sgd(model, train, lr=0.1, steps=3, batch_size=2, generator=torch.Generator().manual_seed(0))
    decoded = delta_to_gradient(model, before, model.state_dict(), dict(settings.train_config()))
    assert update.inputs.shape[0] == 6 and decoded.batch_size == 6 and decoded.local_steps == 3
    for (name, _), raw, grad in zip(model.named_parameters(), decoded.update, decoded.gradient):
        torch.testing.assert_close(raw, model.state_dict()[name] - before[name])
        torch.testing.assert_close(grad, -raw / 0.3)


def test_truth_channel_refuses_outside_the_simulation_runtime(tmp_path: Path) -> None:
    """No Ray actor here: an explicit directory is refused, a run-config one is ignored."""
    assert not in_simulation_runtime()
    x, y = torch.zeros(1, 1, 28, 28), torch.zeros(1, dtype=torch.long)
    with pytest.raises(TruthChannelRefused):
        record_batch(_context(), 1, x, y, directory=tmp_path)
    assert record_batch(_context({TRUTH_DIR_KEY: str(tmp_path)}), 1, x, y) is None
    assert not any(tmp_path.iterdir())
    with pytest.raises(TruthChannelRefused):
        TruthReader(tmp_path, grid=object())  # only Flower's simulation grid may read it


def test_attack_spec_validates() -> None:
    with pytest.raises(ValueError):
        AttackSpec(labels="guess")
    with pytest.raises(ValueError):
        AttackSpec(restarts=0)


def _simulate(server_app, client_app, supernodes: int) -> None:
    """Flower's Ray simulation of the two apps; Ray is shut down whatever happens."""
    from flwr.simulation import run_simulation

    try:
        run_simulation(server_app=server_app, client_app=client_app, num_supernodes=supernodes,
                       backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0},
                                       "init_args": {"num_cpus": 2}})
    finally:
        import ray

        if ray.is_initialized():
            ray.shutdown()


def test_malicious_server_in_a_ray_simulation(tmp_path: Path, simulation_apps) -> None:
    """2 clients × 2 rounds: one scored row per attacked client per round, nothing extra aggregated."""
    make_client_app, make_server_app = simulation_apps
    out_dir, truth_dir = tmp_path / "results", tmp_path / "truth"
    overrides = {"num-server-rounds": 2, "batch-size": 1, "local-steps": 1, "lr": 0.1, "init": "uniform",
                 "attack-method": "gs", "attack-iterations": 8, "attack-restarts": 1, "round-timeout": 600.0,
                 "out-dir": str(out_dir), TRUTH_DIR_KEY: str(truth_dir)}
    results = []
    _simulate(make_server_app(overrides, on_result=results.append), make_client_app(overrides), 2)

    rows = [json.loads(line) for line in (out_dir / "attacks.jsonl").read_text().splitlines()]
    keys = [(row["round"], row["node_id"]) for row in rows]
    assert len(rows) == 4 and len(set(keys)) == 4, keys
    assert {row["round"] for row in rows} == {1, 2} and len({row["node_id"] for row in rows}) == 2
    for row in rows:
        assert row["status"] == "ok", row["error"]
        assert row["scored"] and row["partition_id"] in (0, 1)
        assert math.isfinite(row["psnr"]) and math.isfinite(row["ssim"]) and row["mse"] >= 0
        assert (out_dir / row["image"]).is_file()
    with open(out_dir / "attacks.csv", newline="") as handle:
        assert len(list(csv.DictReader(handle))) == 4

    # The true batches travelled through files only, and every file was consumed by the server.
    assert not list(truth_dir.rglob("*.pt"))
    # What was aggregated is exactly the model and the declared metrics: no truth, no extras.
    (result,) = results
    assert list(result.arrays.keys()) == list(task.make_model(task.TaskSettings()).state_dict().keys())
    for metrics in result.train_metrics_clientapp.values():
        assert set(metrics.keys()) <= set(task.TRAIN_METRIC_KEYS)
    assert set(result.train_metrics_clientapp) == {1, 2} and set(result.evaluate_metrics_clientapp) == {1, 2}


def _two_step_upload():
    """One honest client's real K = 2 step FedAvg round (B = 1): settings, the trained model, its start
    state, the local update (its batches) and the dataset."""
    settings = task.TaskSettings(batch_size=1, lr=0.1, local_steps=2, init="uniform")
    train, _ = task.load_partition(settings, 0, 2)
    model = task.make_model(settings)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    update = task.local_sgd(model, train, lr=0.1, steps=2, batch_size=1, generator=torch.Generator().manual_seed(1))
    return settings, model, before, update, task.load_dataset(settings.dataset)


def test_k_step_upload_is_attacked_by_unrolling_and_scored(tmp_path: Path) -> None:
    """Without Flower's runtime: one K = 2 step upload through ``attack_upload``, scored on its 2 images."""
    from flwr.serverapp.strategy import FedAvg

    settings, model, before, update, data = _two_step_upload()
    server = MaliciousServer(FedAvg(), model_fn=lambda: task.make_model(settings), input_shape=data.shape,
                             attacks=[AttackSpec("gs", iterations=5, labels="true")], out_dir=tmp_path,
                             normalization=(data.mean, data.std), blocking=True)
    truth = TrueBatch(update.inputs, update.labels, run_id=1, server_round=3, node_id=5, partition_id=0)
    (row,) = server.attack_upload(3, 5, before, model.state_dict(), dict(settings.train_config()), truth)
    assert row["status"] == "ok", row["error"]
    assert row["batch_size"] == 2 and row["local_steps"] == 2 and row["labels_from"] == "true"
    assert row["scored"] and math.isfinite(row["psnr"]) and 0.0 <= row["label_accuracy"] <= 1.0
    assert (tmp_path / row["image"]).is_file()
    assert len((tmp_path / "attacks.jsonl").read_text().splitlines()) == 1


def test_real_two_step_upload_is_recovered_by_the_bounded_unrolled_attack(tmp_path: Path) -> None:
    """An honest client's real K = 2 step upload (``task.local_sgd``'s batching: consecutive chunks of
    a random permutation), attacked as a ``fedavg-upload`` with the bounded spec: both samples come
    back (measured: 27 and 50 dB), and every sample's RMSE is listed for the per-sample promise."""
    from flwr.serverapp.strategy import FedAvg

    settings, model, before, update, data = _two_step_upload()
    bounded = UploadAttack(iterations=100).spec(AttackSpec("dlg", iterations=None, labels="true", unroll=False))
    assert bounded.iterations == 100 and bounded.unroll
    server = MaliciousServer(FedAvg(), model_fn=lambda: task.make_model(settings), input_shape=data.shape,
                             attacks=[bounded], out_dir=tmp_path, normalization=(data.mean, data.std),
                             blocking=True, save_images=False)
    truth = TrueBatch(update.inputs, update.labels, run_id=1, server_round=2, node_id=4, partition_id=0)
    (row,) = server.attack_upload(2, 4, before, model.state_dict(), dict(settings.train_config()), truth,
                                  target=UPLOAD)
    assert row["status"] == "ok", row["error"]
    assert row["attack_target"] == "fedavg-upload" and row["local_steps"] == 2 and row["batch_size"] == 2
    samples = [float(v) for v in row["rmse_input_samples"].split()]
    assert len(samples) == 2 and max(samples) < 0.2  # ≥ ~25 dB on each digit (pixel std 0.3086)
    assert row["psnr"] >= 30.0 and row["rmse_input"] == pytest.approx(sum(samples) / 2, rel=1e-4)


def test_upload_attack_settings_and_honest_targets() -> None:
    """Which honest uploads are attacked, and the run-config keys that switch it on."""
    from flwr.serverapp.strategy import FedAvg

    assert upload_attack_from_config({}) is None  # no probes: the ordinary targets are real uploads
    assert upload_attack_from_config({"victim-batch-size": 1}) == UploadAttack(clients=1, iterations=50)
    assert upload_attack_from_config({"victim-batch-size": 1, "attack-uploads": 0}) is None
    assert upload_attack_from_config({"attack-uploads": 2, "attack-upload-iterations": ""}) == UploadAttack(2, 50)
    with pytest.raises(ValueError):
        UploadAttack(iterations=0)
    spec = UploadAttack(iterations=30, hyperparameters={"tv": 0.0}).spec(AttackSpec("gs", iterations=500,
                                                                                  hyperparameters={"tv": 0.1}))
    assert spec.iterations == 30 and spec.hyperparameters == {"tv": 0.0}

    select = first_clients(1)
    assert honest_targets(select, None, 1, [3, 5]) == []
    assert honest_targets(select, UploadAttack(clients=1), 1, [5, 3, 9]) == [3]
    assert honest_targets(select, UploadAttack(clients=5), 1, [5, 3, 9]) == [3, 5, 9]
    # Next round's picks come first: with a selector preferring 9, 9 is attacked before 3.
    assert honest_targets(lambda r, nodes: [9] if r == 2 else [], UploadAttack(clients=2), 1, [5, 3, 9]) == [9, 3]
    # The wrapper drops an upload attack for 0 clients: its runner then has no bounded specs.
    server = MaliciousServer(FedAvg(), model_fn=lambda: None, input_shape=(1, 8, 8), targets=select,
                             attacks=[AttackSpec("gs"), AttackSpec("rgap")], upload_attack=UploadAttack(clients=0))
    assert server.runner.upload_attack is None and server.runner.specs(bounded=True) == []
    bounded = MaliciousServer(FedAvg(), model_fn=lambda: None, input_shape=(1, 8, 8), targets=select,
                              attacks=[AttackSpec("gs"), AttackSpec("rgap")], upload_attack=UploadAttack(iterations=7))
    (only,) = bounded.runner.specs(bounded=True)  # R-GAP cannot unroll K steps: only GS, bounded
    assert only.method == "gs" and only.iterations == 7 and only.unroll


def test_fished_replies_are_attacked_and_never_aggregated(tmp_path: Path, simulation_apps) -> None:
    """3 clients × 2 rounds, one passive target and one fished client per round: the fished client's
    one-step upload becomes a 'fishing' row (class fished, targets counted, scored against that
    class's samples), and its reply is not among what FedAvg aggregated that round."""
    make_client_app, make_server_app = simulation_apps
    out_dir, truth_dir = tmp_path / "results", tmp_path / "truth"
    overrides = {"num-server-rounds": 2, "batch-size": 8, "local-steps": 3, "lr": 0.1, "init": "uniform",
                 "attack-method": "dlg", "attack-iterations": 2, "attack-restarts": 1, "round-timeout": 600.0,
                 "attack-targets": 1, "attack-fishing": "class", "min-nodes": 3,
                 "out-dir": str(out_dir), TRUTH_DIR_KEY: str(truth_dir)}
    _simulate(make_server_app(overrides), make_client_app(overrides), 3)

    rows = [json.loads(line) for line in (out_dir / "attacks.jsonl").read_text().splitlines()]
    fished = [row for row in rows if row["attack_target"] == "fishing"]
    passive = [row for row in rows if row["attack_target"] != "fishing"]
    assert len(fished) == 2 and len(passive) == 2, [(r["round"], r["attack_target"]) for r in rows]
    summary = json.loads((out_dir / "summary.json").read_text())
    for row in fished:
        assert row["status"] == "ok", row["error"]
        assert row["local_steps"] == 1 and row["batch_size"] == 8 and 0 <= row["fished_class"] < 10
        if row["round"] == 1:  # no upload seen yet: the rotation's class
            assert row["fished_class"] == 0
        true_labels = [int(v) for v in row["true_labels"].split()] if row["true_labels"] else None
        assert row["true_targets"] is not None and row["targets"] == max(1, row["true_targets"])
        if row["true_targets"] > 0:
            assert row["scored"] and true_labels == [row["fished_class"]] * row["true_targets"]
        aggregated = summary["train_replies"][str(row["round"])]
        assert str(row["node_id"]) not in aggregated and len(aggregated) == 2
        assert str(row["node_id"]) in summary["fished_replies"][str(row["round"])]
    for round_ in (1, 2):
        assert {r["node_id"] for r in fished if r["round"] == round_}.isdisjoint(
            {r["node_id"] for r in passive if r["round"] == round_})


def test_clients_with_max_param_jump_refuse_fished_rounds_up_front(tmp_path: Path, simulation_apps) -> None:
    """3 clients × 3 rounds of a fishing server against guarded clients that check the parameters
    (``guard-max-param-jump``), in Flower's Ray simulation: every fished round is refused with
    'suspicious parameters' before training — the first one too (the fished biases are out of scale
    with the model; no history needed) — so the attacker gets no fished upload, while every honest
    round trains, guarded, with the context state of its last rounds carried between rounds."""
    make_client_app, make_server_app = simulation_apps
    out_dir = tmp_path / "results"
    overrides = {"num-server-rounds": 3, "batch-size": 8, "local-steps": 1, "lr": 0.05, "model": "cnn",
                 "init": "default", "attack-method": "dlg", "attack-iterations": 2, "attack-restarts": 1,
                 "round-timeout": 600.0, "attack-targets": 1, "attack-fishing": "class", "min-nodes": 3,
                 "guard-defense": "gaussian", "guard-max-param-jump": 100.0, "out-dir": str(out_dir)}
    _simulate(make_server_app(overrides), make_client_app(overrides), 3)

    summary = json.loads((out_dir / "summary.json").read_text())
    fished = {int(r): replies for r, replies in summary["fished_replies"].items()}
    assert sorted(fished) == [1, 2, 3] and all(len(replies) == 1 for replies in fished.values())
    for replies in fished.values():
        (reply,) = replies.values()
        assert "suspicious parameters" in reply.get("error", "") and "median tensor" in reply["error"], reply
    honest = [reply for replies in summary["train_replies"].values() for reply in replies.values()]
    assert len(honest) == 6 and all("error" not in reply and reply["guard_met"] == 1.0 for reply in honest), honest
    rows = [json.loads(line) for line in (out_dir / "attacks.jsonl").read_text().splitlines()]
    assert rows and not [row for row in rows if row["attack_target"] == "fishing"]
