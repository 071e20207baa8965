"""The Flower apps of flguard's own runs: the simulation's ClientApp and ServerApp, above both sides.

``make_client_app`` (``client``) and ``make_server_app`` (``server``) read one run config
(``[tool.flwr.app.config]`` of ``simulations/pyproject.toml``, a ``flwr run --run-config`` string, or
the ``overrides`` mapping that in-process simulations pass, because ``flwr.simulation.run_simulation``
has no run config). ``simulations/flguard_sim`` is a thin Flower App project over these factories,
and ``flguard compare`` runs them once per defense.

This package sits on top: it imports the client side (``flguard.flower``), the simulated task
(``flguard.simulation``) and the malicious server (``flguard.server``); none of them imports it.
A deployed client uses ``flguard.flower`` in its own ClientApp and never loads this package.
"""

_CLIENT = ("make_client_app", "config_mods")
_SERVER = ("make_server_app", "ServerSettings", "LoggedFedAvg", "build_strategy", "run_server", "attack_specs",
           "SUMMARY_FILE", "ATTACK_HP_PREFIX")

__all__ = [*_CLIENT, *_SERVER]


def __getattr__(name: str):
    # Lazy: a simulated ClientApp (one per Ray actor) imports ``flguard.apps.client`` and need not
    # load the server, the attacks and their dependencies.
    if name in _CLIENT:
        from flguard.apps import client

        return getattr(client, name)
    if name in _SERVER:
        from flguard.apps import server

        return getattr(server, name)
    raise AttributeError(name)
