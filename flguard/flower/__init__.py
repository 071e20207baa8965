"""Flower integration, client side: the guard's client mod and wrappers, the shared FL task, the
client half of the truth channel.

- ``guard_mod(GuardConfig(...))`` + ``make_guarded(model, optimizer, criterion)`` (an unchanged
  ``loss.backward(); optimizer.step()`` loop) or ``guard_step(...)`` (hand-written loops): only
  guarded train updates leave the client
  (Message-API and ``client_fn`` apps; chains with Flower's LocalDpMod and SecAgg+ mods);
  ``GuardedNumPyClient`` does the same for a legacy ``NumPyClient``.
- ``flguard.flower.task``: model, client partitions, local SGD and record helpers the apps share.
- ``flguard.flower.truth``: ``record_batch``, the simulation-only channel leaving the true batch
  for the simulated server to score (a no-op in deployment).
- ``flguard.flower.apps``: the ClientApp and ServerApp every flguard run uses.

The malicious server lives in ``flguard.server``: importing this package loads no server code and
no attack (a test checks ``sys.modules``), so a client pays for — and exposes — only its guard.
"""

from flguard.guard_config import GuardConfig
from flguard.training import make_guarded
from flguard.flower.guard_mod import (
    GuardDropped,
    client_minimum,
    guard_config_from_run_config,
    guard_mod,
    guard_mod_from_run_config,
    guard_run_config,
    guard_step,
    round_metrics,
    weaker_fields,
)
from flguard.flower.numpy_client import GuardedNumPyClient, UnguardedUpdate
from flguard.flower.truth import TRUTH_DIR_KEY, TruthChannelRefused, in_simulation_runtime, record_batch

__all__ = [
    "GuardConfig",
    "make_guarded",
    "guard_mod",
    "guard_mod_from_run_config",
    "guard_run_config",
    "guard_config_from_run_config",
    "weaker_fields",
    "client_minimum",
    "guard_step",
    "GuardedNumPyClient",
    "UnguardedUpdate",
    "GuardDropped",
    "round_metrics",
    "TRUTH_DIR_KEY",
    "TruthChannelRefused",
    "in_simulation_runtime",
    "record_batch",
]
