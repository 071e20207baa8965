"""A Flower strategy wrapper that plays the malicious server: it inverts what clients upload.

``MaliciousServer(strategy, model_fn=..., input_shape=..., attacks=[AttackSpec("gs")])`` is itself
a Flower 1.41 Message-API ``Strategy``. It delegates every decision to the wrapped strategy
(sampling, aggregation, evaluation) and, in between, does what a curious server could do:

1. ``configure_train`` remembers, per node, the global model θ0 and the train config it sent;
2. ``aggregate_train`` sees the replies *before* the wrapped strategy aggregates them, turns each
   chosen client's upload into the batch gradient (``delta_to_gradient``: ``(θ0 − θK) / (K·lr)``,
   exact for FedSGD, K = 1), and queues one attack job per (client, attack);
   A server may also choose its victims' local hyperparameters (``victim_config``, e.g. one
   local step on one sample): it sends the train config, so this is within its power;
3. each job runs ``flguard.attacks.reconstruct`` — on a background thread unless
   ``blocking=True`` — scores the reconstruction against the client's true batch when the
   simulation-only channel (``flguard.flower.truth``) provides it, and appends one row to
   ``attacks.jsonl`` and ``attacks.csv`` plus a PNG grid under ``images/``;
4. ``start`` waits for every queued job before it returns (``flush``), so no result is lost.

Two kinds of attack, told apart by each row's ``attack_target``: ``probe`` — the upload a victim
sent under the server's ``victim_config`` (the easiest to invert) — and ``fedavg-upload`` — an
honest client's real multi-step upload, attacked by unrolling its K known local SGD steps
(``upload_attack``: ``UploadAttack(clients, iterations)`` bounds how many per round and how long).
Without a ``victim_config`` every attacked upload is a real one (``fedavg-upload``).

The replies passed on to the wrapped strategy are the clients' own, untouched: the wrapper never
adds records, and the true batches travel through files, never through messages.
"""

from __future__ import annotations

import csv
import json
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy
from flwr.serverapp.strategy.result import Result
from torch import nn

from flguard.flower.scoring import finite_or_none, pixel_map, save_grid, score_batch
from flguard.flower.truth import TrueBatch, TruthChannelRefused, TruthReader
from flguard.flower.uploads import (PROBE, UPLOAD, UPLOAD_KEYS, AttackSpec, ClientUpdate, TargetSelector,  # noqa: F401
                                    UpdateDecoder, UploadAttack, delta_to_gradient, upload_attack_from_config)

log = logging.getLogger(__name__)

# Columns of attacks.csv (attacks.jsonl rows carry the same keys).
# ``attack_target``: "probe" (an upload the server asked its victim for, e.g. one-sample FedSGD) or
# "fedavg-upload" (an honest client's real upload under the task's own train config).
# ``rmse_input_samples``: every sample's RMSE in input units (space-separated), for the promise.
ROW_FIELDS = ("round", "node_id", "partition_id", "attack", "method", "attack_target", "batch_size", "local_steps",
              "lr", "iterations", "restarts", "labels_from", "scored", "psnr", "ssim", "mse", "rmse", "rmse_input",
              "rmse_input_samples", "lpips", "label_accuracy", "loss", "seconds", "status", "error", "image", "tensors",
              "true_labels")


def every_client(server_round: int, node_ids: Sequence[int]) -> Iterable[int]:
    """Attack every client that replied."""
    return node_ids


def first_clients(count: int) -> TargetSelector:
    """Attack the ``count`` replying clients with the smallest node ids."""
    return lambda server_round, node_ids: sorted(node_ids)[:count]


def _with_config(content: RecordDict, values: Mapping[str, Any]) -> RecordDict:
    """A copy of a train message's content whose ConfigRecord(s) carry ``values`` on top.

    Strategies often send one shared RecordDict to every node; the victim gets its own.
    """
    copy = RecordDict({name: record for name, record in content.array_records.items()})
    for name, record in content.config_records.items():
        copy[name] = ConfigRecord({**dict(record), **dict(values)})
    for name, record in content.metric_records.items():
        copy[name] = record
    return copy


def _state(record: ArrayRecord) -> dict[str, torch.Tensor]:
    return {key: tensor.clone() for key, tensor in record.to_torch_state_dict().items()}


class MaliciousServer(Strategy):
    """Wrap ``strategy`` and attack the chosen clients' uploads every round (see module docstring)."""

    def __init__(self, strategy: Strategy, *, model_fn: Callable[[], nn.Module], input_shape: Sequence[int],
                 attacks: Sequence[AttackSpec] = (AttackSpec(),), out_dir: str | Path = "attack-results",
                 targets: int | TargetSelector | None = None, rounds: Iterable[int] | None = None,
                 decoder: UpdateDecoder = delta_to_gradient,
                 normalization: tuple[Sequence[float], Sequence[float]] | None = None,
                 truth_dir: str | Path | None = None, blocking: bool = False, save_images: bool = True,
                 device: str | torch.device | None = None, victim_config: Mapping[str, Any] | None = None,
                 on_row: Callable[[dict[str, Any]], None] | None = None,
                 upload_attack: UploadAttack | None = None) -> None:
        if not attacks:
            raise ValueError("MaliciousServer needs at least one AttackSpec")
        self.strategy = strategy
        self.model_fn = model_fn
        self.input_shape = tuple(int(s) for s in input_shape)
        self.attacks = tuple(attacks)
        self.out_dir = Path(out_dir)
        self.select: TargetSelector = (every_client if targets is None else
                                       first_clients(targets) if isinstance(targets, int) else targets)
        self.rounds = None if rounds is None else set(rounds)
        self.decoder = decoder
        self.normalization = normalization
        self.to_pixels = pixel_map(normalization)
        self.truth_dir = None if truth_dir is None else Path(truth_dir)
        self.blocking = blocking
        self.save_images = save_images
        self.device = device
        self.victim_config = dict(victim_config or {})
        self.on_row = on_row
        self.upload_attack = upload_attack if upload_attack is not None and upload_attack.clients > 0 else None
        self.results: list[dict[str, Any]] = []
        self._victims: dict[int, set[int]] = {}
        self._sent: dict[int, dict[int, tuple[dict[str, torch.Tensor], dict[str, Any]]]] = {}
        self._reader: TruthReader | None = None
        self._truth_checked = False
        self._pending: list[Future[None]] = []
        self._executor: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

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
        if self.victim_config:
            self._victims[server_round] = set(self.select(server_round, [m.metadata.dst_node_id for m in messages]))
            for message in messages:
                if message.metadata.dst_node_id in self._victims[server_round]:
                    message.content = _with_config(message.content, self.victim_config)
        states: dict[int, dict[str, torch.Tensor]] = {}
        sent: dict[int, tuple[dict[str, torch.Tensor], dict[str, Any]]] = {}
        for message in messages:
            content = message.content
            record = next(iter(content.array_records.values()), arrays)
            state = states.setdefault(id(record), _state(record))
            cfg = dict(next(iter(content.config_records.values()), config))
            sent[message.metadata.dst_node_id] = (state, cfg)
        self._sent[server_round] = sent
        return messages

    def aggregate_train(self, server_round: int,
                        replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Queue attacks on the chosen uploads, then let the wrapped strategy aggregate them as they are."""
        replies = list(replies)
        sent = self._sent.pop(server_round, {})
        if self.rounds is None or server_round in self.rounds:
            usable = {r.metadata.src_node_id: r for r in replies
                      if not r.has_error() and len(r.content.array_records) == 1 and r.metadata.src_node_id in sent}
            victims = self._victims.pop(server_round, None)
            chosen = self.select(server_round, list(usable)) if victims is None else sorted(victims & set(usable))
            for node_id in chosen:
                self._capture(server_round, usable[node_id], *sent[node_id], target=PROBE if victims else UPLOAD)
            for node_id in self._honest_targets(server_round, [n for n in usable if n not in set(chosen)]):
                self._capture(server_round, usable[node_id], *sent[node_id], target=UPLOAD, bounded=True)
        return self.strategy.aggregate_train(server_round, replies)

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
        while self._pending:
            self._pending.pop(0).result()
        return list(self.results)

    def close(self) -> None:
        """Flush and stop the background worker (a later round starts a new one)."""
        self.flush()
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None

    def _honest_targets(self, server_round: int, honest: Sequence[int]) -> list[int]:
        """The honest uploads to attack as well (``upload_attack``): the selector's picks for the next
        round among the clients not attacked this round, then any others, ``clients`` of them."""
        if self.upload_attack is None or not honest:
            return []
        preferred = [n for n in self.select(server_round + 1, list(honest)) if n in set(honest)]
        ordered = preferred + sorted(n for n in honest if n not in set(preferred))
        return ordered[:self.upload_attack.clients]

    def _capture(self, server_round: int, reply: Message, before: dict[str, torch.Tensor],
                 config: dict[str, Any], *, target: str = PROBE, bounded: bool = False) -> None:
        node_id = reply.metadata.src_node_id
        after = _state(next(iter(reply.content.array_records.values())))
        truth = self._reader.read(reply.metadata.run_id, server_round, node_id) if self._reader else None
        for spec in self.attacks:
            if bounded:
                from flguard.attacks.api import hyperparameters_of

                if "local_steps" not in hyperparameters_of(spec.method):
                    continue  # R-GAP and the hybrid invert one sample's gradient, not a K-step update
                spec = self.upload_attack.spec(spec)
            job = (server_round, node_id, spec, before, after, config, truth, target)
            if self.blocking:
                self._run(*job)
                continue
            if self._executor is None:
                self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="flguard-attack")
            self._pending.append(self._executor.submit(self._run, *job))

    def attack_upload(self, server_round: int, node_id: int, before: Mapping[str, torch.Tensor],
                      after: Mapping[str, torch.Tensor], config: Mapping[str, Any],
                      truth: TrueBatch | None = None, target: str = PROBE) -> list[dict[str, Any]]:
        """Run every attack on one upload now (θ0 ``before``, θK ``after``); returns the new rows.

        What each round does in the background, callable directly to replay a saved upload.
        """
        return [self._run(server_round, node_id, spec, dict(before), dict(after), dict(config), truth, target)
                for spec in self.attacks]

    def _run(self, server_round: int, node_id: int, spec: AttackSpec, before: dict[str, torch.Tensor],
             after: dict[str, torch.Tensor], config: dict[str, Any], truth: TrueBatch | None,
             target: str = PROBE) -> dict[str, Any]:
        """One attack job; never raises (a failure becomes a row with status 'error')."""
        row: dict[str, Any] = {"round": server_round, "node_id": node_id,
                               "partition_id": truth.partition_id if truth else None, "attack": spec.label,
                               "method": spec.method, "attack_target": target, "iterations": spec.iterations,
                               "restarts": spec.restarts,
                               "scored": False, "status": "ok", "error": None, "image": None}
        started = time.perf_counter()
        try:
            from flguard.attacks import reconstruct

            model = self.model_fn()
            model.load_state_dict(before, strict=True)
            update = self.decoder(model, before, after, config)
            row.update(batch_size=update.batch_size, local_steps=update.local_steps, lr=update.lr)
            use_truth = spec.labels == "true" and truth is not None
            labels = truth.labels if use_truth else None
            row["labels_from"] = "true" if use_truth else "recovered"
            target, extra = self._attack_inputs(spec, update)
            rec = reconstruct(model, target, self.input_shape, method=spec.method, labels=labels,
                              batch_size=update.batch_size, iterations=spec.iterations, restarts=spec.restarts,
                              device=self.device, seed=spec.seed, **extra)
            row["loss"] = finite_or_none(float(rec.loss))
            images = rec.images.detach().cpu()
            if truth is not None:
                scores = score_batch(truth.inputs, images, self.to_pixels, truth.labels, rec.labels)
                images = images[scores.pop("permutation")]  # in the true batch's order
                row.update(scores, scored=True)
            if truth is not None:
                row["true_labels"] = " ".join(str(int(v)) for v in truth.labels.view(-1))
            if self.save_images:
                row["image"] = self._save_grid(server_round, node_id, spec, images, truth)
                row["tensors"] = self._save_tensors(server_round, node_id, spec, images, truth)
        except Exception as error:  # one failed attack must not stop the FL run or the other jobs
            log.exception("attack %s on node %s, round %s failed", spec.label, node_id, server_round)
            row.update(status="error", error=f"{type(error).__name__}: {error}")
        row["seconds"] = time.perf_counter() - started
        return self._append(row)

    def _attack_inputs(self, spec: AttackSpec, update: ClientUpdate) -> tuple[list[torch.Tensor], dict[str, Any]]:
        """The target and hyperparameters for ``reconstruct``: the normalisation where the method
        takes it (box and TV in pixel space), and the K-step unrolling where it can."""
        from flguard.attacks.api import hyperparameters_of

        accepted = hyperparameters_of(spec.method)
        extra: dict[str, Any] = {}
        if self.normalization is not None and {"mean", "std"} <= accepted.keys():
            extra.update(mean=tuple(self.normalization[0]), std=tuple(self.normalization[1]))
        target = update.gradient
        if update.local_steps > 1 and spec.unroll and "local_steps" in accepted:
            target = update.update
            extra.update(local_steps=update.local_steps, local_lr=update.lr,
                         local_batch_size=update.batch_size // update.local_steps)
        extra.update(spec.hyperparameters)
        return target, extra

    def _save_grid(self, server_round: int, node_id: int, spec: AttackSpec, images: torch.Tensor,
                   truth: TrueBatch | None) -> str:
        rows = [self.to_pixels(images)]
        if truth is not None and truth.inputs.shape == images.shape:
            rows.insert(0, self.to_pixels(truth.inputs))
        path = self.out_dir / "images" / f"round-{server_round:04d}_node-{node_id}_{spec.label}.png"
        save_grid(rows, path)
        return str(path.relative_to(self.out_dir))

    def _save_tensors(self, server_round: int, node_id: int, spec: AttackSpec, images: torch.Tensor,
                      truth: TrueBatch | None) -> str:
        """The reconstruction (and the true batch, in simulation) in pixels, for reports to lay out."""
        payload = {"reconstruction": self.to_pixels(images).clamp(0, 1).half()}
        if truth is not None and truth.inputs.shape == images.shape:
            payload["original"] = self.to_pixels(truth.inputs).clamp(0, 1).half()
        path = self.out_dir / "images" / f"round-{server_round:04d}_node-{node_id}_{spec.label}.pt"
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(payload, path)
        return str(path.relative_to(self.out_dir))

    def _append(self, row: dict[str, Any]) -> dict[str, Any]:
        """Append one row to attacks.jsonl and attacks.csv (a header when the CSV is new)."""
        row = {key: row.get(key) for key in ROW_FIELDS}
        with self._lock:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            with open(self.out_dir / "attacks.jsonl", "a", encoding="utf-8") as handle:
                handle.write(json.dumps(row) + "\n")
            csv_path = self.out_dir / "attacks.csv"
            new = not csv_path.exists() or csv_path.stat().st_size == 0
            with open(csv_path, "a", encoding="utf-8", newline="") as handle:
                writer = csv.DictWriter(handle, fieldnames=ROW_FIELDS)
                if new:
                    writer.writeheader()
                writer.writerow({k: "" if v is None else v for k, v in row.items()})
            self.results.append(row)
        if self.on_row is not None:
            self.on_row(row)
        return row

    def __getattr__(self, name: str) -> Any:
        # Attributes the wrapped strategy exposes (e.g. ``weighted_by_key``) stay reachable.
        if name == "strategy":
            raise AttributeError(name)
        return getattr(self.strategy, name)
