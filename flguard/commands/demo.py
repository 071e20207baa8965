"""``flguard demo``: the main job — ``flguard compare`` with the shipped ``simulations/default.toml``."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console


def demo_command(
    out: Path = typer.Option(Path("flguard-demo"), help="Output directory (rounds.csv, summary.csv, report.html)."),
    resume: bool = typer.Option(True, help="Keep finished defense runs found in OUT (--no-resume reruns all)."),
    verbose: bool = typer.Option(False, help="Show Flower's own log."),
) -> None:
    """The quickstart CNN on MNIST-5k, 4 clients, a probing and fishing server: none, LocalDpMod, flguard's guards."""
    from flguard.commands.compare import run_and_report
    from flguard.compare.config import DEFAULT_CONFIG

    console = Console(width=None if Console().is_terminal else 140)
    if not DEFAULT_CONFIG.exists():
        raise typer.BadParameter(f"the demo config {DEFAULT_CONFIG} is missing; run from a clone of flguard "
                                 "(pip install -e .)")
    run_and_report(DEFAULT_CONFIG, out, resume=resume, verbose=verbose, only=None, console=console)


def register(app: typer.Typer) -> None:
    app.command("demo")(demo_command)
