"""``/v1/engines``: the engines of this host, and the jobs that bring them up and down."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Path, Query

from warmctl.records.contract import UpOptions
from warmctl.agent.jobs import Job

from ..deps import Agent, Protected
from ..errors import CONFLICT, ERRORS, accepted
from ..models import NAME_PATTERN, EngineView

router = APIRouter(tags=["engines"], dependencies=Protected, responses=ERRORS)


@router.get("/v1/engines", response_model=list[EngineView])
def engines(agent: Agent) -> list[EngineView]:
    """Every engine recorded on this host, plus engines an ``up`` job is bringing up."""
    rows = {r.state.name: r for r in agent.engine_status()}
    return [agent.view(n, rows.get(n)) for n in agent.engine_names()]


@router.get("/v1/engines/{name}", response_model=EngineView)
def engine(agent: Agent, name: str = Path(..., pattern=NAME_PATTERN)) -> EngineView:
    """Engine ``name``: phase, processes, health, per-phase timings. ``phase`` is
    ``down`` when nothing is recorded and no job works on it."""
    rows = [r for r in agent.engine_status() if r.state.name == name]
    return agent.view(name, rows[0] if rows else None)


@router.post("/v1/engines/{name}/up", status_code=202, response_model=Job, responses=CONFLICT)
def engine_up(req: UpOptions, agent: Agent, name: str = Path(..., pattern=NAME_PATTERN)) -> Any:
    """Start a job that brings ``name`` up: restore ``name:tag`` behind the canary, or
    cold-start the profile ``name`` when no snapshot fits (the job's result says which
    and why). The same request while its job is under way answers that job (202: follow it
    for the outcome); 409 when another job works on this engine or its ports, naming it. An
    ``up`` of the same name started outside the agent (``warmctl up``, the boot unit) is
    waited for, then reported as already up or as its failure (:mod:`warmctl.records.enginelock`).
    With ``restart: on-failure`` the agent brings the engine up again when it dies. The job's
    ``result`` is ``up``'s JSON document (:meth:`warmctl.records.contract.UpResult.to_json`, the
    ``UpResult`` schema below; the same as ``warmctl up --json``); a failed job's ``error``
    is a ``Failure``."""
    return accepted(agent.start_up(name, req))


@router.post("/v1/engines/{name}/down", status_code=202, response_model=Job, responses=CONFLICT)
def engine_down(agent: Agent, name: str = Path(..., pattern=NAME_PATTERN),
                now: bool = Query(False, description="skip the drain: do not wait for in-flight requests")) -> Any:
    """Start a job that takes ``name`` down (public listener closed, in-flight requests
    given up to ``gate_drain_s`` unless ``now``, processes killed, /dev/shm files removed).
    Its result says ``was_up``: false when nothing was recorded. 409 while another job
    works on this engine."""
    return accepted(agent.start_down(name, now))
