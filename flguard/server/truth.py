"""The server half of the simulation-only true-batch channel: read what simulated clients left.

The channel exists only to *score* reconstructions in simulations (see ``flguard.simulation.truth``,
the client half, for why it cannot leak in deployment). ``TruthReader(directory, grid)`` refuses to
exist unless the ServerApp's grid is Flower's ``InMemoryGrid`` — only the simulation runtime
creates one — and then returns each (run, round, node)'s ``TrueBatch``, deleting the file by
default so that no private batch outlives the round it scores.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from flguard.simulation.truth import TruthChannelRefused, truth_path


@dataclass
class TrueBatch:
    """A client's true batch for one round, as its train handler recorded it."""

    inputs: torch.Tensor  # model input space, [N, C, H, W]
    labels: torch.Tensor  # [N]
    run_id: int
    server_round: int
    node_id: int
    partition_id: int


def is_simulation_grid(grid: Any) -> bool:
    """True when ``grid`` is the ``InMemoryGrid`` that only Flower's simulation runtime creates."""
    from flwr.superlink.grid import InMemoryGrid

    return isinstance(grid, InMemoryGrid)


class TruthReader:
    """Read (and by default delete) the true batches the simulated clients left."""

    def __init__(self, directory: str | os.PathLike[str], grid: Any, *, consume: bool = True) -> None:
        if not is_simulation_grid(grid):
            raise TruthChannelRefused(
                f"the true-batch channel needs Flower's simulation runtime (InMemoryGrid); got {type(grid).__name__}")
        self.directory = Path(directory)
        self.consume = consume

    def read(self, run_id: int, server_round: int, node_id: int) -> TrueBatch | None:
        """The batch node ``node_id`` trained on in ``server_round``, or None when none was left."""
        path = truth_path(self.directory, run_id, server_round, node_id)
        if not path.exists():
            return None
        payload = torch.load(path, map_location="cpu", weights_only=True)
        if self.consume:
            path.unlink(missing_ok=True)
        return TrueBatch(payload["inputs"], payload["labels"], int(payload["run_id"]),
                         int(payload["server_round"]), int(payload["node_id"]), int(payload["partition_id"]))
