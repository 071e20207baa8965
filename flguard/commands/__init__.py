"""CLI subcommands, one module each; ``register_all`` attaches them to the typer app."""

from __future__ import annotations

import typer


def register_all(app: typer.Typer) -> None:
    """Attach every available subcommand to ``app``."""
    from flguard.commands import audit

    audit.register(app)
