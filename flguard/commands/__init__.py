"""CLI subcommands, one module each; ``register_all`` attaches them to the typer app."""

from __future__ import annotations

import importlib

import typer

# Each module defines ``register(app)``; a module that does not exist yet is skipped.
COMMAND_MODULES = ("audit", "attack", "guard", "compare", "demo")


def register_all(app: typer.Typer) -> None:
    """Attach every available subcommand to ``app``."""
    for name in COMMAND_MODULES:
        module_name = f"{__name__}.{name}"
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as error:
            if error.name != module_name:
                raise
            continue
        module.register(app)
