"""CLI commands: ``warmctl agent`` (registered on the root app by :func:`register`)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer


def register(app: typer.Typer) -> None:
    """Add this area's commands to ``app``."""

    @app.command()
    def agent(
        host: Optional[str] = typer.Option(None, help="Address to listen on (default: agent_host, 127.0.0.1)."),
        port: Optional[int] = typer.Option(None, help="Port to listen on (default: agent_port, 7420)."),
        token_file: Optional[Path] = typer.Option(
            None, "--token-file",
            help="Bearer token file (default: agent_token_file, else HOME/agent/token, created if missing)."),
        tls_cert: Optional[Path] = typer.Option(None, "--tls-cert", help="PEM certificate: serve HTTPS."),
        tls_key: Optional[Path] = typer.Option(None, "--tls-key", help="PEM private key of --tls-cert."),
        config: Optional[Path] = typer.Option(None, "--config", help="Config file (default: $WARMCTL_CONFIG or /etc/warmctl/config.toml)."),
        insecure_no_tls: bool = typer.Option(
            False, "--insecure-no-tls",
            help="Listen beyond loopback without TLS anyway (the token crosses the network in clear text)."),
        prewarm: bool = typer.Option(
            False, "--prewarm",
            help="Also run the node pre-warm controller in a thread (`warmctl prewarm`; the node DaemonSet)."),
    ) -> None:
        """Run the agent: warmctl's operations over a REST API for schedulers (FastAPI on uvicorn).

        Serves `/v1` (engines up/down/status, snapshots, catalog, host, jobs with server-sent
        events), `/healthz`, `/readyz` and `/metrics`; every `/v1` call needs
        `Authorization: Bearer <token>`. At start it re-adopts engines still running and
        cleans up what an interrupted operation left, then tells systemd READY=1.
        See docs/operations.md.

        With `--prewarm` (the Kubernetes node DaemonSet, docs/kubernetes.md) it also keeps the
        snapshots that WarmSnapshot objects name pulled on this node (node_name) and labels the
        Node with them, as `warmctl prewarm` does, in a thread beside the API.

        Example: `warmctl agent --port 7420` then
        `curl -H "Authorization: Bearer $(cat /var/lib/warmctl/agent/token)" localhost:7420/v1/engines`
        """
        from warmctl.agent.server import AgentConfig, run
        from warmctl.records.config import load_settings

        settings = load_settings(config)
        if prewarm:
            import logging

            from warmctl.cli.kube import LOG_FORMAT
            from warmctl.kube.prewarm import Prewarmer

            logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
            Prewarmer(settings).start()  # refuses at once without node_name or cluster credentials
        run(AgentConfig.from_settings(settings, host=host, port=port, token_file=token_file,
                                      tls_cert=tls_cert, tls_key=tls_key, insecure_no_tls=insecure_no_tls or None))
