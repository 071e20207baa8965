"""The quickstart-shaped app (simulations/quickstart): guarded in ≤ 4 lines, run under Flower's Ray engine.

- guard.diff is the whole change from the plain app: at most 4 added or changed lines, and it is
  the diff docs/guard.md shows.
- Under ``run_simulation`` (Ray backend, 2 SuperNodes, 2 rounds) every train reply carries the guard's
  metrics with guard_met = 1.
- In process, the upload of one client round (several SGD-with-momentum steps) is exactly the
  momentum-SGD trajectory of (unguarded gradient + the guard's noise) at every step: the guard's
  noise is the only thing between the plain loop and what is sent.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterable
from pathlib import Path

import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MessageType, RecordDict
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

from conftest import importable_app
from flguard.guard import Guard
from flguard.guard.report import METRIC_KEYS
from flguard.risk.operator import JacobianOperator

ROOT = Path(__file__).resolve().parents[1]
APP = ROOT / "simulations" / "quickstart"
CONFIG = {"dataset": "lfw-faces", "batch-size": 16, "local-epochs": 1, "lr": 0.01}  # 5 steps a round
BACKEND = {"client_resources": {"num_cpus": 1, "num_gpus": 0.0}, "init_args": {"num_cpus": 2}}


@pytest.fixture
def quickstart(monkeypatch: pytest.MonkeyPatch):
    """The app's modules, importable here and by the Ray workers."""
    with importable_app(monkeypatch, APP, "quickstart_app"):
        import quickstart_app.client_app as client_app
        import quickstart_app.task as task

        yield client_app, task


def test_guarding_the_quickstart_is_four_lines_and_the_docs_show_that_diff(tmp_path):
    diff = (APP / "guard.diff").read_text()
    added = [line for line in diff.splitlines() if line.startswith("+") and not line.startswith("+++")]
    removed = [line for line in diff.splitlines() if line.startswith("-") and not line.startswith("---")]
    assert 1 <= len(added) <= 4 and len(removed) <= len(added)
    plain = tmp_path / "plain"
    shutil.copytree(APP, plain)
    subprocess.run(["git", "apply", "-R", "--unsafe-paths", "--directory", ".", str(APP / "guard.diff")],
                   cwd=plain, check=True)
    for name in ("client_app.py", "task.py"):
        source = (plain / "quickstart_app" / name).read_text()
        assert "make_guarded" not in source and "guard_mod" not in source  # the plain app is really plain
        compile(source, name, "exec")
    assert diff.strip() in (ROOT / "docs" / "guard.md").read_text()


class RecordingFedAvg(FedAvg):
    """FedAvg that keeps every train reply's metrics."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.replies: dict[int, list[dict]] = {}

    def aggregate_train(self, server_round: int, replies: Iterable[Message]):
        replies = list(replies)
        self.replies[server_round] = [dict(r.content.metric_records["metrics"]) if r.has_content()
                                      else {"error": r.error.reason} for r in replies]
        return super().aggregate_train(server_round, replies)


def test_quickstart_app_is_guarded_every_round_under_the_ray_engine(quickstart, one_thread):
    from flwr.simulation import run_simulation

    client_app, task = quickstart
    strategy = RecordingFedAvg(min_train_nodes=2, min_evaluate_nodes=2, min_available_nodes=2)
    results: list = []
    server = ServerApp()

    @server.main()
    def main(grid: Grid, context: Context) -> None:
        results.append(strategy.start(grid=grid, initial_arrays=ArrayRecord(task.Net("lfw-faces").state_dict()),
                                      train_config=ConfigRecord(CONFIG), evaluate_config=ConfigRecord(CONFIG),
                                      num_rounds=2, timeout=600.0))

    run_simulation(server_app=server, client_app=client_app.app, num_supernodes=2, backend_config=BACKEND)
    (result,) = results
    assert sorted(strategy.replies) == [1, 2]
    for replies in strategy.replies.values():
        assert len(replies) == 2
        for metrics in replies:
            assert set(METRIC_KEYS) <= set(metrics), metrics
            assert metrics["guard_met"] == 1.0 and metrics["guard_min_rmse_after"] >= 0.1
            assert metrics["guard_noise_norm"] > 0 and metrics["num-examples"] == 80
    assert set(result.evaluate_metrics_clientapp) == {1, 2}


def test_quickstart_upload_is_the_clipped_loop_plus_exactly_the_guards_noise(quickstart, monkeypatch, one_thread):
    from flwr.supercore.task_identity import TaskIdentity

    client_app, task = quickstart
    monkeypatch.setattr(TaskIdentity, "_task_id", 1)
    monkeypatch.setattr(TaskIdentity, "_run_id", 1)
    monkeypatch.setattr(TaskIdentity, "_node_id", 0)
    steps: list[tuple[torch.Tensor, torch.Tensor, float]] = []
    protect = Guard.protect

    def spy(self, model, x, y, gradient, loss_fn=None, step_size=None, step_rule=None, draws=None,
            check_gradient=None):
        assert step_rule is None and not draws  # the app's SGD: its step size, not a measured step; no dropout
        per_sample = JacobianOperator(model, x, y).per_sample_gradients()  # before the guard, independently
        out = protect(self, model, x, y, gradient, loss_fn=loss_fn, step_size=step_size, step_rule=step_rule,
                      draws=draws, check_gradient=check_gradient)
        # the default clips each sample's gradient at C (the median norm) and may leave samples out
        # (rmse_after = inf): the upload before noise is the mean of the kept samples' clipped gradients
        clip, kept = out.report.details["clip"], torch.isfinite(out.report.rmse_after)
        assert clip == pytest.approx(float(per_sample.norm(dim=1).median()), rel=1e-6)
        factor = torch.clamp(clip / per_sample.norm(dim=1), max=1.0).unsqueeze(1)
        sent = (per_sample * factor)[kept].sum(0) / len(x)
        steps.append((sent, out.gradient.clone(), out.report.noise_norm))
        return out

    monkeypatch.setattr(Guard, "protect", spy)
    model = task.Net("lfw-faces")
    theta0 = {k: v.clone() for k, v in model.state_dict().items()}
    message = Message(RecordDict({"arrays": ArrayRecord(model.state_dict()), "config": ConfigRecord(CONFIG)}),
                      dst_node_id=5, message_type=MessageType.TRAIN)
    context = Context(run_id=1, node_id=5, node_config={"partition-id": 1, "num-partitions": 2}, state=RecordDict(),
                      run_config={})
    reply = client_app.app(message, context)
    assert not reply.has_error(), reply.error
    assert reply.content.metric_records["metrics"]["guard_met"] == 1.0
    assert len(steps) == 5  # 80 training samples, batches of 16: every step went through the guard
    for clipped, guarded, noise_norm in steps:
        assert float((guarded - clipped).norm()) == pytest.approx(noise_norm, rel=1e-4)
    # Replay SGD(momentum=0.9) from θ0 on the guarded gradients: it must give the upload exactly.
    replay = task.Net("lfw-faces")
    replay.load_state_dict(theta0)
    optimizer = torch.optim.SGD(replay.parameters(), lr=CONFIG["lr"], momentum=0.9)
    params = list(replay.parameters())
    for _, guarded, _ in steps:
        for p, g in zip(params, guarded.split([p.numel() for p in params])):
            p.grad = g.view_as(p).clone()
        optimizer.step()
    upload = reply.content["arrays"].to_torch_state_dict()
    for name, value in replay.state_dict().items():
        torch.testing.assert_close(upload[name], value, rtol=0, atol=0)
