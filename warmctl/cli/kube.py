"""CLI commands for warmctl in Kubernetes: ``warmctl prewarm`` (the node pre-warm controller)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from warmctl.cli.output import JsonOpt

#: How the long-running commands log (``warmctl agent`` logs the same way).
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def register(app: typer.Typer) -> None:
    """Add this area's commands to ``app``."""

    @app.command()
    def prewarm(
        once: bool = typer.Option(False, "--once", help="One pass, then exit (tests, operators, a CronJob)."),
        node: Optional[str] = typer.Option(None, "--node", help="This node's name (default: node_name, WARMCTL_NODE_NAME)."),
        interval: Optional[float] = typer.Option(
            None, "--interval", help="Seconds between two passes (default: prewarm_interval_s, 60)."),
        config: Optional[Path] = typer.Option(None, "--config", help="Config file (default: $WARMCTL_CONFIG or /etc/warmctl/config.toml)."),
        json_out: bool = JsonOpt,
    ) -> None:
        """Keep the snapshots that WarmSnapshot objects name pulled on this node, and label it.

        For this node (node_name; its Node object's labels) and every WarmSnapshot whose
        spec.nodeSelector matches (empty: every node): pull spec.ref from spec.remote into the
        local store as `warmctl pull` does (signed by a trusted key, no rollback, every chunk
        verified; a second pass copies nothing), then label the Node
        `snapshot.warmctl.io/<WarmSnapshot name>=sha256-<40 hex of the manifest digest>` and
        write this node's entry (digest, cachedAt, or error) in the object's status.nodes. A
        failed pull writes the error and leaves no label. A WarmSnapshot deleted or no longer
        selecting this node: its label goes (the snapshot stays in the store for gc to decide).

        Runs until stopped: a pass at start, every --interval seconds, and at once when a
        WarmSnapshot is created, changed or deleted (a watch). The API server: kube_config
        (WARMCTL_KUBECONFIG), else the pod's service account. The node DaemonSet runs the same
        loop inside `warmctl agent --prewarm`. Progress and errors go to the log (stderr).
        `--once --json` prints one object per WarmSnapshot acted on (docs/cli-json.md).
        Exits 41 when the API server cannot be reached or refuses; a failed pull is a status
        entry, not an exit code.

        Example: `WARMCTL_NODE_NAME=node-1 warmctl prewarm --once`
        """
        import logging

        from warmctl.records.config import load_settings
        from warmctl.kube.prewarm import Prewarmer

        logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
        settings = load_settings(config, {"node_name": node, "prewarm_interval_s": interval})
        pw = Prewarmer(settings)
        if once:
            done = pw.pass_once()
            if json_out:
                from warmctl.cli.output import emit_json

                emit_json([o.to_dict() for o in done])
            return
        try:
            pw.run()
        except KeyboardInterrupt:
            pw.stop()
