"""``/v1/agent``: the agent itself."""

from __future__ import annotations

import os

from fastapi import APIRouter

import warmctl

from ..deps import Agent, Protected
from ..errors import ERRORS
from ..models import AgentInfo

router = APIRouter(tags=["agent"], dependencies=Protected, responses=ERRORS)


@router.get("/v1/agent", response_model=AgentInfo)
def agent_info(agent: Agent) -> AgentInfo:
    """Version, PID, start time, and the start-up recovery report (engines adopted or
    cleaned, jobs interrupted, orphaned /dev/shm files removed)."""
    return AgentInfo(version=warmctl.__version__, pid=os.getpid(), started_at=agent.started_at, tls=agent.tls,
                     home=str(agent.settings.home), recovery=agent.recovery)
