"""The client half of the simulation-only channel that hands each client's true batch to the server.

Why it exists: to *score* a reconstruction (PSNR, SSIM, MSE) the simulated malicious server
needs the batch the client really trained on. A real server never has it — that is the whole
point of federated learning — so the channel must not exist in deployment.

How it works (files, never messages):

* Client side, ``record_batch(context, server_round, inputs, labels)`` is called by the train handler
  after local training. It writes ``<dir>/run-<run>/round-<r>/node-<node>.pt`` (inputs in model
  space, labels, partition id) — *only* when a directory is configured **and** the ClientApp is
  running inside Flower's simulation runtime (a Ray actor of the Simulation Engine). Otherwise it
  does nothing. The batch never enters a ``Message``, so nothing private is added to what
  travels to the server, aggregated or logged by Flower.
* Server side, ``flguard.server.truth.TruthReader(directory, grid)`` reads those files; it refuses
  to exist unless the ServerApp's grid is Flower's ``InMemoryGrid``, which only the simulation
  runtime uses. It lives with the server so that a client importing this module loads no server
  code; the two halves share ``truth_path`` and the payload keys written here.

Why it cannot leak in deployment: in deployment the ClientApp runs in a SuperNode (or a
``flwr-clientapp`` process), not in a simulation Ray actor, so ``record_batch`` writes nothing,
whatever the server puts into the run config; and even a file written by mistake would sit on
the client's own disk, which a remote server cannot read. Who enables the channel does not
matter for safety: the gate is a property of the client's own process.
"""

from __future__ import annotations

import logging
import os
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from flwr.app import Context

log = logging.getLogger(__name__)

# Run-config key naming the directory (set it only in simulation federations / tests).
TRUTH_DIR_KEY = "sim-truth-dir"
_CLIENT_ACTOR_CLASS = "ClientAppActor"  # flwr.simulation.ray_transport.ray_actor


class TruthChannelRefused(RuntimeError):
    """The true-batch channel was requested outside Flower's simulation runtime."""


def in_simulation_runtime() -> bool:
    """True only inside a Ray actor of Flower's Simulation Engine (where simulated ClientApps run).

    A deployment SuperNode runs ClientApps in its own process or a ``flwr-clientapp`` subprocess,
    never inside such an actor, and nothing a server sends can change that.
    """
    ray = sys.modules.get("ray")
    if ray is None:
        return False
    try:
        if not ray.is_initialized():
            return False
        runtime = ray.get_runtime_context()
        if runtime.get_actor_id() is None:
            return False
        actor = runtime.current_actor
        descriptor = getattr(actor, "_ray_actor_creation_function_descriptor", None)
        class_name = getattr(descriptor, "class_name", None)
        return class_name is None or str(class_name).endswith(_CLIENT_ACTOR_CLASS)
    except Exception:  # any doubt means "not simulation"
        return False


def truth_path(directory: str | os.PathLike[str], run_id: int, server_round: int, node_id: int) -> Path:
    """Where the true batch of (run, round, node) lives."""
    return Path(directory) / f"run-{int(run_id)}" / f"round-{int(server_round):04d}" / f"node-{int(node_id)}.pt"


def resolve_path(value: str | os.PathLike[str]) -> Path:
    """An absolute path for a run-config path: relative ones resolve against ``$FLGUARD_RUNS_DIR``
    (default ``~/flguard-runs``), because the ServerApp and the simulated ClientApps (Ray actors)
    do not share a working directory."""
    path = Path(value).expanduser()
    if path.is_absolute():
        return path
    return Path(os.environ.get("FLGUARD_RUNS_DIR", Path.home() / "flguard-runs")).expanduser() / path


def configured_directory(run_config: Mapping[str, Any] | None) -> Path | None:
    """The channel's directory from a run config, or None when the key is absent or empty."""
    value = (run_config or {}).get(TRUTH_DIR_KEY, "")
    return resolve_path(str(value)) if value else None


def record_batch(context: Context, server_round: int, inputs: torch.Tensor, labels: torch.Tensor,
                 *, directory: str | os.PathLike[str] | None = None) -> Path | None:
    """Client side: leave this round's true batch for the simulated server; returns the file or None.

    ``directory`` (client code) or the run-config key ``sim-truth-dir`` enables the channel.
    Outside the simulation runtime an explicit ``directory`` raises ``TruthChannelRefused`` (a
    programming error on the client's side) and a run-config key is ignored with a warning (a
    server must not be able to make a real client write its data anywhere).
    """
    explicit = directory is not None
    target = Path(directory) if explicit else configured_directory(context.run_config)
    if target is None:
        return None
    if not in_simulation_runtime():
        if explicit:
            raise TruthChannelRefused("the true-batch channel only exists in Flower's simulation runtime; "
                                      "this ClientApp is not running inside a simulated SuperNode")
        log.warning("run config sets %r but this ClientApp is not simulated: no batch is recorded", TRUTH_DIR_KEY)
        return None
    path = truth_path(target, context.run_id, server_round, context.node_id)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"inputs": inputs.detach().cpu(), "labels": labels.detach().cpu(), "run_id": int(context.run_id),
               "server_round": int(server_round), "node_id": int(context.node_id),
               "partition_id": int(context.node_config.get("partition-id", -1))}
    handle, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    os.close(handle)
    torch.save(payload, tmp)
    os.replace(tmp, path)  # atomic: the server never reads a half-written file
    return path
