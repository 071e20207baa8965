"""``flguard compare CONFIG --out DIR``: every defense through a Flower simulation, attacked each round."""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path
from typing import Any, Mapping

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table


class _DropDeprecation(logging.Filter):
    """``run_simulation`` is Flower's in-process Simulation Engine entry point; its deprecation notice
    (in favour of ``flwr run``, which runs the same engine) is noise in a progress display."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "DEPRECATED FEATURE" not in record.getMessage()


def _quiet_library_notices() -> None:
    """Library notices about their own future versions (Ray's GPU env-var tip, torch.jit's
    deprecation inside torchvision) say nothing about the comparison; errors still show."""
    import os
    import warnings

    os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"(ray|torch)\.")


def _event_line(name: str, event: str, payload: Mapping[str, Any], rounds: int) -> str:
    if event == "round":
        acc = payload.get("metrics", {}).get("eval-acc")
        return f"{name}: round {payload['round']}/{rounds} done" + (f", accuracy {acc:.3f}" if acc is not None else "")
    if event == "attack":
        psnr, kind = payload.get("psnr"), payload.get("attack_target")
        kind = {"fedavg-upload": ", real upload", "fishing": f", fished class {payload.get('fished_class')}"}.get(kind, "")
        return (f"{name}: attack on round {payload.get('round')} ({payload.get('method')}{kind}): "
                + (f"PSNR {psnr:.1f} dB" if psnr is not None else str(payload.get("status"))))
    return f"{name}: {event}" + (f" ({payload['seconds']:.0f} s)" if "seconds" in payload else "")


def _fmt(value: Any, spec: str) -> str:
    return "–" if value is None else format(value, spec)


def summary_table(summaries: list[dict[str, Any]], title: str) -> Table:
    """The one-screen summary printed at the end of a comparison."""
    table = Table(title=title)
    for column in ("defense", "final acc", "best PSNR dB", "median PSNR dB", "RMSE ≥ τ", "withheld",
                   "left out", "mean ‖δ‖/‖g‖", "guard/train time", "run s"):
        table.add_column(column, justify="right")
    for s in summaries:
        share = None if s["tau_met_share"] is None else 100 * s["tau_met_share"]
        left_out = s.get("excluded_share")
        table.add_row(s["defense"], _fmt(s["final_accuracy"], ".3f"), _fmt(s["attack_psnr_best"], ".1f"),
                      _fmt(s["attack_psnr_median"], ".1f"),
                      "–" if share is None else f"{math.floor(10 * share) / 10:g}% (τ={s['tau']:.3g})",
                      f"{s['dropped_updates']}", "–" if left_out is None else f"{100 * left_out:.1f}%",
                      _fmt(s["mean_rel_noise"], ".3g"),
                      _fmt(s["guard_overhead"], ".0f") + ("×" if s["guard_overhead"] is not None else ""),
                      _fmt(s["run_seconds"], ".0f"))
    return table


def _load(config_path: Path, seed: int | None):
    """The comparison config, its ``seed`` replaced when one is given (a repeat of the same study)."""
    from flguard.compare.config import load_config

    config = load_config(config_path)
    return config if seed is None else config.model_copy(update={"seed": seed})


def run_and_report(config_path: Path, out: Path, *, resume: bool, verbose: bool, only: list[str] | None,
                   console: Console, seed: int | None = None) -> None:
    """Run (or resume) the comparison, merge the tables, write the report, print the summary; ``seed``
    replaces the config's (the copy written to OUT says so)."""
    from flguard.compare.classes import write_class_risk
    from flguard.compare.report import write_report
    from flguard.compare.runner import run_comparison
    from flguard.compare.tables import build_tables

    config = _load(config_path, seed)
    out.mkdir(parents=True, exist_ok=True)
    text = Path(config_path).read_text(encoding="utf-8")
    note = "" if seed is None else f"# run with `flguard compare --seed {seed}`: seed = {seed}, whatever the file says\n"
    (out / "config.toml").write_text(note + text, encoding="utf-8")
    started = time.perf_counter()
    logging.getLogger("flwr").addFilter(_DropDeprecation())
    _quiet_library_notices()
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[note]}"),
                  TimeElapsedColumn(), console=console, transient=False) as progress:
        tasks: dict[str, Any] = {}
        attacks: dict[str, int] = {}

        def on_progress(name: str, event: str, payload: Mapping[str, Any]) -> None:
            if name not in tasks:
                tasks[name] = progress.add_task(f"{name:>14} rounds", total=config.task.rounds, note="")
            task_id = tasks[name]
            if not console.is_terminal:  # logs and CI: one line per event instead of a live bar
                console.print(_event_line(name, event, payload, config.task.rounds))
            if event == "round":
                progress.update(task_id, completed=payload["round"])
            elif event == "attack":
                attacks[name] = attacks.get(name, 0) + 1
                psnr = payload.get("psnr")
                note = f"attacks {attacks[name]}" + (f", last PSNR {psnr:.1f} dB" if psnr is not None else "")
                progress.update(task_id, note=note)
            elif event == "skip":
                progress.update(task_id, completed=config.task.rounds, note="finished earlier (resumed)")
            elif event == "done":
                progress.update(task_id, completed=config.task.rounds)

        run_comparison(config, out, resume=resume, progress=on_progress, verbose=verbose, only=only)
    with console.status("per-class risk, tables and report"):
        write_class_risk(config, out)
        _, summaries = build_tables(config, out)
        report = write_report(out, title=config.name)
    console.print(summary_table(summaries, f"{config.name}: {config.task.model} on {config.task.dataset}, "
                                           f"{config.task.clients} clients, {config.task.rounds} rounds, "
                                           f"{config.attack.method.upper()} attack"))
    console.print(f"Wrote {out / 'rounds.csv'}, {out / 'summary.csv'} and {report} "
                  f"in {time.perf_counter() - started:.0f} s.")


def compare_command(
    config: Path = typer.Argument(..., exists=True, dir_okay=False, help="Comparison TOML (see docs/configuration.md)."),
    out: Path = typer.Option(Path("compare-out"), help="Output directory (rounds.csv, summary.csv, report.html)."),
    resume: bool = typer.Option(True, help="Keep finished defense runs found in OUT (--no-resume reruns all)."),
    only: list[str] = typer.Option(None, help="Run only these defenses (repeatable)."),
    run_config: str = typer.Option(None, help="Print the `flwr run --run-config` string of this defense for the "
                                             "deployment engine, and exit."),
    verbose: bool = typer.Option(False, help="Show Flower's own log."),
    seed: int = typer.Option(None, help="Replace the config's seed (partitions, initial model, attacks, noise): "
                                        "the same study repeated."),
) -> None:
    """Train under every configured defense, attacked each round by a simulated malicious server; report."""
    from flguard.compare.config import run_config_string
    from flguard.compare.runner import run_directory, simulation_overrides
    from flguard.config import ConfigError

    console = Console(width=None if Console().is_terminal else 140)
    try:
        if run_config:
            cfg = _load(config, seed)
            spec = cfg.defense(run_config)
            overrides = simulation_overrides(cfg, spec, run_directory(out, spec))
            overrides.pop("sim-truth-dir")  # no true-batch channel outside simulations
            typer.echo(run_config_string(overrides))
            return
        run_and_report(config, out, resume=resume, verbose=verbose, only=only or None, console=console, seed=seed)
    except ConfigError as error:
        console.print(f"[red]configuration error[/red]\n{error}")
        raise typer.Exit(2) from None


def register(app: typer.Typer) -> None:
    app.command("compare")(compare_command)
