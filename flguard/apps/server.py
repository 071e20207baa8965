"""The ServerApp of flguard's runs: FedAvg that logs every reply, wrapped by the malicious server.

``LoggedFedAvg`` keeps each reply's metrics; with ``malicious = true`` it is wrapped by
``flguard.server.MaliciousServer`` (attacks, fishing, scoring against the simulation's true
batches). With an ``out-dir`` it writes ``summary.json`` (per-reply metrics, attack rows, the run
config) at the end: a run directory with ``summary.json`` is a finished run. Settings come from the
same run config as the ClientApp's (``ServerSettings``; unknown keys are the task's or the guard's).
"""

from __future__ import annotations

import functools
import json
import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
from flwr.app import ArrayRecord, Context, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg, Strategy
from flwr.serverapp.strategy.result import Result

from flguard.attacks.api import hyperparameters_of
from flguard.flower.guard_mod import prefixed_config
from flguard.server import AttackSpec, Fishing, MaliciousServer, TargetSelector, upload_attack_from_config
from flguard.simulation import task
from flguard.simulation.truth import resolve_path

log = logging.getLogger(__name__)

#: Run-config keys ``attack-hp-<name>`` become attack hyperparameters (e.g. ``attack-hp-tv = 0.01``).
ATTACK_HP_PREFIX = "attack-hp-"
SUMMARY_FILE = "summary.json"

# (event, payload): "round" with {"round", "metrics"}, "attack" with an attack row.
EventHook = Callable[[str, Mapping[str, Any]], None]


@dataclass(frozen=True)
class ServerSettings:
    """Server-side run-config keys (field ``foo_bar`` is key ``foo-bar``)."""

    num_server_rounds: int = 3
    fraction_train: float = 1.0
    fraction_evaluate: float = 1.0
    min_nodes: int = 2
    round_timeout: float = 3600.0
    malicious: bool = True
    attack_method: str = "gs"  # several: "gs,dlg" (each upload attacked by each; reports keep the best)
    attack_iterations: str = "200"  # one value for all, or one per method: "1000,50"
    attack_restarts: int = 1
    attack_labels: str = "recover"
    attack_targets: int = 0  # 0: every client that replied; k: k clients per round
    attack_rotate: bool = False  # k clients per round, taken in turn by partition id (same client in every run)
    attack_device: str = "auto"
    attack_blocking: bool = False
    victim_batch_size: int = 0  # >0: the server asks its targets for this batch size (it sends the train config)
    victim_local_steps: int = 0  # >0: ... and this many local steps
    attack_fishing: str = "none"  # "class": fish clients beside the probes (flguard.server.fishing)
    attack_fishing_clients: int = 1  # ... this many per round (one local step at their batch size)
    out_dir: str = "malicious-server"
    sim_truth_dir: str = ""

    @classmethod
    def from_config(cls, *configs: Mapping[str, Any] | None) -> "ServerSettings":
        return task.dataclass_from_config(cls, *configs)


def merged_config(context: Context, overrides: Mapping[str, Any] | None) -> dict[str, Any]:
    """The run config updated by ``overrides`` (in-process simulations have no run config)."""
    return {**dict(context.run_config), **dict(overrides or {})}


def _reply_metrics(reply: Message) -> dict[str, Any]:
    if reply.has_error():
        return {"error": reply.error.reason}
    return {k: v for record in reply.content.metric_records.values() for k, v in record.items()}


class LoggedFedAvg(FedAvg):
    """FedAvg that keeps every train and evaluate reply's metrics (or error) per round and node.

    Why: the aggregate can hide a single reply; summary.json lists each one, so a run can be
    audited for updates that left a client without the guard's keys or with ``guard_met`` = 0,
    and a comparison can report every client of every round.
    """

    def __init__(self, on_event: EventHook | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.on_event = on_event
        self.train_replies: dict[int, dict[int, dict[str, Any]]] = {}
        self.evaluate_replies: dict[int, dict[int, dict[str, Any]]] = {}

    def aggregate_train(self, server_round: int,
                        replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        replies = list(replies)
        self.train_replies[server_round] = {r.metadata.src_node_id: _reply_metrics(r) for r in replies}
        return super().aggregate_train(server_round, replies)

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        replies = list(replies)
        self.evaluate_replies[server_round] = {r.metadata.src_node_id: _reply_metrics(r) for r in replies}
        metrics = super().aggregate_evaluate(server_round, replies)
        if self.on_event is not None:
            self.on_event("round", {"round": server_round, "metrics": dict(metrics or {})})
        return metrics


def discover_partitions(grid: Grid, expected: int, timeout: float = 120.0) -> dict[int, int]:
    """Ask every node for its partition id (a query message): ``{node_id: partition_id}``.

    Simulation bookkeeping for comparisons: it lets the server attack the same client (partition)
    in every defense's run, although node ids are drawn anew per run.
    """
    deadline = time.monotonic() + timeout
    node_ids = list(grid.get_node_ids())
    while len(node_ids) < expected and time.monotonic() < deadline:
        time.sleep(0.2)
        node_ids = list(grid.get_node_ids())
    queries = [Message(RecordDict(), dst_node_id=node_id, message_type=MessageType.QUERY) for node_id in node_ids]
    mapping = {}
    for reply in grid.send_and_receive(queries, timeout=timeout):
        if not reply.has_error():
            metrics = _reply_metrics(reply)
            mapping[reply.metadata.src_node_id] = int(metrics["partition-id"])
    return mapping


def rotating_targets(partitions: Mapping[int, int], count: int) -> TargetSelector:
    """Round r attacks the ``count`` clients whose partition ids follow (r − 1)·count, cyclically."""
    by_partition = {p: node for node, p in partitions.items()}
    ordered = sorted(by_partition)

    def select(server_round: int, node_ids: Sequence[int]) -> list[int]:
        if not ordered:
            return []
        start = (server_round - 1) * count
        wanted = [by_partition[ordered[(start + k) % len(ordered)]] for k in range(min(count, len(ordered)))]
        return [node for node in wanted if node in set(node_ids)]

    return select


def attack_hyperparameters(config: Mapping[str, Any]) -> dict[str, Any]:
    """``attack-hp-<name>`` keys as ``{name: value}`` (dashes become underscores)."""
    return prefixed_config(config, ATTACK_HP_PREFIX)


def attack_specs(settings: ServerSettings, hyperparameters: Mapping[str, Any], seed: int) -> list[AttackSpec]:
    """One AttackSpec per method of ``attack-method`` ("gs" or "gs,dlg"); ``attack-iterations`` gives one
    count for all or one per method; each method gets the hyperparameters it accepts."""
    methods = [m.strip() for m in str(settings.attack_method).split(",") if m.strip()]
    counts = [int(c) for c in str(settings.attack_iterations).split(",") if c.strip()]
    if len(counts) == 1:
        counts *= len(methods)
    if not methods or len(counts) != len(methods):
        raise ValueError(f"attack-iterations={settings.attack_iterations!r} must give one count, or one per "
                         f"method of attack-method={settings.attack_method!r}")
    return [AttackSpec(method=method, iterations=count, restarts=settings.attack_restarts,
                       labels=settings.attack_labels, seed=seed,
                       hyperparameters={k: v for k, v in hyperparameters.items() if k in hyperparameters_of(method)})
            for method, count in zip(methods, counts)]


def _victim_config(settings: ServerSettings) -> dict[str, Any]:
    victim: dict[str, Any] = {}
    if settings.victim_batch_size > 0:
        victim[task.BATCH_SIZE_KEY] = settings.victim_batch_size
    if settings.victim_local_steps > 0:
        victim[task.LOCAL_STEPS_KEY] = settings.victim_local_steps
    return victim


def build_strategy(settings: ServerSettings, task_settings: task.TaskSettings, *, config: Mapping[str, Any] | None = None,
                   targets: int | TargetSelector | None = None, on_event: EventHook | None = None) -> Strategy:
    """FedAvg (logging each reply), wrapped by the malicious server when the run config asks."""
    strategy: Strategy = LoggedFedAvg(on_event=on_event, fraction_train=settings.fraction_train,
                                      fraction_evaluate=settings.fraction_evaluate,
                                      min_train_nodes=settings.min_nodes, min_evaluate_nodes=settings.min_nodes,
                                      min_available_nodes=settings.min_nodes)
    if not settings.malicious:
        return strategy
    dataset = task.load_dataset(task_settings.dataset)
    specs = attack_specs(settings, attack_hyperparameters(config or {}), seed=task_settings.seed)
    device = settings.attack_device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else None
    return MaliciousServer(strategy, model_fn=functools.partial(task.make_model, task_settings),
                           input_shape=dataset.shape, attacks=specs, out_dir=resolve_path(settings.out_dir),
                           targets=targets if targets is not None else (settings.attack_targets or None),
                           truth_dir=resolve_path(settings.sim_truth_dir) if settings.sim_truth_dir else None,
                           blocking=settings.attack_blocking, normalization=(dataset.mean, dataset.std),
                           victim_config=_victim_config(settings), device=device,
                           upload_attack=upload_attack_from_config(config or {}),
                           fishing=None if settings.attack_fishing in ("", "none") else
                           Fishing(kind=settings.attack_fishing, clients=settings.attack_fishing_clients),
                           on_row=(lambda row: on_event("attack", row)) if on_event else None)


def run_server(grid: Grid, context: Context, overrides: Mapping[str, Any] | None = None,
               on_event: EventHook | None = None) -> Result:
    """Run the configured rounds; returns Flower's ``Result`` (final arrays and metrics)."""
    config = merged_config(context, overrides)
    task_settings = task.TaskSettings.from_config(config)
    settings = ServerSettings.from_config(config)
    started = time.perf_counter()
    partitions: dict[int, int] = {}
    targets: int | TargetSelector | None = None
    if settings.malicious and settings.attack_rotate:
        partitions = discover_partitions(grid, settings.min_nodes, timeout=settings.round_timeout)
        targets = rotating_targets(partitions, max(1, settings.attack_targets))
    strategy = build_strategy(settings, task_settings, config=config, targets=targets, on_event=on_event)
    model = task.initial_model(task_settings)
    result = strategy.start(grid=grid, initial_arrays=task.to_arrays(model), num_rounds=settings.num_server_rounds,
                            timeout=settings.round_timeout, train_config=task_settings.train_config())
    if isinstance(strategy, MaliciousServer):
        logged = strategy.strategy
        summary = {"rounds": settings.num_server_rounds, "attack_rows": len(strategy.results),
                   "seconds": time.perf_counter() - started, "run_config": config,
                   "task": asdict(task_settings), "partitions": partitions,
                   "train_metrics": {r: dict(m) for r, m in result.train_metrics_clientapp.items()},
                   "train_replies": logged.train_replies, "evaluate_replies": logged.evaluate_replies,
                   "fished_replies": strategy.fished_replies,
                   "evaluate_metrics": {r: dict(m) for r, m in result.evaluate_metrics_clientapp.items()}}
        strategy.out_dir.mkdir(parents=True, exist_ok=True)
        (strategy.out_dir / SUMMARY_FILE).write_text(json.dumps(summary, indent=2, default=str))
    return result


def make_server_app(overrides: Mapping[str, Any] | None = None, on_result: Callable[[Result], None] | None = None,
                    on_event: EventHook | None = None) -> ServerApp:
    """A ServerApp whose settings are the run config updated by ``overrides``; ``on_result`` sees the
    Result, ``on_event`` each finished round and attack (progress displays)."""
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        result = run_server(grid, context, overrides, on_event)
        if on_result is not None:
            on_result(result)

    return app
