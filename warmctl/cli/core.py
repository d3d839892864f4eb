"""CLI commands: core (registered on the root app by :func:`register`)."""

import typer

import warmctl


def register(app: typer.Typer) -> None:
    """Add this area's commands to ``app``."""

    @app.command()
    def version() -> None:
        """Print warmctl's version."""
        typer.echo(warmctl.__version__)
