"""CLI subcommands, one module each; ``register_all`` attaches them to the typer app."""

from __future__ import annotations

import importlib

import typer

# Each module defines ``register(app)``.
COMMAND_MODULES = ("audit", "attack", "compare", "demo")


def register_all(app: typer.Typer) -> None:
    """Attach every subcommand to ``app``."""
    for name in COMMAND_MODULES:
        importlib.import_module(f"{__name__}.{name}").register(app)
