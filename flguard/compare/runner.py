"""Run a comparison: one Flower simulation (Ray backend) per defense, then the merged tables and report.

Every defense's run uses ``flguard.apps`` through ``flwr.simulation.run_simulation`` — Flower's
own Simulation Engine — with the same seeds, partitions and initial model; only the defense's
run-config keys differ. A run writes ``DIR/runs/<defense>/`` and, last, its ``summary.json``; a run
directory whose summary matches the config is finished and is not redone (``resume``). A run that
was interrupted has no summary and is started again from scratch.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flguard.compare.config import CompareConfig, DefenseSpec
from flguard.apps import SUMMARY_FILE, make_client_app, make_server_app

RUNS_DIR = "runs"
# (defense name, event, payload): events "start", "round", "attack", "done", "skip".
ProgressHook = Callable[[str, str, Mapping[str, Any]], None]


@dataclass
class RunOutcome:
    """What one defense's run left behind."""

    name: str
    directory: Path
    skipped: bool
    seconds: float
    summary: dict[str, Any] = field(default_factory=dict)


def run_directory(out: Path, spec: DefenseSpec) -> Path:
    return Path(out) / RUNS_DIR / spec.name


def is_finished(config: CompareConfig, spec: DefenseSpec, directory: Path) -> bool:
    """A run is finished when its summary exists and was produced by this very defense config."""
    path = directory / SUMMARY_FILE
    if not path.exists():
        return False
    try:
        recorded = json.loads(path.read_text()).get("run_config", {})
    except (OSError, json.JSONDecodeError):
        return False
    return all(recorded.get(key) == value for key, value in config.run_config(spec).items())


def simulation_overrides(config: CompareConfig, spec: DefenseSpec, directory: Path) -> dict[str, Any]:
    """The defense's run config plus where this run writes (absolute paths: Ray workers' cwd differs)."""
    directory = directory.resolve()
    return {**config.run_config(spec), "out-dir": str(directory), "sim-truth-dir": str(directory / "truth")}


def backend_config(config: CompareConfig) -> dict[str, Any]:
    """One CPU per simulated client, as many at once as the machine has cores; GPUs are left to the attacks."""
    cpus = max(1, min(os.cpu_count() or 1, config.task.clients))
    return {"client_resources": {"num_cpus": 1, "num_gpus": 0.0},
            "init_args": {"num_cpus": cpus, "log_to_driver": False, "include_dashboard": False}}


def run_defense(config: CompareConfig, spec: DefenseSpec, out: Path, *, progress: ProgressHook | None = None,
                verbose: bool = False) -> RunOutcome:
    """Run one defense's federated training under attack through Flower's simulation engine."""
    from flwr.simulation import run_simulation

    directory = run_directory(out, spec)
    if directory.exists():
        shutil.rmtree(directory)  # an unfinished run: start it again
    directory.mkdir(parents=True)
    overrides = simulation_overrides(config, spec, directory)
    hook = (lambda event, payload: progress(spec.name, event, payload)) if progress else None
    if progress:
        progress(spec.name, "start", {"rounds": config.task.rounds})
    started = time.perf_counter()
    flwr_logger = logging.getLogger("flwr")
    level = flwr_logger.level
    if not verbose:
        flwr_logger.setLevel(logging.WARNING)
    try:
        run_simulation(server_app=make_server_app(overrides, on_event=hook), client_app=make_client_app(overrides),
                       num_supernodes=config.task.clients, backend_config=backend_config(config),
                       verbose_logging=verbose)
    finally:
        flwr_logger.setLevel(level)
        _shutdown_ray()
    seconds = time.perf_counter() - started
    summary_path = directory / SUMMARY_FILE
    if not summary_path.exists():
        raise RuntimeError(f"defense {spec.name!r}: the simulation ended without {summary_path}; "
                           "rerun with --verbose to see Flower's log")
    summary = json.loads(summary_path.read_text())
    shutil.rmtree(directory / "truth", ignore_errors=True)
    if progress:
        progress(spec.name, "done", {"seconds": seconds})
    return RunOutcome(spec.name, directory, False, seconds, summary)


def attack_threads(config: CompareConfig) -> int:
    """CPU threads for the server's attacks: the cores the simulated clients leave free, at least one.

    Why: the attacks share the machine with one Ray worker per core; more intra-op threads than free
    cores make torch's threads wait on each other (seen on 2 busy cores: 45–133 s per GS attack
    that takes ~7 s on one free thread).
    """
    cores = os.cpu_count() or 1
    return max(1, cores - min(cores, config.task.clients))


def run_comparison(config: CompareConfig, out: Path, *, resume: bool = True, progress: ProgressHook | None = None,
                   verbose: bool = False, only: list[str] | None = None) -> list[RunOutcome]:
    """Run every defense (or those in ``only``), skipping finished runs when ``resume``."""
    import torch

    torch.set_num_threads(attack_threads(config))
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    outcomes = []
    for spec in config.defenses:
        if only and spec.name not in only:
            continue
        directory = run_directory(out, spec)
        if resume and is_finished(config, spec, directory):
            summary = json.loads((directory / SUMMARY_FILE).read_text())
            if progress:
                progress(spec.name, "skip", {"seconds": summary.get("seconds", 0.0)})
            outcomes.append(RunOutcome(spec.name, directory, True, float(summary.get("seconds", 0.0)), summary))
            continue
        outcomes.append(run_defense(config, spec, out, progress=progress, verbose=verbose))
    return outcomes


def _shutdown_ray() -> None:
    import sys

    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()
