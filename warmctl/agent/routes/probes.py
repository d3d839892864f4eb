"""``/healthz`` and ``/readyz`` (no token: a kubelet, systemd or a load balancer has none) and
``/metrics`` (Prometheus, with the token)."""

from __future__ import annotations

import os
from typing import Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response

from ..deps import Agent, Protected
from ..errors import ERRORS
from ..models import Health

router = APIRouter(tags=["probes"])


@router.get("/healthz", response_model=Health)
async def healthz() -> Health:
    """Liveness: the process serves HTTP. No auth. Answered on the event loop itself:
    it never waits for a worker thread or an engine probe."""
    return Health(status="ok")


@router.get("/readyz", response_model=Health,
            responses={503: {"model": Health, "description": "Not ready (recovery running, home not writable)"}})
async def readyz(agent: Agent) -> Any:
    """Readiness: start-up recovery finished and the data directory is writable. No auth.
    Like ``/healthz``, on the event loop (one ``access(2)``, no engine probe)."""
    if not agent.ready:
        return JSONResponse(Health(status="starting", detail=agent.ready_detail).model_dump(), status_code=503)
    home = agent.settings.home
    if not os.access(home, os.W_OK):
        return JSONResponse(Health(status="unready", detail=f"{home} is not writable").model_dump(), status_code=503)
    return Health(status="ready")


@router.get("/metrics", dependencies=Protected, responses={
    **ERRORS, 200: {"content": {"text/plain": {"schema": {"type": "string"}}}, "description": "Prometheus text"}})
def metrics(agent: Agent) -> Response:
    """Prometheus metrics (see :mod:`warmctl.agent.metrics`). Needs the bearer token."""
    return Response(agent.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")
