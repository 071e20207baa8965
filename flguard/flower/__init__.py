"""Flower integration: the guard's client mod, the malicious-server strategy wrapper, the shared FL
task, the truth channel.

- ``guard_mod(GuardConfig(...))`` + ``make_guarded(model, optimizer, criterion)`` (an unchanged
  ``loss.backward(); optimizer.step()`` loop) or ``guard_step(...)`` (hand-written loops): only
  guarded train updates leave the client
  (Message-API and ``client_fn`` apps; chains with Flower's LocalDpMod and SecAgg+ mods);
  ``GuardedNumPyClient`` does the same for a legacy ``NumPyClient``.

- ``MaliciousServer`` wraps any Flower 1.41 Message-API strategy and attacks the uploads it sees.
- ``flguard.flower.task``: model, client partitions, local SGD and record helpers the apps share.
- ``flguard.flower.truth``: the simulation-only channel giving the server the true batches to score.
"""

from flguard.guard_config import GuardConfig
from flguard.training import make_guarded
from flguard.flower.guard_mod import (
    GuardDropped,
    client_minimum,
    guard_mod,
    guard_mod_from_run_config,
    guard_step,
    round_metrics,
    weaker_fields,
)
from flguard.flower.numpy_client import GuardedNumPyClient, UnguardedUpdate
from flguard.flower.malicious import (
    AttackSpec,
    ClientUpdate,
    MaliciousServer,
    delta_to_gradient,
    every_client,
    first_clients,
)
from flguard.flower.scoring import save_grid, score_batch
from flguard.flower.truth import TRUTH_DIR_KEY, TruthChannelRefused, TruthReader, in_simulation_runtime, record_batch

__all__ = [
    "GuardConfig",
    "make_guarded",
    "guard_mod",
    "guard_mod_from_run_config",
    "weaker_fields",
    "client_minimum",
    "guard_step",
    "GuardedNumPyClient",
    "UnguardedUpdate",
    "GuardDropped",
    "round_metrics",
    "AttackSpec",
    "ClientUpdate",
    "MaliciousServer",
    "delta_to_gradient",
    "every_client",
    "first_clients",
    "score_batch",
    "save_grid",
    "TRUTH_DIR_KEY",
    "TruthChannelRefused",
    "TruthReader",
    "in_simulation_runtime",
    "record_batch",
]
