"""The guard for legacy ``NumPyClient`` users (``flwr.client.NumPyClient``, Flower's compat layer).

    client = GuardedNumPyClient(MyClient(...), GuardConfig(defense="eigen", min_rmse=0.05))

``MyClient.fit`` calls ``flguard.flower.guard_step`` on each local step's gradients, exactly as a
Message-API train handler does. The wrapper opens the guard session around ``fit``, adds the
guard's metrics (fixed keys) to the returned metrics dict, and raises when the update was dropped
or never guarded — Flower then reports a failure for this client instead of an unguarded update.
Everything else delegates to the wrapped client.
"""

from __future__ import annotations

from typing import Any

from flwr.client import NumPyClient

from flguard.flower.guard_mod import round_metrics, session_problem
from flguard.guard import Guard
from flguard.guard.config import GuardConfig
from flguard.guard.session import open_session


class UnguardedUpdate(RuntimeError):
    """``fit`` produced an update without calling ``guard_step``: it must not be sent."""


class GuardedNumPyClient(NumPyClient):
    """Wraps a NumPyClient so that ``fit`` only returns guarded updates."""

    def __init__(self, client: NumPyClient, config: GuardConfig | None = None) -> None:
        self.client = client
        self.guard = Guard(config)

    def get_parameters(self, config: dict[str, Any]):
        return self.client.get_parameters(config)

    def get_properties(self, config: dict[str, Any]):
        return self.client.get_properties(config)

    def evaluate(self, parameters, config: dict[str, Any]):
        return self.client.evaluate(parameters, config)

    def fit(self, parameters, config: dict[str, Any]):
        with open_session(self.guard) as session:
            arrays, num_examples, metrics = self.client.fit(parameters, config)  # GuardFailure propagates
        problem = session_problem(session)
        if problem:
            raise UnguardedUpdate(problem)
        return arrays, num_examples, {**(metrics or {}), **round_metrics(session.reports)}
