"""``/v1/catalog`` (every catalog entry) and ``/v1/host`` (this host's fingerprint)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from ..deps import Agent, Protected
from ..errors import ERRORS

router = APIRouter(dependencies=Protected, responses=ERRORS)


@router.get("/v1/catalog", tags=["catalog"])
def catalog(agent: Agent) -> list[dict[str, Any]]:
    """Every catalog entry (name, tag, manifest, host fingerprint, signatures), as
    ``warmctl catalog ls --json`` prints them."""
    from warmctl.naming.catalog import Catalog
    from warmctl.store import open_store

    s = agent.settings
    return [e.model_dump(mode="json") for e in Catalog(open_store(s.catalog_url, settings=s)).all_entries()]


@router.get("/v1/host", tags=["host"])
def host(agent: Agent) -> dict[str, Any]:
    """This host's fingerprint (GPUs, driver, CPU, kernel, CRIU, engine), as
    ``warmctl host --json`` prints it. Cached for 60 s."""
    return agent.host_fingerprint()
