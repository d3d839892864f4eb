"""CLI commands: bench (registered on the root app by :func:`register`)."""

import typer


def register(app: typer.Typer) -> None:
    """Add this area's commands to ``app``."""
