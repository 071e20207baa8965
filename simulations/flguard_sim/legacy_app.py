"""The same task for legacy users: a ``NumPyClient`` and a workflow ServerApp with SecAgg+.

Why it exists: many Flower apps still use ``client_fn`` + ``NumPyClient`` and the legacy
``DefaultWorkflow``, which is also where Flower 1.41's SecAgg+ lives (``secaggplus_mod`` on the
client, ``SecAggPlusWorkflow`` on the server). ``TaskClient.fit`` trains with
``flguard.simulation.task.local_sgd``, which calls ``guard_step`` on every local step, so the guard works
either as an app-wide ``guard_mod`` (in either order with ``secaggplus_mod``) or by wrapping the
client in ``GuardedNumPyClient``. The tests run both through Flower's Ray simulation.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from flwr.app import Context
from flwr.client import NumPyClient
from flwr.clientapp import ClientApp
from flwr.clientapp.typing import Mod
from flwr.common import Metrics, ndarrays_to_parameters
from flwr.server import LegacyContext, ServerConfig
from flwr.server.strategy import FedAvg
from flwr.server.workflow import DefaultWorkflow, SecAggPlusWorkflow
from flwr.serverapp import Grid, ServerApp

from flguard import GuardConfig
from flguard.flower import GuardedNumPyClient
from flguard.simulation import task


def _ndarrays(model: torch.nn.Module) -> list[np.ndarray]:
    return [value.detach().cpu().numpy() for value in model.state_dict().values()]


class TaskClient(NumPyClient):
    """The shared task as a NumPyClient: ``fit`` = local SGD (guarded per step under a guard)."""

    def __init__(self, settings: task.TaskSettings, partition_id: int, num_partitions: int) -> None:
        self.settings = settings
        self.partition_id = partition_id
        self.train_data, self.test_data = task.load_partition(settings, partition_id, num_partitions)

    def _model(self, parameters: Sequence[np.ndarray]) -> torch.nn.Module:
        model = task.make_model(self.settings)
        model.load_state_dict({k: torch.as_tensor(v) for k, v in zip(model.state_dict(), parameters)}, strict=True)
        return model

    def fit(self, parameters, config: dict[str, Any]):
        settings = self.settings.with_train_config(config)
        model = self._model(parameters)
        generator = task.batch_generator(settings, int(config.get(task.ROUND_KEY, 0)), self.partition_id)
        update = task.local_sgd(model, self.train_data, lr=settings.lr, steps=settings.local_steps,
                                batch_size=settings.batch_size, generator=generator)
        return _ndarrays(model), int(update.labels.numel()), {"train-loss": float(update.loss)}

    def evaluate(self, parameters, config: dict[str, Any]):
        loss, accuracy = task.evaluate_model(self._model(parameters), self.test_data)
        return float(loss), len(self.test_data), {"eval-acc": float(accuracy)}


def make_legacy_client_app(overrides: Mapping[str, Any] | None = None, mods: Sequence[Mod] = (),
                           wrap: GuardConfig | None = None) -> ClientApp:
    """A ``client_fn`` ClientApp of ``TaskClient``; ``wrap`` wraps it in ``GuardedNumPyClient``."""
    overrides = dict(overrides or {})

    def client_fn(context: Context):
        settings = task.settings_from(context, overrides)
        partition_id, count = task.node_partition(context.node_config, settings)
        client: NumPyClient = TaskClient(settings, partition_id, count)
        if wrap is not None:
            client = GuardedNumPyClient(client, wrap)
        return client.to_client()

    return ClientApp(client_fn=client_fn, mods=list(mods))


def make_secagg_server_app(overrides: Mapping[str, Any] | None = None,
                           on_fit_metrics: Callable[[int, list[Metrics]], None] | None = None,
                           secagg: bool = True, num_nodes: int = 3) -> ServerApp:
    """Legacy FedAvg on ``num_nodes`` clients through ``DefaultWorkflow``, SecAgg+ for the fit stage
    when ``secagg`` (Flower's SecAgg+ needs at least 3 clients: one key share per neighbour, > 2).

    ``on_fit_metrics(round, per_client_metrics)`` sees every client's fit metrics (the guard's keys
    included) through FedAvg's own ``fit_metrics_aggregation_fn``.
    """
    overrides = dict(overrides or {})

    def main(grid: Grid, context: Context) -> None:
        settings = task.settings_from(context, overrides)
        rounds = int({**context.run_config, **overrides}.get("num-server-rounds", 1))
        current = {"round": 0}

        def fit_config(server_round: int) -> dict[str, Any]:
            current["round"] = server_round
            return {**dict(settings.train_config()), task.ROUND_KEY: server_round}

        def fit_metrics(results: list[tuple[int, Metrics]]) -> Metrics:
            if on_fit_metrics is not None:
                on_fit_metrics(current["round"], [dict(metrics) for _, metrics in results])
            return {}

        strategy = FedAvg(min_fit_clients=num_nodes, min_evaluate_clients=num_nodes, min_available_clients=num_nodes,
                          on_fit_config_fn=fit_config, fit_metrics_aggregation_fn=fit_metrics,
                          evaluate_metrics_aggregation_fn=lambda results: {},
                          initial_parameters=ndarrays_to_parameters(_ndarrays(task.make_model(settings))))
        legacy = LegacyContext(context, config=ServerConfig(num_rounds=rounds), strategy=strategy)
        fit_workflow = SecAggPlusWorkflow(num_shares=num_nodes, reconstruction_threshold=2) if secagg else None
        DefaultWorkflow(fit_workflow=fit_workflow)(grid, legacy)

    app = ServerApp()
    app.main()(main)
    return app
