"""``/v1/jobs``: long operations, their state, and their events as server-sent events."""

from __future__ import annotations

import asyncio
import re
import time
from typing import Any, Literal

from fastapi import APIRouter, Header, Path, Query, Request
from fastapi.responses import StreamingResponse

from warmctl.agent.jobs import Event, Job, dumps

from ..deps import Agent, Protected
from ..errors import ERRORS, NOT_FOUND, ApiError
from ..models import JOB_PATTERN

#: ``Last-Event-ID``: the decimal ``seq`` of an event this agent sent
LAST_EVENT_ID_PATTERN = re.compile(r"^[0-9]{1,18}$")
#: seconds without an event after which the stream sends a comment (keeps proxies from closing it)
KEEP_ALIVE_S = 15.0

router = APIRouter(tags=["jobs"], dependencies=Protected, responses=ERRORS)


@router.get("/v1/jobs", response_model=list[Job])
def jobs(agent: Agent, state: Literal["queued", "running", "succeeded", "failed", "interrupted"] | None = None,
         limit: int = Query(50, ge=1, le=500), log_lines: int = Query(10, ge=0, le=500)) -> list[Job]:
    """Jobs, newest first (at most ``limit``; each with its last ``log_lines`` lines)."""
    out = [j for j in agent.jobs.list() if state is None or j.state == state][:limit]
    for j in out:
        j.log = j.log[len(j.log) - log_lines:] if log_lines else []
    return out


@router.get("/v1/jobs/{job_id}", response_model=Job, responses=NOT_FOUND)
def job(agent: Agent, job_id: str = Path(..., pattern=JOB_PATTERN), log_lines: int = Query(50, ge=0, le=500)) -> Job:
    """Job ``job_id``: state, progress (phases with seconds, bytes), the last ``log_lines``
    log lines, and the outcome (``result`` or ``error``)."""
    j = agent.jobs.get(job_id)
    if j is None:
        raise ApiError(404, "not_found", f"no job {job_id} (finished jobs are kept: the last 200)")
    j.log = j.log[len(j.log) - log_lines:] if log_lines else []
    return j


@router.get("/v1/jobs/{job_id}/events", responses={
    **NOT_FOUND,
    200: {"content": {"text/event-stream": {"schema": {"type": "string"}}},
          "description": "Server-sent events: `id` = seq, `event` = type, `data` = JSON"}})
async def job_events(request: Request, agent: Agent, job_id: str = Path(..., pattern=JOB_PATTERN),
                     after: int = Query(0, ge=0, description="Send events with seq > after"),
                     last_event_id: str | None = Header(None, alias="Last-Event-ID")) -> Any:
    """Follow job ``job_id`` as server-sent events (``state``, ``phase_started``,
    ``phase_finished``, ``log``, ``progress``, then one ``end`` with the outcome, after
    which the stream closes). Resume with ``Last-Event-ID`` or ``?after=SEQ``."""
    if agent.jobs.get(job_id) is None:
        raise ApiError(404, "not_found", f"no job {job_id}")
    start = after
    if last_event_id is not None:
        if not LAST_EVENT_ID_PATTERN.match(last_event_id):
            raise ApiError(400, "bad_request", "Last-Event-ID must be the decimal id of an event of this stream "
                                               f"(got {len(last_event_id)} characters)")
        start = max(start, int(last_event_id))

    async def stream():
        seq = start
        last_sent = time.monotonic()
        while True:
            evs, ended = agent.jobs.events_since(job_id, seq, 0)
            for e in evs:
                seq = e.seq
                yield _sse(e)
                last_sent = time.monotonic()
            if ended and not evs:
                return
            if await request.is_disconnected():
                return
            if time.monotonic() - last_sent > KEEP_ALIVE_S:
                yield b": keep-alive\n\n"
                last_sent = time.monotonic()
            await asyncio.sleep(0.1)

    return StreamingResponse(stream(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def _sse(e: Event) -> bytes:
    return f"id: {e.seq}\nevent: {e.type}\ndata: {dumps({**e.data, 'time': e.time})}\n\n".encode()
