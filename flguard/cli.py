"""The ``flguard`` command line. Subcommands live in small modules and register here."""

from __future__ import annotations

import typer

from flguard import __version__

app = typer.Typer(
    name="flguard",
    help="Measure, limit and test gradient leakage of Flower clients (I2F, LAVP, guarded updates, inversion attacks).",
    no_args_is_help=True,
    add_completion=False,
)


@app.command()
def version() -> None:
    """Print flguard's version and the versions of the libraries it runs on."""
    import flwr
    import torch

    typer.echo(f"flguard {__version__} (torch {torch.__version__}, flwr {flwr.__version__})")


def _register_subcommands() -> None:
    # Imported here so that `flguard --help` stays fast and each command owns its module.
    from flguard.commands import register_all

    register_all(app)


_register_subcommands()

if __name__ == "__main__":  # pragma: no cover
    app()
