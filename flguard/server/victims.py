"""Whom the malicious server attacks, and what it asks of them.

- A *target selector* ``(server round, node ids) -> node ids`` picks the clients whose uploads are
  attacked each round: ``every_client``, ``first_clients(k)``, or any callable (the apps' rotating
  selector takes the same partitions in every defense's run).
- ``honest_targets`` picks, beside them, the honest clients whose real multi-step uploads are
  attacked too (``UploadAttack``).
- ``with_victim_config`` is the server's first active move: it sends the train config, so it may
  choose its victims' local hyperparameters (e.g. one local step on one sample, the easiest
  upload to invert). The replies themselves are never touched.
- ``Fishing`` is its second: it sends the parameters too, so it may send its fishing victims a
  fished model (``flguard.server.fishing``) and ask for one local step at their own batch size;
  their replies are attacked and kept out of aggregation (the global model must not learn from a
  model the server broke on purpose).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, RecordDict

from flguard.server.uploads import UploadAttack

# (server round, node ids that replied) -> node ids to attack.
TargetSelector = Callable[[int, Sequence[int]], Iterable[int]]


def every_client(server_round: int, node_ids: Sequence[int]) -> Iterable[int]:
    """Attack every client that replied."""
    return node_ids


def first_clients(count: int) -> TargetSelector:
    """Attack the ``count`` replying clients with the smallest node ids."""
    return lambda server_round, node_ids: sorted(node_ids)[:count]


def selector(targets: int | TargetSelector | None) -> TargetSelector:
    """``targets`` as a selector: None attacks every client, an int that many (``first_clients``)."""
    if targets is None:
        return every_client
    return first_clients(targets) if isinstance(targets, int) else targets


def honest_targets(select: TargetSelector, upload_attack: UploadAttack | None, server_round: int,
                   honest: Sequence[int]) -> list[int]:
    """The honest uploads to attack as well (``upload_attack``): the selector's picks for the next
    round among the clients not attacked this round, then any others, ``clients`` of them.

    Taking next round's targets first means that, with rotating targets, every defense's run
    attacks the real uploads of the same partitions.
    """
    if upload_attack is None or not honest:
        return []
    return next_round_first(select, server_round, honest)[:upload_attack.clients]


def next_round_first(select: TargetSelector, server_round: int, candidates: Sequence[int]) -> list[int]:
    """``candidates`` ordered with the selector's picks for the next round first, then by node id."""
    preferred = [n for n in select(server_round + 1, list(candidates)) if n in set(candidates)]
    return preferred + sorted(n for n in candidates if n not in set(preferred))


def with_victim_config(content: RecordDict, values: Mapping[str, Any], arrays: ArrayRecord | None = None) -> RecordDict:
    """A copy of a train message's content whose ConfigRecord(s) carry ``values`` on top (and whose
    model is ``arrays`` when given: the fishing move).

    Strategies often send one shared RecordDict to every node; the victim gets its own.
    """
    copy = RecordDict({name: record if arrays is None else arrays for name, record in content.array_records.items()})
    for name, record in content.config_records.items():
        copy[name] = ConfigRecord({**dict(record), **dict(values)})
    for name, record in content.metric_records.items():
        copy[name] = record
    return copy


@dataclass(frozen=True)
class Fishing:
    """The fishing move: ``clients`` victims per round (beside the probes) get the model with its
    classifier fished for one class (``kind="class"``, Wen et al. 2022) and a one-step config.

    The target class: ``target`` when fixed; else, with ``infer_target``, the class the victim's last
    aggregated upload trained most on — read off its classifier's bias update θK − θ0, which rises for
    the classes in the batches (the server sees every upload; ``MaliciousServer`` keeps the last one
    per node) — so the fished class is one the client holds; else, and before any upload, the class
    ``(round − 1) mod classes``. A batch without the class yields a row with nothing to score.
    ``class_multiplier`` and ``bias_multiplier`` are ``fish_class``'s. Feature fishing needs
    thresholds the server estimates from data of its own; it is in ``fish_feature``, not yet a
    round move here.
    """

    kind: str = "class"
    clients: int = 1
    target: int | None = None
    infer_target: bool = True
    class_multiplier: float = 0.5
    bias_multiplier: float = 1000.0

    def __post_init__(self) -> None:
        if self.kind != "class":
            raise ValueError(f"Fishing.kind={self.kind!r}: the server's round move fishes by class ('class'); "
                             "feature fishing is flguard.server.fishing.fish_feature")
        if self.clients < 1:
            raise ValueError(f"Fishing.clients={self.clients} must be >= 1")

    def target_class(self, server_round: int, classes: int, bias_update: Any = None) -> int:
        """This round's class for a victim whose last aggregated upload moved the classifier's bias by
        ``bias_update`` (a tensor [classes], or None when the server has seen none)."""
        if self.target is not None:
            return self.target
        if self.infer_target and bias_update is not None and float(bias_update.max()) > 0:
            return int(bias_update.argmax())
        return (server_round - 1) % classes


def fishing_victims(select: TargetSelector, fishing: Fishing | None, server_round: int,
                    candidates: Sequence[int]) -> list[int]:
    """The ``fishing.clients`` nodes to fish among ``candidates`` (the ones not probed): the selector's
    picks for the next round first, as ``honest_targets`` does, so every defense's run fishes the
    same partitions."""
    if fishing is None or not candidates:
        return []
    return next_round_first(select, server_round, candidates)[:fishing.clients]
