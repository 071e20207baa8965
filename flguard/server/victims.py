"""Whom the malicious server attacks, and what it asks of them.

- A *target selector* ``(server round, node ids) -> node ids`` picks the clients whose uploads are
  attacked each round: ``every_client``, ``first_clients(k)``, or any callable (the apps' rotating
  selector takes the same partitions in every defense's run).
- ``honest_targets`` picks, beside them, the honest clients whose real multi-step uploads are
  attacked too (``UploadAttack``).
- ``with_victim_config`` is the server's one active move: it sends the train config, so it may
  choose its victims' local hyperparameters (e.g. one local step on one sample, the easiest
  upload to invert). The replies themselves are never touched.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from flwr.app import ConfigRecord, RecordDict

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
    preferred = [n for n in select(server_round + 1, list(honest)) if n in set(honest)]
    ordered = preferred + sorted(n for n in honest if n not in set(preferred))
    return ordered[:upload_attack.clients]


def with_victim_config(content: RecordDict, values: Mapping[str, Any]) -> RecordDict:
    """A copy of a train message's content whose ConfigRecord(s) carry ``values`` on top.

    Strategies often send one shared RecordDict to every node; the victim gets its own.
    """
    copy = RecordDict({name: record for name, record in content.array_records.items()})
    for name, record in content.config_records.items():
        copy[name] = ConfigRecord({**dict(record), **dict(values)})
    for name, record in content.metric_records.items():
        copy[name] = record
    return copy
