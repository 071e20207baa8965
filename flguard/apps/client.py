"""The ClientApp of flguard's runs: local SGD on the simulated task, defenses from the run config.

The train handler runs ``flguard.simulation.task.handle_train`` (local SGD, ``guard_step`` on every
step); the defenses attach as mods from the same config: ``guard-<field>`` keys configure the guard
(``flguard.flower.guard_mod_from_run_config``), ``localdp-<field>`` keys Flower's own ``LocalDpMod``
(``flguard.simulation.localdp``). ``sim-truth-dir`` enables the simulation-only true-batch channel.
In your own app the guard is one line: ``ClientApp(mods=[guard_mod(config)])``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from flwr.app import Context, Message
from flwr.clientapp import ClientApp
from flwr.clientapp.typing import ClientAppCallable, Mod

from flguard.flower.guard_mod import guard_mod_from_run_config
from flguard.simulation import task
from flguard.simulation.localdp import localdp_mod_from_config
from flguard.simulation.truth import TRUTH_DIR_KEY


def config_mods(overrides: Mapping[str, Any] | None = None) -> list[Mod]:
    """The defenses the config asks for, outermost first: the guard, then Flower's LocalDpMod.

    Both are inert unless their keys are set (``guard-defense``; ``localdp-epsilon``).
    """
    return [_with_overrides(guard_mod_from_run_config(), overrides),
            _with_overrides(localdp_mod_from_config(), overrides)]


def _with_overrides(mod: Mod, overrides: Mapping[str, Any] | None) -> Mod:
    if not overrides:
        return mod

    def wrapped(message: Message, context: Context, call_next: ClientAppCallable) -> Message:
        view = Context(run_id=context.run_id, node_id=context.node_id, node_config=context.node_config,
                       state=context.state, run_config={**dict(context.run_config), **dict(overrides)})
        return mod(message, view, lambda m, _: call_next(m, context))

    return wrapped


def make_client_app(overrides: Mapping[str, Any] | None = None, mods: Sequence[Mod] | None = None) -> ClientApp:
    """A ClientApp whose settings are the run config updated by ``overrides``.

    ``mods=None`` attaches the defenses the config asks for (``config_mods``); pass a list to choose
    them yourself (``[]`` for none). ``overrides`` may enable the simulation-only true-batch channel
    with ``sim-truth-dir``.
    """
    overrides = dict(overrides or {})
    app = ClientApp(mods=config_mods(overrides) if mods is None else list(mods))

    @app.train()
    def train(message: Message, context: Context) -> Message:
        settings = task.settings_from(context, overrides)
        return task.handle_train(message, context, settings, truth_dir=overrides.get(TRUTH_DIR_KEY) or None)

    @app.evaluate()
    def evaluate(message: Message, context: Context) -> Message:
        return task.handle_evaluate(message, context, task.settings_from(context, overrides))

    @app.query()
    def query(message: Message, context: Context) -> Message:
        return task.handle_query(message, context, task.settings_from(context, overrides))

    return app
