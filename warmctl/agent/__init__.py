"""The warmctl agent: a daemon that serves warmctl's operations over a REST API.

- :func:`create_app` (``app``): the FastAPI app (``/v1`` engines, snapshots, catalog, host,
  jobs with SSE; ``/healthz``, ``/readyz``, ``/metrics``);
- :class:`AgentConfig` and :func:`run` (``server``): uvicorn, token file, TLS, systemd notify;
- ``jobs``: long operations in worker threads with progress, log, events and an outcome;
- ``recovery``: re-adopting engines and cleaning up after a crash;
- ``metrics``: Prometheus metrics.

Run it with ``warmctl agent``; see ``docs/operations.md``.
"""

from .app import create_app
from .server import AgentConfig, read_token, run, sd_notify

__all__ = ["AgentConfig", "create_app", "read_token", "run", "sd_notify"]
