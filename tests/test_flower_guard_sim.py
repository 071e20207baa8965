"""The guard in real Flower simulations (Ray backend, 2 SuperNodes, in-process ``run_simulation``).

- Message API: FedAvg with the guard attached app-wide. A FedAvg subclass records what the server
  sent and every train reply it received; the test recomputes each client's *unguarded* FedSGD
  upload from the same weights and batch and checks that the received upload differs from it by
  exactly lr × the reported noise norm, with the guard's keys in every reply of every round.
- Legacy: ``NumPyClient`` through ``client_fn`` with Flower's SecAgg+ (``secaggplus_mod`` +
  ``SecAggPlusWorkflow``, 3 SuperNodes: Flower's minimum), the guard before or after it in the mod
  chain, and the ``GuardedNumPyClient`` wrapper.
"""

from __future__ import annotations

from collections.abc import Iterable

import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

from flguard import GuardConfig
from flguard.flower import guard_mod
from flguard.simulation import task
from flguard.guard.report import METRIC_KEYS
from guard_settings import unclipped

OVERRIDES = {"num-server-rounds": 2, "batch-size": 2, "local-steps": 1, "lr": 0.1, "init": "uniform",
             "malicious": False, "round-timeout": 600.0}
SETTINGS = task.TaskSettings.from_config(OVERRIDES)
BACKEND = {"client_resources": {"num_cpus": 1, "num_gpus": 0.0}, "init_args": {"num_cpus": 2}}
GUARD = unclipped(defense="gaussian", min_rmse=0.05)  # the upload is the plain gradient + noise


class RecordingFedAvg(FedAvg):
    """FedAvg that keeps the global weights it sends and the train replies it receives."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.sent: dict[int, dict[str, torch.Tensor]] = {}
        self.received: dict[int, list[tuple[dict, dict[str, torch.Tensor]]]] = {}

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        self.sent[server_round] = {k: v.clone() for k, v in arrays.to_torch_state_dict().items()}
        return super().configure_train(server_round, arrays, config, grid)

    def aggregate_train(self, server_round: int, replies: Iterable[Message]):
        replies = list(replies)
        self.received[server_round] = [
            (dict(r.content.metric_records[task.METRICS_KEY]), r.content.array_records[task.ARRAYS_KEY].to_torch_state_dict())
            for r in replies if r.has_content()]
        return super().aggregate_train(server_round, replies)


def _server_app(strategy: RecordingFedAvg, results: list) -> ServerApp:
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context) -> None:
        results.append(strategy.start(grid=grid, initial_arrays=task.to_arrays(task.make_model(SETTINGS)),
                                      num_rounds=2, timeout=600.0, train_config=SETTINGS.train_config()))

    return app


def _unguarded_upload(weights: dict[str, torch.Tensor], server_round: int, partition_id: int) -> torch.Tensor:
    """θ0 − lr·∇L on the batch the client draws this round, computed here, outside Flower."""
    train, _ = task.load_partition(SETTINGS, partition_id, 2)
    model = task.make_model(SETTINGS)
    model.load_state_dict(weights)
    order = torch.randperm(len(train), generator=task.batch_generator(SETTINGS, server_round, partition_id))
    index = order[:SETTINGS.batch_size]
    loss = torch.nn.functional.cross_entropy(model(train.normalize(train.images[index])), train.labels[index])
    grads = dict(zip([n for n, _ in model.named_parameters()], torch.autograd.grad(loss, list(model.parameters()))))
    return torch.cat([(value - SETTINGS.lr * grads[name]).reshape(-1).double() if name in grads
                      else value.reshape(-1).double() for name, value in weights.items()])


def test_guarded_fedsgd_uploads_are_the_unguarded_ones_plus_the_reported_noise(simulation_apps, one_thread) -> None:
    from flwr.simulation import run_simulation

    make_client_app, _ = simulation_apps
    strategy = RecordingFedAvg(min_train_nodes=2, min_evaluate_nodes=2, min_available_nodes=2)
    results: list = []
    run_simulation(server_app=_server_app(strategy, results),
                   client_app=make_client_app(OVERRIDES, mods=[guard_mod(GUARD)]),
                   num_supernodes=2, backend_config=BACKEND)
    (result,) = results
    assert sorted(strategy.received) == [1, 2]
    for server_round, replies in strategy.received.items():
        assert len(replies) == 2
        matched = set()
        for metrics, arrays in replies:
            assert set(METRIC_KEYS) <= set(metrics) and metrics["guard_met"] == 1.0
            assert metrics["guard_min_rmse_after"] >= GUARD.min_rmse
            upload = torch.cat([v.reshape(-1).double() for v in arrays.values()])
            expected = SETTINGS.lr * metrics["guard_noise_norm"]
            assert expected > 0
            # Which partition sent it is not in the reply: exactly one candidate must fit.
            fits = [pid for pid in (0, 1) if abs(float((upload - _unguarded_upload(strategy.sent[server_round],
                                                                                   server_round, pid)).norm())
                                                 - expected) <= 1e-3 * expected]
            assert len(fits) == 1, (server_round, metrics)
            matched.add(fits[0])
        assert matched == {0, 1}
    assert set(result.evaluate_metrics_clientapp) == {1, 2}  # evaluate replies untouched by the mod


@pytest.mark.parametrize("order", ["guard-outside-secagg", "secagg-outside-guard", "numpy-client-wrapper"])
def test_guard_chains_with_secaggplus_for_numpy_clients(order: str, simulation_apps, one_thread) -> None:
    from flwr.client.mod import secaggplus_mod
    from flwr.simulation import run_simulation
    from flguard_sim.legacy_app import make_legacy_client_app, make_secagg_server_app

    overrides = {**OVERRIDES, "num-server-rounds": 1}
    mods, wrap = {"guard-outside-secagg": ([guard_mod(GUARD), secaggplus_mod], None),
                  "secagg-outside-guard": ([secaggplus_mod, guard_mod(GUARD)], None),
                  "numpy-client-wrapper": ([secaggplus_mod], GUARD)}[order]
    seen: list[tuple[int, list[dict]]] = []
    run_simulation(server_app=make_secagg_server_app(overrides, on_fit_metrics=lambda r, m: seen.append((r, m))),
                   client_app=make_legacy_client_app(overrides, mods=mods, wrap=wrap),
                   num_supernodes=3, backend_config=BACKEND)
    assert [r for r, _ in seen] == [1]
    (_, per_client), = seen
    assert len(per_client) == 3
    for metrics in per_client:
        assert set(METRIC_KEYS) <= set(metrics) and metrics["guard_met"] == 1.0
        assert metrics["guard_min_rmse_after"] >= GUARD.min_rmse
