"""The ServerApp: FedAvg on the shared task, wrapped by ``MaliciousServer`` when ``malicious = true``.

Results (attack rows, reconstruction grids, the run summary) go to ``out-dir``; see
docs/malicious-server.md.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from flwr.app import ArrayRecord, Context, Message, MetricRecord
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg, Strategy
from flwr.serverapp.strategy.result import Result

from flguard.flower import AttackSpec, MaliciousServer, task
from flguard.flower.truth import resolve_path


@dataclass(frozen=True)
class ServerSettings:
    """Server-side run-config keys (field ``foo_bar`` is key ``foo-bar``)."""

    num_server_rounds: int = 3
    fraction_train: float = 1.0
    fraction_evaluate: float = 1.0
    min_nodes: int = 2
    round_timeout: float = 3600.0
    malicious: bool = True
    attack_method: str = "gs"
    attack_iterations: int = 200
    attack_restarts: int = 1
    attack_labels: str = "recover"
    attack_targets: int = 0
    attack_blocking: bool = False
    out_dir: str = "malicious-server"
    sim_truth_dir: str = ""

    @classmethod
    def from_config(cls, *configs: Mapping[str, Any] | None) -> "ServerSettings":
        return task.dataclass_from_config(cls, *configs)


class LoggedFedAvg(FedAvg):
    """FedAvg that keeps every train reply's metrics (or error) per round and node.

    Why: the aggregate can hide a single reply; summary.json lists each one, so a run can be
    audited for updates that left a client without the guard's keys or with ``guard_met`` = 0.
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.train_replies: dict[int, dict[int, dict[str, Any]]] = {}

    def aggregate_train(self, server_round: int,
                        replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        replies = list(replies)
        self.train_replies[server_round] = {
            r.metadata.src_node_id: ({"error": r.error.reason} if r.has_error()
                                     else {k: v for m in r.content.metric_records.values() for k, v in m.items()})
            for r in replies}
        return super().aggregate_train(server_round, replies)


def build_strategy(settings: ServerSettings, task_settings: task.TaskSettings) -> Strategy:
    """FedAvg (logging each train reply), wrapped by the malicious server when the run config asks."""
    strategy: Strategy = LoggedFedAvg(fraction_train=settings.fraction_train, fraction_evaluate=settings.fraction_evaluate,
                                min_train_nodes=settings.min_nodes, min_evaluate_nodes=settings.min_nodes,
                                min_available_nodes=settings.min_nodes)
    if not settings.malicious:
        return strategy
    dataset = task.load_dataset(task_settings.dataset)
    spec = AttackSpec(method=settings.attack_method, iterations=settings.attack_iterations,
                      restarts=settings.attack_restarts, labels=settings.attack_labels, seed=task_settings.seed)
    return MaliciousServer(strategy, model_fn=functools.partial(task.make_model, task_settings),
                           input_shape=dataset.shape, attacks=[spec], out_dir=resolve_path(settings.out_dir),
                           targets=settings.attack_targets or None,
                           truth_dir=resolve_path(settings.sim_truth_dir) if settings.sim_truth_dir else None,
                           blocking=settings.attack_blocking, normalization=(dataset.mean, dataset.std))


def run_server(grid: Grid, context: Context, overrides: Mapping[str, Any] | None = None) -> Result:
    """Run the configured rounds; returns Flower's ``Result`` (final arrays and metrics)."""
    task_settings = task.settings_from(context, overrides)
    settings = ServerSettings.from_config(context.run_config, overrides)
    strategy = build_strategy(settings, task_settings)
    model = task.make_model(task_settings)
    result = strategy.start(grid=grid, initial_arrays=task.to_arrays(model), num_rounds=settings.num_server_rounds,
                            timeout=settings.round_timeout, train_config=task_settings.train_config())
    if isinstance(strategy, MaliciousServer):
        summary = {"rounds": settings.num_server_rounds, "attack_rows": len(strategy.results),
                   "train_metrics": {r: dict(m) for r, m in result.train_metrics_clientapp.items()},
                   "train_replies": strategy.strategy.train_replies,
                   "evaluate_metrics": {r: dict(m) for r, m in result.evaluate_metrics_clientapp.items()}}
        (strategy.out_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    return result


def make_server_app(overrides: Mapping[str, Any] | None = None,
                    on_result: Callable[[Result], None] | None = None) -> ServerApp:
    """A ServerApp whose settings are the run config updated by ``overrides``; ``on_result`` sees the Result."""
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        result = run_server(grid, context, overrides)
        if on_result is not None:
            on_result(result)

    return app


app = make_server_app()
