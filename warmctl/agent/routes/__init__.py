"""The agent's routes, one router per resource; :func:`~warmctl.agent.app.create_app` includes them.

=================  ==============================================================
:mod:`~.probes`    ``/healthz``, ``/readyz`` (no token), ``/metrics``
:mod:`~.info`      ``/v1/agent``
:mod:`~.engines`   ``/v1/engines``: list, one, ``up``, ``down``
:mod:`~.snapshots` ``/v1/snapshots``: list, create, delete
:mod:`~.catalog`   ``/v1/catalog``, ``/v1/host``
:mod:`~.jobs`      ``/v1/jobs``: list, one, its events (SSE)
=================  ==============================================================
"""

from . import catalog, engines, info, jobs, probes, snapshots

ROUTERS = [probes.router, info.router, engines.router, snapshots.router, catalog.router, jobs.router]

__all__ = ["ROUTERS"]
