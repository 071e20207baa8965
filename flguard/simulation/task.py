"""The federated task every flguard Flower app shares: model, client data, local SGD, records.

Why one module: the ClientApp, the ServerApp and the malicious server must agree on the model
architecture, on the data a client trains on and on the meaning of the train-config keys
(``lr``, ``local-steps``, ``batch-size``). The server sends those keys with every train message, so
the (honest-but-curious or malicious) server knows the client's local hyperparameters, as the
threat model assumes (DESIGN.md §2).

Local training is plain SGD without momentum or weight decay, so one local step satisfies
``θ1 = θ0 − lr · g`` exactly and the server can turn an uploaded model into the batch gradient
``g = (θ0 − θ1) / lr`` (see ``flguard.server.delta_to_gradient``).
"""

from __future__ import annotations

import functools
import time
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from torch import nn

from flguard.data import ImageDataset, load, partition
from flguard.flower.guard_mod import guard_step
from flguard.risk.dropout_draws import DropoutDraws
from flguard.simulation.truth import record_batch
from flguard.models import create

# Keys of the train ConfigRecord the server sends (FedAvg adds "server-round" itself).
LR_KEY = "lr"
LOCAL_STEPS_KEY = "local-steps"
BATCH_SIZE_KEY = "batch-size"
ROUND_KEY = "server-round"
# Record names inside train/evaluate messages (FedAvg's defaults for the arrays and config).
ARRAYS_KEY = "arrays"
CONFIG_KEY = "config"
METRICS_KEY = "metrics"
# The metric keys every train reply carries, every round (FedAvg refuses inconsistent keys).
# ``grad-norm`` is the mean norm of the local steps' gradients before any guard (what ``guard_rel_noise``
# already implies), ``train-seconds`` the local training time without the guard's own time, and
# ``partition-id`` the simulated client's index (it lets comparisons line clients up across runs).
TRAIN_METRIC_KEYS = ("num-examples", "train-loss", "grad-norm", "train-seconds", "partition-id")
EVALUATE_METRIC_KEYS = ("num-examples", "eval-loss", "eval-acc", "partition-id")


def dataclass_from_config(cls, *configs: Mapping[str, Any] | None):
    """Build dataclass ``cls`` from run-config-like mappings: field ``foo_bar`` is key ``foo-bar``,
    values take the default's type (booleans from true/false/1/0), later mappings override
    earlier ones, and unknown keys are ignored (task, server and guard share one run config)."""
    values: dict[str, Any] = {}
    for config in configs:
        for field in fields(cls):
            key = field.name.replace("_", "-")
            if config is not None and key in config:
                default, raw = getattr(cls, field.name), config[key]
                values[field.name] = (str(raw).lower() in ("1", "true", "yes") if isinstance(default, bool)
                                      else type(default)(raw))
    return cls(**values)


@dataclass(frozen=True)
class TaskSettings:
    """Everything that defines the task; read from a run config (``[tool.flwr.app.config]``).

    Field ``foo_bar`` is the run-config key ``foo-bar``. Unknown keys are ignored so that the
    server's and the guard's settings can live in the same run config.
    """

    model: str = "lenet"
    dataset: str = "mnist5k"
    init: str = "default"
    seed: int = 0
    num_partitions: int = 2
    partitioning: str = "iid"
    alpha: float = 0.5
    test_fraction: float = 0.2
    lr: float = 0.1
    local_steps: int = 1
    batch_size: int = 4
    public_examples: int = 0  # >0: this many examples are the server's public data, in no client's partition
    pretrain_epochs: int = 0  # >0: the initial global model is trained on the public data first (warm start)
    train_layers: str = "all"  # "head": fine-tuning — only the last linear layer trains (``fine_tuned``)

    @classmethod
    def from_config(cls, *configs: Mapping[str, Any] | None) -> "TaskSettings":
        """Settings from run-config-like mappings; later mappings override earlier ones."""
        return dataclass_from_config(cls, *configs)

    def train_config(self) -> ConfigRecord:
        """The local hyperparameters the server sends with every train message."""
        return ConfigRecord({LR_KEY: float(self.lr), LOCAL_STEPS_KEY: int(self.local_steps),
                             BATCH_SIZE_KEY: int(self.batch_size)})

    def with_train_config(self, config: Mapping[str, Any] | None) -> "TaskSettings":
        """These settings with the local hyperparameters a train message carries."""
        if not config:
            return self
        return replace(
            self,
            lr=float(config.get(LR_KEY, self.lr)),
            local_steps=int(config.get(LOCAL_STEPS_KEY, self.local_steps)),
            batch_size=int(config.get(BATCH_SIZE_KEY, self.batch_size)),
        )


@functools.lru_cache(maxsize=4)
def load_dataset(name: str) -> ImageDataset:
    """The whole dataset, loaded once per process (Ray actors reuse their process)."""
    return load(name)


def public_indices(name: str, count: int, seed: int) -> np.ndarray:
    """The server's public examples: ``count`` indices of a seeded permutation (none when 0)."""
    order = np.random.default_rng(seed).permutation(len(load_dataset(name)))
    return np.sort(order[:count])


@functools.lru_cache(maxsize=16)
def _partitions(name: str, num_partitions: int, method: str, alpha: float, seed: int,
                public: int = 0) -> tuple[np.ndarray, ...]:
    """Client partitions of the dataset without its public examples (indices into the whole dataset)."""
    labels = load_dataset(name).labels.numpy()
    private = np.setdiff1d(np.arange(len(labels)), public_indices(name, public, seed))
    parts = partition(labels[private], num_partitions, method=method, alpha=alpha, seed=seed)
    return tuple(private[np.asarray(p, dtype=np.int64)] for p in parts)


def load_partition(settings: TaskSettings, partition_id: int, num_partitions: int | None = None
                   ) -> tuple[ImageDataset, ImageDataset]:
    """Client ``partition_id``'s (train, test) data, pixels in [0, 1]."""
    count = int(num_partitions or settings.num_partitions)
    if not 0 <= partition_id < count:
        raise ValueError(f"partition-id={partition_id} must lie in [0, {count}) (num-partitions={count})")
    parts = _partitions(settings.dataset, count, settings.partitioning, settings.alpha, settings.seed,
                        settings.public_examples)
    return load_dataset(settings.dataset).subset(parts[partition_id]).split(settings.test_fraction,
                                                                           seed=settings.seed)


def input_shape(settings: TaskSettings) -> tuple[int, int, int]:
    """The model input shape [C, H, W] of the task's dataset."""
    return load_dataset(settings.dataset).shape


#: ``TaskSettings.train_layers``: every parameter trains, or the last linear layer alone (``fine_tuned``).
TRAIN_LAYERS = ("all", "head")


def make_model(settings: TaskSettings) -> nn.Module:
    """The task's model as the federation trains it (``fine_tuned``); seeded so that the server's initial model is
    reproducible."""
    return fine_tuned(_created(settings), settings)


def _created(settings: TaskSettings) -> nn.Module:
    dataset = load_dataset(settings.dataset)
    channels, size, _ = dataset.shape
    with torch.random.fork_rng():
        torch.manual_seed(settings.seed)
        return create(settings.model, in_channels=channels, num_classes=dataset.num_classes,
                      image_size=size, init=settings.init)


def fine_tuned(model: nn.Module, settings: TaskSettings, fresh_head: bool = False) -> nn.Module:
    """``model`` as the federation trains it. ``train_layers="all"``: as it is. ``"head"`` (fine-tuning a backbone
    pre-trained on the server's public examples): every BatchNorm kept as it was trained
    (``flguard.fix_model(model, batchnorm="frozen")``: per sample, so the guard takes it), every parameter frozen but
    the last linear layer's, which ``fresh_head`` re-initialises (seeded): a new head on the pretrained features."""
    if settings.train_layers not in TRAIN_LAYERS:
        raise ValueError(f"train-layers={settings.train_layers!r} must be one of {TRAIN_LAYERS}")
    if settings.train_layers == "all":
        return model
    from flguard.guard import fix_model

    with warnings.catch_warnings():
        if not fresh_head:  # a client's model before its arrays are loaded has seen no batch: no warning
            warnings.simplefilter("ignore", UserWarning)
        model = fix_model(model, batchnorm="frozen")
    linear = [module for module in model.modules() if isinstance(module, nn.Linear)]
    if not linear:
        raise ValueError(f"train-layers='head': the model {settings.model!r} has no linear layer to train")
    for param in model.parameters():
        param.requires_grad_(False)
    for param in linear[-1].parameters():
        param.requires_grad_(True)
    if fresh_head:
        with torch.random.fork_rng():
            torch.manual_seed(settings.seed + 1)
            linear[-1].reset_parameters()
    return model


def initial_model(settings: TaskSettings) -> nn.Module:
    """The server's initial global model: ``make_model``, warm-started on the public examples when
    ``public_examples`` and ``pretrain_epochs`` are set (Adam, lr 1e-3, batches of 32, seeded) —
    FL from a model pre-trained on public data, so the federated rounds start where the model has
    learned. No client data is used. With ``train_layers="head"`` the whole model is pre-trained (its BatchNorms in
    train mode), then ``fine_tuned`` with a fresh head: the federation trains a new head on the pretrained backbone."""
    model = _created(settings)
    if settings.public_examples <= 0 or settings.pretrain_epochs <= 0:
        return fine_tuned(model, settings, fresh_head=True)
    data = load_dataset(settings.dataset).subset(public_indices(settings.dataset, settings.public_examples,
                                                                settings.seed))
    generator = torch.Generator().manual_seed(settings.seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    model.train()
    for _ in range(settings.pretrain_epochs):
        for index in torch.randperm(len(data), generator=generator).split(32):
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(data.normalize(data.images[index])), data.labels[index]).backward()
            optimizer.step()
    return fine_tuned(model, settings, fresh_head=True)


def to_arrays(model: nn.Module) -> ArrayRecord:
    """The model's ``state_dict`` as an ArrayRecord (what travels in messages)."""
    return ArrayRecord(model.state_dict())


def load_arrays(model: nn.Module, arrays: ArrayRecord) -> nn.Module:
    """Load an ArrayRecord into ``model`` in place (strict: every key must match)."""
    model.load_state_dict(arrays.to_torch_state_dict(), strict=True)
    return model


@dataclass
class LocalUpdate:
    """What local training did: the batches it used (model input space) and its mean loss."""

    inputs: torch.Tensor  # [K * B, C, H, W], the K batches concatenated in step order
    labels: torch.Tensor  # [K * B]
    loss: float
    steps: int
    batch_size: int
    grad_norm: float = 0.0  # mean over steps of the unguarded gradient norm
    seconds: float = 0.0  # local training time, the guard's own time excluded


def batch_generator(settings: TaskSettings, server_round: int, partition_id: int) -> torch.Generator:
    """A generator seeded by (seed, round, partition): batch choice reproducible per client round."""
    return torch.Generator().manual_seed(hash((settings.seed, server_round, partition_id)) & 0x7FFF_FFFF)


def local_sgd(model: nn.Module, data: ImageDataset, *, lr: float, steps: int, batch_size: int,
              generator: torch.Generator) -> LocalUpdate:
    """``steps`` plain SGD steps on mini-batches of ``batch_size`` (mean cross-entropy).

    The batches are consecutive chunks of one random permutation (disjoint while K·B ≤ N, like a
    shuffled loader's epoch), so the K batches concatenated in step order are what an unrolling
    attacker reconstructs. ``steps=1`` is FedSGD: the update is exactly ``−lr ·`` the gradient.
    """
    if steps < 1 or batch_size < 1 or lr <= 0:
        raise ValueError(f"local-steps={steps}, batch-size={batch_size} and lr={lr} must be positive")
    size = min(batch_size, len(data))
    inputs, labels, losses, norms = [], [], [], []
    guard_time, start_time = 0.0, time.perf_counter()
    params = [p for p in model.parameters() if p.requires_grad]
    order = torch.randperm(len(data), generator=generator)
    model.train()
    for step in range(steps):
        start = (step * size) % (len(data) - len(data) % size or len(data))
        index = order[start:start + size]
        x, y = data.normalize(data.images[index]), data.labels[index]
        with DropoutDraws() as drawing:  # a dropout model's masks, which the guard replays
            loss = nn.functional.cross_entropy(model(x), y)
        grads = torch.autograd.grad(loss, params)
        norms.append(float(torch.sqrt(sum(g.detach().pow(2).sum() for g in grads))))
        guard_start = time.perf_counter()
        grads = guard_step(model, x, y, grads, step_size=lr, draws=drawing.finish())  # identity without guard_mod
        guard_time += time.perf_counter() - guard_start
        with torch.no_grad():
            for p, g in zip(params, grads):
                p.sub_(lr * g)
        inputs.append(x)
        labels.append(y)
        losses.append(float(loss.detach()))
    return LocalUpdate(torch.cat(inputs), torch.cat(labels), float(np.mean(losses)), steps, size,
                       float(np.mean(norms)), time.perf_counter() - start_time - guard_time)


@torch.no_grad()
def evaluate_model(model: nn.Module, data: ImageDataset, batch_size: int = 256) -> tuple[float, float]:
    """Mean cross-entropy and accuracy of ``model`` on ``data``."""
    model.eval()
    loss_sum, correct = 0.0, 0
    for start in range(0, len(data), batch_size):
        x = data.normalize(data.images[start:start + batch_size])
        y = data.labels[start:start + batch_size]
        logits = model(x)
        loss_sum += float(nn.functional.cross_entropy(logits, y, reduction="sum"))
        correct += int((logits.argmax(dim=1) == y).sum())
    return loss_sum / max(len(data), 1), correct / max(len(data), 1)


def node_partition(context_node_config: Mapping[str, Any], settings: TaskSettings) -> tuple[int, int]:
    """(partition-id, num-partitions) from a node config; simulation and deployment both set them."""
    if "partition-id" not in context_node_config:
        raise ValueError("node config has no 'partition-id'; start the SuperNode with "
                         "--node-config \"partition-id=<k> num-partitions=<n>\"")
    count = int(context_node_config.get("num-partitions", settings.num_partitions))
    return int(context_node_config["partition-id"]), count


def train_reply(message: Message, model: nn.Module, update: LocalUpdate, partition_id: int = -1) -> Message:
    """The train reply: one ArrayRecord (the local model) and one MetricRecord with fixed keys."""
    metrics = MetricRecord({"num-examples": int(update.labels.numel()), "train-loss": float(update.loss),
                            "grad-norm": float(update.grad_norm), "train-seconds": float(update.seconds),
                            "partition-id": int(partition_id)})
    return Message(RecordDict({ARRAYS_KEY: to_arrays(model), METRICS_KEY: metrics}), reply_to=message)


def evaluate_reply(message: Message, loss: float, accuracy: float, num_examples: int,
                   partition_id: int = -1) -> Message:
    """The evaluate reply: one MetricRecord with fixed keys."""
    metrics = MetricRecord({"num-examples": int(num_examples), "eval-loss": float(loss), "eval-acc": float(accuracy),
                            "partition-id": int(partition_id)})
    return Message(RecordDict({METRICS_KEY: metrics}), reply_to=message)


def settings_from(context: Context, overrides: Mapping[str, Any] | None = None) -> TaskSettings:
    """Task settings from the run config, then ``overrides`` (in-process simulations have no run config)."""
    return TaskSettings.from_config(context.run_config, overrides)


def handle_train(message: Message, context: Context, settings: TaskSettings, *,
                 truth_dir: str | None = None) -> Message:
    """The whole client train step: load θ0, run local SGD on this node's partition, reply θK.

    ``truth_dir`` (or the run-config key ``sim-truth-dir``) hands the true batch to a simulated
    malicious server through ``flguard.simulation.truth`` — a no-op outside simulations.
    """
    settings = settings.with_train_config(message.content.config_records.get(CONFIG_KEY))
    partition_id, count = node_partition(context.node_config, settings)
    train_data, _ = load_partition(settings, partition_id, count)
    model = load_arrays(make_model(settings), message.content.array_records[ARRAYS_KEY])
    config = message.content.config_records.get(CONFIG_KEY) or {}
    server_round = int(config.get(ROUND_KEY, 0))
    generator = batch_generator(settings, server_round, partition_id)
    update = local_sgd(model, train_data, lr=settings.lr, steps=settings.local_steps,
                       batch_size=settings.batch_size, generator=generator)
    record_batch(context, server_round, update.inputs, update.labels, directory=truth_dir)
    return train_reply(message, model, update, partition_id)


def handle_evaluate(message: Message, context: Context, settings: TaskSettings) -> Message:
    """Evaluate the received global model on this node's local test split."""
    partition_id, count = node_partition(context.node_config, settings)
    _, test_data = load_partition(settings, partition_id, count)
    model = load_arrays(make_model(settings), message.content.array_records[ARRAYS_KEY])
    loss, accuracy = evaluate_model(model, test_data)
    return evaluate_reply(message, loss, accuracy, len(test_data), partition_id)


def handle_query(message: Message, context: Context, settings: TaskSettings) -> Message:
    """Answer a query with this node's partition id (simulation bookkeeping: which client is which)."""
    partition_id, count = node_partition(context.node_config, settings)
    return Message(RecordDict({METRICS_KEY: MetricRecord({"partition-id": partition_id, "num-partitions": count})}),
                   reply_to=message)
