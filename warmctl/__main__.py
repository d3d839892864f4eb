"""``python -m warmctl`` runs the CLI."""

from warmctl.cli import main

main()
