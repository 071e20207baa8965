"""The ClientApp: FedSGD (one local SGD step) or K local steps on this node's MNIST-5k partition.

A guard (or any Flower mod) is one line away: ``app = make_client_app(mods=[guard_mod])`` for every
handler, or ``@app.train(mods=[guard_mod])`` for the train handler only.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from flwr.app import Context, Message
from flwr.clientapp import ClientApp
from flwr.clientapp.typing import Mod

from flguard.flower import guard_mod_from_run_config, task
from flguard.flower.truth import TRUTH_DIR_KEY


def make_client_app(overrides: Mapping[str, Any] | None = None, mods: Sequence[Mod] = ()) -> ClientApp:
    """A ClientApp whose settings are the run config updated by ``overrides``.

    ``overrides`` serves in-process simulations (``flwr.simulation.run_simulation`` has no run
    config); its ``sim-truth-dir`` enables the simulation-only true-batch channel explicitly.
    """
    overrides = dict(overrides or {})
    app = ClientApp(mods=list(mods))

    @app.train()
    def train(message: Message, context: Context) -> Message:
        settings = task.settings_from(context, overrides)
        return task.handle_train(message, context, settings, truth_dir=overrides.get(TRUTH_DIR_KEY) or None)

    @app.evaluate()
    def evaluate(message: Message, context: Context) -> Message:
        return task.handle_evaluate(message, context, task.settings_from(context, overrides))

    return app


# Guarded when the run config sets guard-defense (see [tool.flwr.app.config] in pyproject.toml).
app = make_client_app(mods=[guard_mod_from_run_config()])
