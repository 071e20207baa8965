"""Flower integration, client side: the guard's client mod and wrappers — all a deployed client imports.

- ``guard_mod(GuardConfig(...))`` + ``make_guarded(model, optimizer, criterion)`` (an unchanged
  ``loss.backward(); optimizer.step()`` loop) or ``guard_step(...)`` (hand-written loops): only
  guarded train updates leave the client
  (Message-API and ``client_fn`` apps; chains with Flower's LocalDpMod and SecAgg+ mods);
  ``GuardedNumPyClient`` does the same for a legacy ``NumPyClient``.
- ``guard_mod_from_run_config``: the same mod configured from ``guard-<field>`` run-config keys.

Nothing of the simulation is on this path: the shared FL task and the channel that records a
client's true batch for scoring live in ``flguard.simulation``, the ClientApp and ServerApp of
flguard's own runs in ``flguard.apps``, the malicious server in ``flguard.server``. Importing this
package loads none of them, nor any attack (a test checks ``sys.modules`` in a fresh interpreter).
"""

from flguard.guard.config import GuardConfig
from flguard.guard.training import make_guarded
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
]
