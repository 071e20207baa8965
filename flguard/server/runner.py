"""The attack runner: invert captured uploads, on a background thread, one row per attack.

``AttackRunner`` receives ``CapturedUpload``s from the strategy wrapper (θ0 sent, θK received, the
train config sent and, in simulation, the client's true batch) and, per ``AttackSpec``:

1. decodes the upload (``delta_to_gradient`` by default: the update and the batch gradient);
2. runs ``flguard.attacks.reconstruct`` on it — the averaged gradient, or the raw K-step update
   unrolled when the method can (``attack_inputs``);
3. scores the reconstruction when the true batch is there (``Scorer``) and hands the row and the
   images to the ``ResultWriter``.

Jobs run on one worker thread so that the federation is never held up by an attack (unless
``blocking``); ``flush`` waits for all of them. A failing attack becomes a row with status
``error``: it never stops the FL run or the other jobs.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from flguard.attacks.base import Reconstruction
from flguard.server.results import ResultWriter
from flguard.server.scoring import Scorer, finite_or_none
from flguard.server.truth import TrueBatch
from flguard.server.uploads import PROBE, AttackSpec, ClientUpdate, UpdateDecoder, UploadAttack, delta_to_gradient

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CapturedUpload:
    """One client's upload as the server saw it, with what the attacker knows about it."""

    server_round: int
    node_id: int
    before: Mapping[str, torch.Tensor]  # θ0, the global model sent
    after: Mapping[str, torch.Tensor]  # θK, the model uploaded
    config: Mapping[str, Any]  # the train config sent (lr, local steps, batch size)
    truth: TrueBatch | None = None  # simulation only: the batch the client trained on, for scoring
    target: str = PROBE  # the row's attack_target: PROBE, UPLOAD or FISHED
    fished_class: int | None = None  # FISHED: the class the model sent was fished for


class AttackRunner:
    """Runs every ``attacks`` spec on each captured upload (see module docstring).

    ``normalization`` (mean, std) goes to the methods that take it (box and TV in pixel space);
    ``upload_attack`` bounds the attacks on honest clients' real uploads (``bounded=True``).
    """

    def __init__(self, *, model_fn: Callable[[], nn.Module], input_shape: Sequence[int],
                 attacks: Sequence[AttackSpec], writer: ResultWriter, scorer: Scorer | None = None,
                 decoder: UpdateDecoder = delta_to_gradient,
                 normalization: tuple[Sequence[float], Sequence[float]] | None = None,
                 device: str | torch.device | None = None, blocking: bool = False,
                 upload_attack: UploadAttack | None = None) -> None:
        if not attacks:
            raise ValueError("the attack runner needs at least one AttackSpec")
        self.model_fn = model_fn
        self.input_shape = tuple(int(s) for s in input_shape)
        self.attacks = tuple(attacks)
        self.writer = writer
        self.scorer = scorer if scorer is not None else Scorer(normalization)
        self.decoder = decoder
        self.normalization = normalization
        self.device = device
        self.blocking = blocking
        self.upload_attack = upload_attack
        self._pending: list[Future[dict[str, Any]]] = []
        self._executor: ThreadPoolExecutor | None = None

    def specs(self, bounded: bool = False) -> list[AttackSpec]:
        """The specs to run on one upload; ``bounded`` (an honest client's real upload): only the
        methods that can unroll K local steps, each bounded by ``upload_attack``."""
        if not bounded:
            return list(self.attacks)
        if self.upload_attack is None:
            return []
        from flguard.attacks.api import hyperparameters_of

        # R-GAP and the hybrid invert one sample's gradient, not a K-step update.
        return [self.upload_attack.spec(spec) for spec in self.attacks
                if "local_steps" in hyperparameters_of(spec.method)]

    def submit(self, upload: CapturedUpload, *, bounded: bool = False) -> None:
        """Queue one job per spec (run now when ``blocking``)."""
        for spec in self.specs(bounded):
            if self.blocking:
                self.run(upload, spec)
                continue
            if self._executor is None:
                self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="flguard-attack")
            self._pending.append(self._executor.submit(self.run, upload, spec))

    def flush(self) -> list[dict[str, Any]]:
        """Wait for every queued job; returns all result rows so far."""
        while self._pending:
            self._pending.pop(0).result()
        return list(self.writer.results)

    def close(self) -> None:
        """Flush and stop the worker thread (a later submit starts a new one)."""
        self.flush()
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None

    def run(self, upload: CapturedUpload, spec: AttackSpec) -> dict[str, Any]:
        """One attack on one upload, now; returns the written row. Never raises (a failure is a
        row with status 'error')."""
        truth = upload.truth
        row: dict[str, Any] = {"round": upload.server_round, "node_id": upload.node_id,
                               "partition_id": truth.partition_id if truth else None, "attack": spec.label,
                               "method": spec.method, "attack_target": upload.target, "iterations": spec.iterations,
                               "restarts": spec.restarts,
                               "scored": False, "status": "ok", "error": None, "image": None}
        started = time.perf_counter()
        try:
            from flguard.attacks import reconstruct

            before = dict(upload.before)
            model = self.model_fn()
            model.load_state_dict(before, strict=True)
            update = self.decoder(model, before, dict(upload.after), dict(upload.config))
            row.update(batch_size=update.batch_size, local_steps=update.local_steps, lr=update.lr)
            use_truth = spec.labels == "true" and truth is not None
            row["labels_from"] = "true" if use_truth else "recovered"
            target, extra = self.attack_inputs(spec, update)
            if upload.fished_class is not None:
                rec, truth = self._attack_fished(model, update, upload, spec, extra, row)
            else:
                rec = reconstruct(model, target, self.input_shape, method=spec.method,
                                  labels=truth.labels if use_truth else None, batch_size=update.batch_size,
                                  iterations=spec.iterations, restarts=spec.restarts, device=self.device,
                                  seed=spec.seed, **extra)
            row["loss"] = finite_or_none(float(rec.loss))
            images = rec.images.detach().cpu()
            if truth is not None and truth.labels.numel() == images.shape[0]:
                scores = self.scorer.score(truth, images, rec.labels)
                images = images[scores.pop("permutation")]  # in the true batch's order
                row.update(scores, scored=True)
                row["true_labels"] = " ".join(str(int(v)) for v in truth.labels.view(-1))
            row.update(self.writer.save(upload.server_round, upload.node_id, spec.label, images, truth))
        except Exception as error:  # one failed attack must not stop the FL run or the other jobs
            log.exception("attack %s on node %s, round %s failed", spec.label, upload.node_id, upload.server_round)
            row.update(status="error", error=f"{type(error).__name__}: {error}")
        row["seconds"] = time.perf_counter() - started
        return self.writer.append(row)

    def _attack_fished(self, model: nn.Module, update: ClientUpdate, upload: CapturedUpload, spec: AttackSpec,
                       extra: dict[str, Any], row: dict[str, Any]) -> tuple[Reconstruction, TrueBatch | None]:
        """``attack_fished`` on a fished upload, and the truth it is scored against: the batch's samples
        of the fished class (the count comes from the upload, never from the truth). Where the count
        is misread, the min(counted, true) reconstructions and true samples closest to each other
        are scored (a judge's choice: it can only favour the attacker); a batch without the class has
        no truth to score against."""
        from flguard.server.fishing import attack_fished

        target = int(upload.fished_class)
        rec = attack_fished(model, update, target, self.input_shape, method=spec.method, iterations=spec.iterations,
                            restarts=spec.restarts, device=self.device, seed=spec.seed, **extra)
        row.update(fished_class=target, targets=rec.extra["targets"])
        truth = upload.truth
        if truth is None:
            return rec, None
        mask = truth.labels.view(-1) == target
        row["true_targets"] = int(mask.sum())
        if not bool(mask.any()):
            return rec, None  # nothing of the class in the batch: nothing to score
        inputs, labels = truth.inputs[mask], truth.labels.view(-1)[mask]
        count = rec.images.shape[0]
        if count != len(labels):  # the count misread (noise blurs the bias gradient): score the best-matched pairs
            from scipy.optimize import linear_sum_assignment

            images = rec.images.detach().cpu()
            cost = torch.cdist(images.flatten(1).double(), inputs.cpu().flatten(1).double())
            rows, cols = linear_sum_assignment(cost.numpy())
            rec.images, rec.labels = images[torch.as_tensor(rows)], rec.labels.cpu()[torch.as_tensor(rows)]
            inputs, labels = inputs[torch.as_tensor(cols)], labels[torch.as_tensor(cols)]
        return rec, replace(truth, inputs=inputs, labels=labels)

    def attack_inputs(self, spec: AttackSpec, update: ClientUpdate) -> tuple[list[torch.Tensor], dict[str, Any]]:
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
