"""What the malicious server attacks and with what: attack specs, the real-upload mode, decoded uploads.

One concern, shared by the strategy wrapper (``flguard.server.strategy``, which captures uploads)
and the attack runner (``flguard.server.runner``, which inverts them): ``AttackSpec`` (one attack
on every chosen upload), ``UploadAttack`` (also attack honest clients' real multi-step FedAvg
uploads, at a bounded cost), ``state_of`` (a captured model, detached from Flower's record) and
``delta_to_gradient`` (an uploaded model θK as the update θK − θ0 and the gradient an attack
inverts).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from flwr.app import ArrayRecord
from torch import nn

from flguard.simulation.task import BATCH_SIZE_KEY, LOCAL_STEPS_KEY, LR_KEY

# The two kinds of attack (the ``attack_target`` of a result row): an upload the server asked its
# victim for (e.g. one sample, one FedSGD step) and an honest client's real upload under the task's
# own train config.
PROBE, UPLOAD = "probe", "fedavg-upload"
# The third: a one-step upload of a model the server fished (``flguard.server.fishing``).
FISHED = "fishing"


@dataclass(frozen=True)
class AttackSpec:
    """One attack the server runs on every chosen upload.

    ``labels``: ``"recover"`` (the attack recovers them, e.g. iDLG) or ``"true"`` (the client's
    true labels from the simulation channel: the "labels known" threat model).
    ``hyperparameters`` go to ``reconstruct`` unchanged (e.g. ``{"tv": 0.01}``).
    ``unroll``: attack a K-step update by unrolling the K steps when the method can (it accepts
    ``local_steps``); otherwise, or with ``unroll=False``, attack the averaged gradient.
    """

    method: str = "gs"
    iterations: int | None = None
    restarts: int = 1
    labels: str = "recover"
    seed: int | None = 0
    name: str | None = None
    unroll: bool = True
    hyperparameters: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.labels not in ("recover", "true"):
            raise ValueError(f"AttackSpec.labels={self.labels!r} must be 'recover' or 'true'")
        if self.restarts < 1 or (self.iterations is not None and self.iterations < 1):
            raise ValueError("AttackSpec.restarts and .iterations must be positive")

    @property
    def label(self) -> str:
        return self.name or self.method


@dataclass(frozen=True)
class UploadAttack:
    """Also attack honest clients' real multi-step FedAvg uploads (beside the probes the server asks for).

    ``clients`` honest uploads per round (0: off), chosen as the selector's targets of the *next*
    round among the clients that were not probed (with rotating targets: the next clients in turn,
    so the same partitions in every defense's run). Every ``AttackSpec`` whose method can unroll
    the K known local steps (accepts ``local_steps``) runs on them with at most ``iterations``
    iterations (the uploads are K·B images and K unrolled steps: this bounds their cost).
    ``hyperparameters`` override the spec's for these attacks only.
    """

    clients: int = 1
    iterations: int = 50
    hyperparameters: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.clients < 0 or self.iterations < 1:
            raise ValueError(f"UploadAttack.clients={self.clients} must be >= 0 and iterations={self.iterations} >= 1")

    def spec(self, spec: AttackSpec) -> AttackSpec:
        """``spec`` bounded for a real upload: unrolled, at most ``iterations``, extra hyperparameters."""
        count = self.iterations if spec.iterations is None else min(spec.iterations, self.iterations)
        return replace(spec, iterations=count, unroll=True,
                       hyperparameters={**dict(spec.hyperparameters), **dict(self.hyperparameters)})


UPLOAD_KEYS = ("attack-uploads", "attack-upload-iterations")


def upload_attack_from_config(config: Mapping[str, Any]) -> UploadAttack | None:
    """``attack-uploads`` (honest uploads per round, default 1 when the server probes, else 0) and
    ``attack-upload-iterations`` (default 50) from a run config; None when off.

    Without probes (``victim-*`` keys unset) the server's ordinary targets already are real
    uploads, so the default stays off there.
    """
    def value(key: str, default: int) -> int:  # '' (a declared but unset key) means the default
        raw = config.get(key, "")
        return default if raw in ("", None) else int(raw)

    probing = value("victim-batch-size", 0) > 0 or value("victim-local-steps", 0) > 0
    clients = value("attack-uploads", 1 if probing else 0)
    if clients <= 0:
        return None
    return UploadAttack(clients=clients, iterations=value("attack-upload-iterations", 50))


@dataclass
class ClientUpdate:
    """A client's upload, decoded into what the attacks need."""

    gradient: list[torch.Tensor]  # (θ0 − θK)/(K·lr), model.parameters() order
    update: list[torch.Tensor]  # θK − θ0, what a K-step attack unrolls
    batch_size: int  # images behind the update: K·B for K local steps of B
    local_steps: int
    lr: float


# (model holding θ0, θ0 state, θK state, train config sent) -> the decoded update.
UpdateDecoder = Callable[[nn.Module, Mapping[str, torch.Tensor], Mapping[str, torch.Tensor], Mapping[str, Any]],
                         ClientUpdate]


def state_of(record: ArrayRecord) -> dict[str, torch.Tensor]:
    """A model state carried by a message, as tensors of its own: the server keeps θ0 and θK
    after Flower has moved on (and an attack thread must never share storage with a record)."""
    return {key: tensor.clone() for key, tensor in record.to_torch_state_dict().items()}


def delta_to_gradient(model: nn.Module, before: Mapping[str, torch.Tensor], after: Mapping[str, torch.Tensor],
                      config: Mapping[str, Any]) -> ClientUpdate:
    """Decode an uploaded model θK: the update ``θK − θ0`` and the gradient ``(θ0 − θK) / (K · lr)``.

    For FedSGD (K = 1 plain SGD step) the gradient *is* the batch gradient, up to float32 rounding
    of θ. For K > 1 it is the mean of the K step gradients, i.e. approximately the gradient of the
    mean loss over all K·B samples (exact to first order in lr); attacks that unroll the K steps
    (``local_steps`` hyperparameter, e.g. GS) get the raw update instead (``AttackRunner.attack_inputs``).
    """
    lr = float(config.get(LR_KEY, 0.0))
    steps = int(config.get(LOCAL_STEPS_KEY, 1))
    if not lr > 0 or steps < 1:
        raise ValueError(f"train config needs a positive '{LR_KEY}' and '{LOCAL_STEPS_KEY}' to decode an update; "
                         f"got {dict(config)}")
    names = [name for name, p in model.named_parameters() if p.requires_grad]
    missing = [name for name in names if name not in before or name not in after]
    if missing:
        raise ValueError(f"upload lacks parameters {missing[:3]}...; is the ArrayRecord a model state_dict?")
    update = [after[n].double() - before[n].double() for n in names]
    gradient = [u.mul(-1.0 / (lr * steps)).float() for u in update]
    batch = int(config.get(BATCH_SIZE_KEY, 1)) * steps
    return ClientUpdate(gradient, [u.float() for u in update], batch, steps, lr)
