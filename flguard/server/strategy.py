"""A Flower strategy wrapper that plays the malicious server: it captures what clients upload.

``MaliciousServer(strategy, model_fn=..., input_shape=..., attacks=[AttackSpec("gs")])`` is itself
a Flower 1.41 Message-API ``Strategy``. It delegates every decision to the wrapped strategy
(sampling, aggregation, evaluation) and, in between, does only what a curious server can do:

1. ``configure_train`` remembers, per node, the global model θ0 and the train config it sent; a
   server may also choose its victims' local hyperparameters (``victim_config``, e.g. one local
   step on one sample): it sends the train config, so this is within its power;
2. ``aggregate_train`` sees the replies *before* the wrapped strategy aggregates them, captures
   each chosen client's upload (with, in simulation, its true batch from the file channel of
   ``flguard.server.truth``) and hands it to the ``AttackRunner``;
3. ``start`` waits for every queued attack before it returns (``flush``), so no result is lost.

The other jobs live beside it: ``flguard.server.runner`` inverts (on a background thread unless
``blocking=True``), ``flguard.server.scoring`` scores, ``flguard.server.results`` writes
``attacks.jsonl``, ``attacks.csv`` and the images under ``out_dir``.

Two kinds of attack, told apart by each row's ``attack_target``: ``probe`` — the upload a victim
sent under the server's ``victim_config`` (the easiest to invert) — and ``fedavg-upload`` — an
honest client's real multi-step upload, attacked by unrolling its K known local SGD steps
(``upload_attack``: ``UploadAttack(clients, iterations)`` bounds how many per round and how long).
Without a ``victim_config`` every attacked upload is a real one (``fedavg-upload``).

The replies passed on to the wrapped strategy are the clients' own, untouched: the wrapper never
adds records, and the true batches travel through files, never through messages.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy
from flwr.serverapp.strategy.result import Result
from torch import nn

from flguard.simulation.task import LOCAL_STEPS_KEY
from flguard.simulation.truth import TruthChannelRefused
from flguard.server.results import ResultWriter
from flguard.server.runner import AttackRunner, CapturedUpload
from flguard.server.scoring import Scorer
from flguard.server.truth import TrueBatch, TruthReader
from flguard.server.fishing import fish_class, last_linear
from flguard.server.uploads import (FISHED, PROBE, UPLOAD, AttackSpec, UpdateDecoder, UploadAttack, delta_to_gradient,
                                    state_of)
from flguard.server.victims import Fishing, TargetSelector, fishing_victims, honest_targets, selector, with_victim_config

log = logging.getLogger(__name__)


class MaliciousServer(Strategy):
    """Wrap ``strategy`` and attack the chosen clients' uploads every round (see module docstring).

    The constructor wires the runner, scorer and writer: ``attacks``, ``decoder``, ``device``,
    ``blocking`` and ``upload_attack`` configure the ``AttackRunner``; ``normalization`` the
    ``Scorer`` (and the attacks' pixel box); ``out_dir``, ``save_images`` and ``on_row`` the
    ``ResultWriter``. ``targets``, ``rounds``, ``victim_config`` and ``truth_dir`` are the
    wrapper's own: whom to attack, when, what to ask of them, where the true batches are.
    """

    def __init__(self, strategy: Strategy, *, model_fn: Callable[[], nn.Module], input_shape: Sequence[int],
                 attacks: Sequence[AttackSpec] = (AttackSpec(),), out_dir: str | Path = "attack-results",
                 targets: int | TargetSelector | None = None, rounds: Iterable[int] | None = None,
                 decoder: UpdateDecoder = delta_to_gradient,
                 normalization: tuple[Sequence[float], Sequence[float]] | None = None,
                 truth_dir: str | Path | None = None, blocking: bool = False, save_images: bool = True,
                 device: str | torch.device | None = None, victim_config: Mapping[str, Any] | None = None,
                 on_row: Callable[[dict[str, Any]], None] | None = None,
                 upload_attack: UploadAttack | None = None, fishing: Fishing | None = None) -> None:
        if not attacks:
            raise ValueError("MaliciousServer needs at least one AttackSpec")
        self.strategy = strategy
        self.select: TargetSelector = selector(targets)
        self.rounds = None if rounds is None else set(rounds)
        self.truth_dir = None if truth_dir is None else Path(truth_dir)
        self.victim_config = dict(victim_config or {})
        scorer = Scorer(normalization)
        self.writer = ResultWriter(out_dir, to_pixels=scorer.to_pixels, save_images=save_images, on_row=on_row)
        self.runner = AttackRunner(model_fn=model_fn, input_shape=input_shape, attacks=attacks, writer=self.writer,
                                   scorer=scorer, decoder=decoder, normalization=normalization, device=device,
                                   blocking=blocking,
                                   upload_attack=upload_attack if upload_attack is not None and upload_attack.clients > 0
                                   else None)
        self.fishing = fishing
        self._victims: dict[int, set[int]] = {}
        self._fished: dict[int, dict[int, int]] = {}  # round -> {node id: the class its model was fished for}
        # round -> {node id: the fished reply's metrics (e.g. the guard's), or its error}: not aggregated
        self.fished_replies: dict[int, dict[int, dict[str, Any]]] = {}
        self._bias_updates: dict[int, torch.Tensor] = {}  # node id -> its last aggregated upload's classifier-bias update
        self._bias_key: str | None = None
        self._sent: dict[int, dict[int, tuple[dict[str, torch.Tensor], dict[str, Any]]]] = {}
        self._reader: TruthReader | None = None
        self._truth_checked = False

    @property
    def attacks(self) -> tuple[AttackSpec, ...]:
        return self.runner.attacks

    @property
    def out_dir(self) -> Path:
        return self.writer.out_dir

    @property
    def results(self) -> list[dict[str, Any]]:
        """Every attack row written so far (``flush`` first to include the queued ones)."""
        return self.writer.results

    def __repr__(self) -> str:
        return f"MaliciousServer({self.strategy!r}, attacks={[a.label for a in self.attacks]})"

    # ---- Strategy interface: delegate, observing the train round ---------------------------
    def summary(self) -> None:
        """Log the attack settings, then the wrapped strategy's summary."""
        log.info("MaliciousServer: attacks %s, results in %s, truth channel %s", [a.label for a in self.attacks],
                 self.out_dir, "on (simulation)" if self.truth_dir else "off")
        self.strategy.summary()

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        """Delegate, and remember θ0 and the config sent to each node (the attacker's knowledge)."""
        if self.truth_dir is not None and not self._truth_checked:
            self._truth_checked = True
            try:
                self._reader = TruthReader(self.truth_dir, grid)
            except TruthChannelRefused as refusal:  # deployment: attack anyway, just without scores
                log.warning("true-batch channel off: %s", refusal)
        messages = list(self.strategy.configure_train(server_round, arrays, config, grid))
        nodes = [m.metadata.dst_node_id for m in messages]
        attacked = set(self.select(server_round, nodes))
        if self.victim_config:
            self._victims[server_round] = attacked
            for message in messages:
                if message.metadata.dst_node_id in attacked:
                    message.content = with_victim_config(message.content, self.victim_config)
        if self.fishing is not None and (self.rounds is None or server_round in self.rounds):
            fished = fishing_victims(self.select, self.fishing, server_round, [n for n in nodes if n not in attacked])
            self._fished[server_round] = {}
            for message in messages:
                if message.metadata.dst_node_id in fished:
                    self._fish(server_round, message, arrays)
        states: dict[int, dict[str, torch.Tensor]] = {}
        sent: dict[int, tuple[dict[str, torch.Tensor], dict[str, Any]]] = {}
        for message in messages:
            content = message.content
            record = next(iter(content.array_records.values()), arrays)
            state = states.setdefault(id(record), state_of(record))
            cfg = dict(next(iter(content.config_records.values()), config))
            sent[message.metadata.dst_node_id] = (state, cfg)
        self._sent[server_round] = sent
        return messages

    def aggregate_train(self, server_round: int,
                        replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Capture the chosen uploads for the runner, then let the wrapped strategy aggregate them as they are."""
        replies = list(replies)
        sent = self._sent.pop(server_round, {})
        fished = self._fished.pop(server_round, {})
        if self.rounds is None or server_round in self.rounds:
            usable = {r.metadata.src_node_id: r for r in replies
                      if not r.has_error() and len(r.content.array_records) == 1 and r.metadata.src_node_id in sent}
            self.fished_replies[server_round] = {r.metadata.src_node_id: _metrics_of(r) for r in replies
                                                 if r.metadata.src_node_id in fished}
            if self.fishing is not None:
                self._remember_bias_updates(usable, sent, fished)
            for node_id, target in sorted(fished.items()):
                if node_id in usable:
                    self.runner.submit(self._capture(server_round, usable.pop(node_id), *sent[node_id], target=FISHED,
                                                     fished_class=target))
            victims = self._victims.pop(server_round, None)
            chosen = self.select(server_round, list(usable)) if victims is None else sorted(victims & set(usable))
            for node_id in chosen:
                self.runner.submit(self._capture(server_round, usable[node_id], *sent[node_id],
                                                 target=PROBE if victims else UPLOAD))
            others = [n for n in usable if n not in set(chosen)]
            for node_id in honest_targets(self.select, self.runner.upload_attack, server_round, others):
                self.runner.submit(self._capture(server_round, usable[node_id], *sent[node_id], target=UPLOAD),
                                   bounded=True)
        # a fished model's update is the server's own sabotage: the global model never learns from it
        return self.strategy.aggregate_train(server_round, [r for r in replies if r.metadata.src_node_id not in fished])

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                           grid: Grid) -> Iterable[Message]:
        return self.strategy.configure_evaluate(server_round, arrays, config, grid)

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        return self.strategy.aggregate_evaluate(server_round, replies)

    def start(self, grid: Grid, initial_arrays: ArrayRecord, num_rounds: int = 3, timeout: float = 3600,
              train_config: ConfigRecord | None = None, evaluate_config: ConfigRecord | None = None,
              evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None = None) -> Result:
        """Run the wrapped strategy's rounds; every queued attack has finished when this returns."""
        try:
            return super().start(grid, initial_arrays, num_rounds, timeout, train_config, evaluate_config,
                                 evaluate_fn)
        finally:
            self.close()

    # ---- attacks -------------------------------------------------------------------------
    def flush(self) -> list[dict[str, Any]]:
        """Wait for every queued attack; returns all result rows so far."""
        return self.runner.flush()

    def close(self) -> None:
        """Flush and stop the background worker (a later round starts a new one)."""
        self.runner.close()

    def attack_upload(self, server_round: int, node_id: int, before: Mapping[str, torch.Tensor],
                      after: Mapping[str, torch.Tensor], config: Mapping[str, Any],
                      truth: TrueBatch | None = None, target: str = PROBE) -> list[dict[str, Any]]:
        """Run every attack on one upload now (θ0 ``before``, θK ``after``); returns the new rows.

        What each round does in the background, callable directly to replay a saved upload.
        """
        upload = CapturedUpload(server_round, node_id, dict(before), dict(after), dict(config), truth, target)
        return [self.runner.run(upload, spec) for spec in self.attacks]

    def _capture(self, server_round: int, reply: Message, before: dict[str, torch.Tensor],
                 config: dict[str, Any], *, target: str, fished_class: int | None = None) -> CapturedUpload:
        """The upload in ``reply`` with what the server knows about it (and, in simulation, its truth)."""
        node_id = reply.metadata.src_node_id
        after = state_of(next(iter(reply.content.array_records.values())))
        truth = self._reader.read(reply.metadata.run_id, server_round, node_id) if self._reader else None
        return CapturedUpload(server_round, node_id, before, after, config, truth, target, fished_class)

    def _remember_bias_updates(self, usable: Mapping[int, Message], sent: Mapping[int, tuple[dict[str, torch.Tensor],
                                                                                           dict[str, Any]]],
                               fished: Mapping[int, int]) -> None:
        """Keep each aggregated reply's classifier-bias update θK − θ0 (what ``Fishing`` infers a
        victim's classes from); a fished reply says nothing about the client's own classes."""
        if self._bias_key is None:  # the classifier's bias in a state dict: one model built, once
            self._bias_key = f"{last_linear(self.runner.model_fn())[0]}.bias"
        key = self._bias_key
        for node_id, reply in usable.items():
            record = next(iter(reply.content.array_records.values()))
            if node_id in fished or key not in sent[node_id][0] or key not in record:
                continue
            after = torch.from_numpy(record[key].numpy()).double()  # the bias alone, not the whole state
            self._bias_updates[node_id] = after - sent[node_id][0][key].double().cpu()

    def _fish(self, server_round: int, message: Message, arrays: ArrayRecord) -> None:
        """Send ``message``'s node the model fished for this round's class, and one local step."""
        assert self.fishing is not None
        record = next(iter(message.content.array_records.values()), arrays)
        model = self.runner.model_fn()
        model.load_state_dict(state_of(record), strict=True)
        target = self.fishing.target_class(server_round, last_linear(model)[1].out_features,
                                           self._bias_updates.get(message.metadata.dst_node_id))
        fished = fish_class(model, target, class_multiplier=self.fishing.class_multiplier,
                            bias_multiplier=self.fishing.bias_multiplier)
        message.content = with_victim_config(message.content, {LOCAL_STEPS_KEY: 1},
                                             arrays=ArrayRecord(fished.state_dict()))
        self._fished[server_round][message.metadata.dst_node_id] = target

    def __getattr__(self, name: str) -> Any:
        # Attributes the wrapped strategy exposes (e.g. ``weighted_by_key``) stay reachable.
        if name in ("strategy", "runner", "writer"):
            raise AttributeError(name)
        return getattr(self.strategy, name)


def _metrics_of(reply: Message) -> dict[str, Any]:
    """A reply's metrics (its first MetricRecord), or its error."""
    if reply.has_error():
        return {"error": reply.error.reason}
    record = next(iter(reply.content.metric_records.values()), None)
    return dict(record) if record is not None else {}
