"""The agent's REST API (FastAPI): :func:`create_app`.

Everything under ``/v1`` and ``/metrics`` needs ``Authorization: Bearer <token>`` (401
otherwise, answered before any body byte is read: :mod:`warmctl.agent.guard`); ``/healthz``,
``/readyz`` and ``/openapi.json`` do not (see docs/operations.md); request bodies are capped at
1 MiB (413). ``/docs`` and ``/redoc`` are not served (they load scripts from a public CDN).
Errors have one shape, :class:`ErrorBody`
(``{"error": code, "message": text, "holder": job id or null}``); request validation errors
are FastAPI's 422. Long operations answer ``202`` with the :class:`Job` (and a ``Location``
header); follow it with ``GET /v1/jobs/{id}`` or ``GET /v1/jobs/{id}/events`` (SSE).

Engine phases (``EngineView.phase``), the state machine a scheduler watches::

    down --up--> pending --> restoring --> health --> canary --> serving
                        \\--> starting (cold path) -----------/
    serving --down--> stopping --> down       any --error--> failed --> down
    serving --(engine or gate died)--> dead --down--> down
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import threading
import time
from typing import Any, Literal

from fastapi import Depends, FastAPI, Header, Path, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette.exceptions import HTTPException as StarletteHTTPException
from pydantic import BaseModel, Field, StrictBool

import warmctl
from warmctl import lifecycle
from warmctl.config import Settings
from warmctl.contract import UpOptions, UpRequest, UpResult
from warmctl import names
from warmctl.errors import WarmctlError
from warmctl.state import EngineState

from .guard import GuardedFastAPI, token_ok
from .jobs import Conflict, Event, Job, JobManager, JobReporter, PhaseRecord, dumps
from .metrics import Metrics
from .recovery import RecoveryReport, recover
from .supervise import Supervisor

NAME_PATTERN = TAG_PATTERN = names.NAME_PATTERN  # the one name rule, the CLI's too (warmctl.names)
JOB_PATTERN = r"^j-[0-9a-f]{12}$"
#: seconds an engine status answer is fresh (see :meth:`AgentState.engine_status`)
STATUS_TTL_S = 0.5
#: seconds a caller waits for the first engine status when none was taken yet
STATUS_FIRST_WAIT_S = 10.0
#: answered without a token: the probes (a kubelet/systemd/load balancer has no token) and
#: the API description (public: docs/openapi.json in the repository)
OPEN_PATHS = frozenset({"/healthz", "/readyz", "/openapi.json"})
#: ``Last-Event-ID``: the decimal ``seq`` of an event this agent sent
LAST_EVENT_ID_PATTERN = re.compile(r"^[0-9]{1,18}$")

EngineViewPhase = Literal["down", "pending", "starting", "restoring", "health", "canary", "serving",
                          "failed", "dead", "stopping"]


# ------------------------------------------------------------------------- models


class ErrorBody(BaseModel):
    """Every error answer: a short ``error`` code (``unauthorized``, ``not_found``,
    ``conflict``, ``unprocessable``), a message for the operator, and for ``conflict`` the id
    of the job that holds the engine or port (``null`` when an engine, not a job, holds it)."""

    error: str
    message: str
    holder: str | None = None


class SnapshotRequest(BaseModel):
    """Snapshot profile ``profile`` (a profile NAME the agent can find) as ``profile:tag``.
    Strict types, as :class:`~warmctl.contract.UpOptions`."""

    model_config = {"extra": "forbid", "strict": True}
    profile: str = Field(..., pattern=NAME_PATTERN)
    tag: str = Field("latest", pattern=TAG_PATTERN)
    #: publish to the remote store afterwards (default: when the agent has ``remote_store``)
    push: StrictBool | None = None


class EngineView(BaseModel):
    """One engine: ``phase`` (see the module doc), the recorded ``state`` (``null`` when
    nothing is recorded), whether its processes live and ``/health`` answers, the ``/dev/shm``
    files it holds (``shm_count``, ``shm_bytes``), the live job on it (``job``), and per-phase seconds (``timings``: the recorded ones once serving, else the
    running job's phases so far, the current one with its elapsed time)."""

    name: str
    phase: EngineViewPhase
    state: EngineState | None = None
    engine_alive: bool = False
    gate_alive: bool = False
    healthy: bool = False
    job: str | None = None
    job_phase: str | None = None
    timings: dict[str, float] = {}
    #: the restart policy: ``{"policy": "on-failure", "restarts", "limit", "next_at", "gave_up"}``
    #: (restarts within the last 10 minutes), or ``{"policy": "no", "gave_up": why}`` after the
    #: limit was reached; null when the engine is not supervised
    restart: dict[str, Any] | None = None
    #: ``/dev/shm`` files the engine holds and the bytes of memory they take
    shm_count: int = 0
    shm_bytes: int = 0
    #: a lazy restore's background copy of pages: ``running``, ``done``, or null (eager, cold)
    lazy_copy: Literal["running", "done"] | None = None
    #: why the gate took the engine down (its lazy-pages daemon died before the copy ended)
    failure: str | None = None


class SnapshotView(BaseModel):
    """A snapshot named in the local store's catalog (one per name, tag and kind of host);
    ``size`` in bytes, ``created`` ISO 8601, ``host`` the fingerprint's one-line summary."""

    name: str
    tag: str
    digest: str
    size: int
    created: str
    profile_digest: str
    host: str = ""
    #: False: made from another version of the profile on the agent's disk (``profile_changes``
    #: names the fields: ``{"field", "snapshot", "profile"}``); None: no such profile to compare
    profile_current: bool | None = None
    profile_changes: list[dict[str, Any]] = []
    #: the parallel layout and every rank (the manifest's ``restore.layout``: ``tp``, ``pp``,
    #: ``dp``, ``ep``, ``world_size``, ``ranks`` [``{rank, role, nspid, cpus, gpu}``], ...);
    #: null when the manifest records none or cannot be read
    layout: dict[str, Any] | None = None


class Deleted(BaseModel):
    """Result of a delete: the manifests ``name:tag`` named (one per kind of host) and the
    catalogs they were removed from; the data stays until ``warmctl gc``."""

    name: str
    tag: str
    digests: list[str]
    catalogs: list[str]


class AgentInfo(BaseModel):
    """The agent itself: version, PID, start time (Unix seconds), whether TLS is on, and
    what it did at start (``recovery``)."""

    version: str
    pid: int
    started_at: float
    tls: bool
    home: str
    recovery: RecoveryReport | None = None


class Health(BaseModel):
    status: str
    detail: str = ""


# ------------------------------------------------------------------------- errors


class ApiError(Exception):
    def __init__(self, status: int, code: str, message: str, holder: str | None = None):
        self.status, self.code, self.message, self.holder = status, code, message, holder


def _err(status: int, code: str, message: str, holder: str | None = None, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(ErrorBody(error=code, message=message, holder=holder).model_dump(), status_code=status,
                        headers=headers)


ERRORS: dict[int | str, dict[str, Any]] = {
    401: {"model": ErrorBody, "description": "Missing or wrong bearer token"},
}
NOT_FOUND = {404: {"model": ErrorBody, "description": "No such object"}}
CONFLICT = {409: {"model": ErrorBody, "description": "Another job holds the engine or port (named in `holder`)"}}


# ------------------------------------------------------------------------- app


class AgentState:
    """What the app's handlers share: settings, jobs, metrics, readiness, recovery report."""

    def __init__(self, settings: Settings, token: str | None, tls: bool):
        self.settings = settings
        self.token = token
        self.tls = tls
        self.started_at = time.time()
        self.jobs = JobManager(settings.home / "agent" / "jobs", on_finish=self._finished)
        self.metrics = Metrics(settings, self.jobs.counts)
        self.ready = False
        self.ready_detail = "starting: recovery not finished"
        self.recovery: RecoveryReport | None = None
        self._host_cache: tuple[float, dict] | None = None
        self._status_lock = threading.Lock()
        self._status_cache: tuple[float, list[lifecycle.EngineStatus]] | None = None
        self._status_gen = 0  # bumped by forget_status: a refresh started before is stale
        self._status_refreshing = False
        self._status_ready = threading.Event()

    def engine_status(self) -> list[lifecycle.EngineStatus]:
        """:func:`warmctl.lifecycle.status` of every engine (stale-while-revalidate).

        The answer is taken by one background thread at a time, never on the request's own
        time: ``lifecycle.status`` probes each engine's ``/health`` for up to 2 s, and a
        status storm (a scheduler fleet polling an engine whose ``/health`` hangs) must not
        hold the agent's worker threads (60 pollers starved ``/healthz``). A caller
        gets the last answer at once and, when it is older than :data:`STATUS_TTL_S`
        (stamped when the probes *finished*), starts one refresh; only when there is no
        answer yet (start, or after :meth:`forget_status`) does it wait for the refresh, up
        to :data:`STATUS_FIRST_WAIT_S`, and then gets the answer without probes
        (``healthy`` false) if the probes still hang."""
        with self._status_lock:
            c = self._status_cache
            if (c is None or time.monotonic() - c[0] > STATUS_TTL_S) and not self._status_refreshing:
                self._status_refreshing = True
                self._status_ready = threading.Event()
                threading.Thread(target=self._refresh_status, name="engine-status", daemon=True).start()
            if c is not None:
                return c[1]
            ready = self._status_ready
        ready.wait(STATUS_FIRST_WAIT_S)
        with self._status_lock:
            if self._status_cache is not None:
                return self._status_cache[1]
        return lifecycle.status(self.settings, probe=False)

    def _refresh_status(self) -> None:
        try:
            while True:
                with self._status_lock:
                    gen = self._status_gen
                try:
                    rows = lifecycle.status(self.settings)
                except Exception:  # noqa: BLE001 - keep the old answer; the next caller retries
                    rows = None
                with self._status_lock:
                    if self._status_gen != gen:
                        continue  # an engine changed while we probed: probe again
                    if rows is not None:
                        self._status_cache = (time.monotonic(), rows)
                    return
        finally:
            with self._status_lock:
                self._status_refreshing = False
                self._status_ready.set()

    def forget_status(self) -> None:
        """Drop the cached engine status (after a job changed an engine): the next caller
        waits for a fresh one."""
        with self._status_lock:
            self._status_cache = None
            self._status_gen += 1

    def _finished(self, job: Job) -> None:
        self.forget_status()
        m = self.metrics
        m.jobs_finished.labels(job.kind, job.state).inc()
        if job.kind == "up" and job.state == "succeeded" and job.result:
            timings = job.result.get("timings") or {}
            if job.result.get("already_up"):
                pass
            elif job.result.get("source") == "restore":
                for k, v in timings.items():
                    m.restore_phase.labels(k).observe(v)
            elif job.result.get("source") == "cold":
                m.cold_start.observe(sum(p.seconds or 0 for p in job.progress.phases))

    def start(self) -> None:
        """Load jobs from disk, recover engines (see :mod:`.recovery`), become ready."""
        interrupted = self.jobs.load_from_disk()
        self.recovery = recover(self.settings, interrupted)
        for a in self.recovery.actions:
            self.metrics.recovered.labels(a.action).inc()
        self.ready = True
        self.ready_detail = "ready"


def create_app(settings: Settings, token: str | None, *, tls: bool = False, run_startup: bool = True) -> FastAPI:
    """The agent's ASGI app over ``settings``.

    ``token``: the bearer token every ``/v1`` request must carry; ``None`` disables auth
    (only for generating the OpenAPI document). With ``run_startup`` the app's lifespan loads
    jobs and recovers engines (:meth:`AgentState.start`) before it serves.
    """
    agent = AgentState(settings, token, tls)

    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if run_startup:
            await asyncio.to_thread(agent.start)
            supervisor.start()
        yield
        supervisor.stop()

    bearer = HTTPBearer(auto_error=False, description="The token from the agent's token file")

    def _engine_dead(name: str) -> bool:
        from warmctl.engine.run import EngineRun

        run = EngineRun.load(s.run_dir, name)
        return run is None or not (run.alive() and run.gate is not None and run.gate.alive())

    def _restart(name: str, params: dict) -> str:
        resp = _start_up(name, UpOptions.model_validate(params))
        agent.forget_status()
        return json.loads(resp.body)["id"]

    supervisor = Supervisor(settings.home / "agent" / "restart.json", dead=_engine_dead,
                            busy=lambda name: _live_job(name) is not None, restart=_restart)
    agent.supervisor = supervisor

    def _check(header: str | None) -> None:
        # the guard (warmctl.agent.guard) already refused a request without the token before
        # its body was read; this repeats it per operation (and documents it in OpenAPI)
        if not token_ok(header, agent.token):
            raise ApiError(401, "unauthorized", "missing or wrong bearer token (Authorization: Bearer <token>)")

    def auth(request: Request, creds: HTTPAuthorizationCredentials | None = Depends(bearer)) -> None:
        """Per-operation auth (documents the bearer scheme in OpenAPI)."""
        _check(request.headers.get("authorization"))

    def auth_first(request: Request) -> None:
        """App-wide and first: a request without the token learns nothing, not even 422."""
        if request.url.path not in OPEN_PATHS:
            _check(request.headers.get("authorization"))

    def strict_query(request: Request) -> None:
        """Refuse query parameters the operation does not declare (a typo must not pass silently)."""
        route = request.scope.get("route")
        dependant = getattr(route, "dependant", None)
        if dependant is None or not request.query_params:
            return
        from fastapi.dependencies.utils import get_flat_dependant

        known = {q.alias for q in get_flat_dependant(dependant).query_params}
        unknown = sorted(set(request.query_params) - known)
        if unknown:
            raise ApiError(422, "unprocessable", f"unknown query parameter(s): {', '.join(unknown)[:200]}")

    app = GuardedFastAPI(
        dependencies=[Depends(auth_first), Depends(strict_query)],
        title="warmctl agent",
        version=warmctl.__version__,
        description=(__doc__ or "").split("\n\n", 1)[1] if __doc__ else "",
        lifespan=lifespan,
        docs_url=None,  # /docs and /redoc load scripts from a public CDN fleet nodes cannot reach
        redoc_url=None,
    )
    app.guard_token, app.guard_open_paths = token, OPEN_PATHS
    app.state.agent = agent
    _document_up_result(app)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, e: ApiError) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if e.status == 401 else None
        return _err(e.status, e.code, e.message, e.holder, headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        headers = dict(e.headers or {})
        if e.status_code == 405:  # Starlette lists only the first matching route's methods
            from starlette.routing import Match

            allowed: set[str] = set()
            for route in app.routes:
                match, _ = route.matches({**request.scope, "method": "GET"})
                if match != Match.NONE and getattr(route, "methods", None):
                    allowed |= set(route.methods) - {"HEAD"}
            headers["Allow"] = ", ".join(sorted(allowed))
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code, "http_error")
        return _err(e.status_code, code, str(e.detail), headers=headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, e: RequestValidationError) -> JSONResponse:
        msgs = "; ".join(f"{'.'.join(map(str, x['loc']))}: {x['msg']}" for x in e.errors())
        return _err(422, "unprocessable", msgs)

    v1: dict[str, Any] = dict(dependencies=[Depends(auth)], responses=ERRORS)
    s = settings

    # -- probes and metrics --------------------------------------------------------------

    @app.get("/healthz", response_model=Health, tags=["probes"])
    async def healthz() -> Health:
        """Liveness: the process serves HTTP. No auth. Answered on the event loop itself:
        it never waits for a worker thread or an engine probe."""
        return Health(status="ok")

    @app.get("/readyz", response_model=Health, tags=["probes"],
             responses={503: {"model": Health, "description": "Not ready (recovery running, home not writable)"}})
    async def readyz() -> Any:
        """Readiness: start-up recovery finished and the data directory is writable. No auth.
        Like ``/healthz``, on the event loop (one ``access(2)``, no engine probe)."""
        if not agent.ready:
            return JSONResponse(Health(status="starting", detail=agent.ready_detail).model_dump(), status_code=503)
        if not os.access(s.home, os.W_OK):
            return JSONResponse(Health(status="unready", detail=f"{s.home} is not writable").model_dump(),
                                status_code=503)
        return Health(status="ready")

    @app.get("/metrics", tags=["probes"], dependencies=[Depends(auth)], responses={
        **ERRORS, 200: {"content": {"text/plain": {"schema": {"type": "string"}}}, "description": "Prometheus text"}})
    def metrics() -> Response:
        """Prometheus metrics (see :mod:`warmctl.agent.metrics`). Needs the bearer token."""
        return Response(agent.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    # -- agent ---------------------------------------------------------------------------

    @app.get("/v1/agent", response_model=AgentInfo, tags=["agent"], **v1)
    def agent_info() -> AgentInfo:
        """Version, PID, start time, and the start-up recovery report (engines adopted or
        cleaned, jobs interrupted, orphaned /dev/shm files removed)."""
        return AgentInfo(version=warmctl.__version__, pid=os.getpid(), started_at=agent.started_at, tls=agent.tls,
                         home=str(s.home), recovery=agent.recovery)

    # -- engines ---------------------------------------------------------------------------

    def _live_job(name: str) -> Job | None:
        return agent.jobs.holder(f"engine:{name}")

    def _view(name: str, st: lifecycle.EngineStatus | None) -> EngineView:
        job = _live_job(name)
        v = EngineView(name=name, phase="down", job=job.id if job else None,
                       job_phase=job.progress.phase if job else None, restart=supervisor.view(name))
        if st is not None:
            v.state, v.engine_alive, v.gate_alive, v.healthy = st.state, st.engine_alive, st.gate_alive, st.healthy
            v.shm_count, v.shm_bytes = st.shm_count, st.shm_bytes
            v.lazy_copy, v.failure = st.lazy_copy, st.failure or None
            v.phase = st.state.phase
            if st.state.phase == "serving" and not (st.engine_alive and st.gate_alive):
                v.phase = "dead"
            v.timings = dict(st.state.timings)
        if job is not None:
            if job.kind == "down":
                v.phase = "stopping"
            elif job.kind == "up" and (st is None or st.state.phase != "serving"):
                if st is None:
                    v.phase = "pending"
                v.timings = _job_timings(job.progress.phases)
        return v

    @app.get("/v1/engines", response_model=list[EngineView], tags=["engines"], **v1)
    def engines() -> list[EngineView]:
        """Every engine recorded on this host, plus engines an ``up`` job is bringing up."""
        rows = {r.state.name: r for r in agent.engine_status()}
        names = set(rows) | {j.target for j in agent.jobs.running() if j.kind == "up"} | set(supervisor.policies)
        return [_view(n, rows.get(n)) for n in sorted(names)]

    @app.get("/v1/engines/{name}", response_model=EngineView, tags=["engines"], **v1)
    def engine(name: str = Path(..., pattern=NAME_PATTERN)) -> EngineView:
        """Engine ``name``: phase, processes, health, per-phase timings. ``phase`` is
        ``down`` when nothing is recorded and no job works on it."""
        rows = [r for r in agent.engine_status() if r.state.name == name]
        return _view(name, rows[0] if rows else None)

    def _submit(kind: str, target: str, resources: list[str], fn, params: dict, reporter=None,
                join_same: bool = False) -> JSONResponse:
        """Submit a job; 409 naming the holder on a conflict, except with ``join_same`` when the
        holder is the same request (kind, target, parameters): that job is answered instead, so
        a repeated request follows the one under way and gets its outcome."""
        try:
            job = agent.jobs.submit(kind, target, resources, fn, params, reporter)  # type: ignore[arg-type]
        except Conflict as e:
            h = e.holder
            if join_same and h is not None and (h.kind, h.target, h.params) == (kind, target, params):
                job = h
            else:
                raise ApiError(409, "conflict", str(e), h.id if h else None) from None
        return JSONResponse(job.model_dump(mode="json"), status_code=202, headers={"Location": f"/v1/jobs/{job.id}"})

    def _port_conflict(name: str, port: int | None) -> None:
        if port is None:
            return
        for st in agent.engine_status():
            if st.state.name != name and st.state.public_port == port and (st.engine_alive or st.gate_alive):
                raise ApiError(409, "conflict", f"port {port} is held by engine {st.state.name} "
                                                f"({st.state.phase}); choose another port or take it down first")

    def _ports_for(name: str, tag: str, req_port: int | None) -> tuple[int | None, int | None]:
        """(public port, internal engine port) ``up name`` would use, when they can be known."""
        from warmctl.profile import Profile, ProfileError, load_profile

        prof = None
        try:
            prof = load_profile(name, s.profile_dirs)
        except (ProfileError, OSError):
            try:
                from warmctl.catalog import Catalog
                from warmctl.store import open_store

                doc = Catalog(open_store(s.catalog_url, settings=s)).profile(name)
                if doc:
                    prof = Profile.model_validate(doc["profile"])
            except (WarmctlError, ValueError, OSError):
                prof = None
        public = req_port or s.gate_port or (prof.gate.port if prof else None)
        return public, (prof.engine.port if prof else None)

    @app.post("/v1/engines/{name}/up", status_code=202, response_model=Job, tags=["engines"],
              responses={**ERRORS, **CONFLICT}, dependencies=[Depends(auth)])
    def engine_up(req: UpOptions, name: str = Path(..., pattern=NAME_PATTERN)) -> Any:
        """Start a job that brings ``name`` up: restore ``name:tag`` behind the canary, or
        cold-start the profile ``name`` when no snapshot fits (the job's result says which
        and why). The same request while its job is under way answers that job (202: follow it
        for the outcome); 409 when another job works on this engine or its ports, naming it. An
        ``up`` of the same name started outside the agent (``warmctl up``, the boot unit) is
        waited for, then reported as already up or as its failure (:mod:`warmctl.enginelock`).
        With ``restart: on-failure`` the agent brings the engine up again when it dies. The job's
        ``result`` is ``up``'s JSON document (:meth:`warmctl.contract.UpResult.to_json`, the
        ``UpResult`` schema below; the same as ``warmctl up --json``); a failed job's ``error``
        is a ``Failure``."""
        return _start_up(name, req)

    def _start_up(name: str, req: UpOptions) -> JSONResponse:
        public, internal = _ports_for(name, req.tag, req.port)
        _port_conflict(name, public)
        resources = [f"engine:{name}"] + ([f"port:{public}"] if public else []) + (
            [f"port:{internal}"] if internal and internal != public else [])

        def run(rep: JobReporter, job: Job) -> dict:
            res = lifecycle.up(UpRequest.of(name, req), s, rep)
            if req.restart == "on-failure":
                supervisor.watch(name, req.model_dump(), req.restart_limit)
            elif not res.already_up:
                supervisor.forget(name)
            return res.to_json()

        def reporter(job_id: str) -> JobReporter:
            def on_phase(phase: str, secs: float, ok: bool) -> None:
                if phase == "canary":
                    agent.metrics.canary.labels("pass" if ok else "fail").inc()
            return JobReporter(agent.jobs, job_id, on_phase=on_phase, on_bytes=agent.metrics.bytes_pulled.inc)

        return _submit("up", name, resources, run, req.model_dump(), reporter, join_same=True)

    @app.post("/v1/engines/{name}/down", status_code=202, response_model=Job, tags=["engines"],
              responses={**ERRORS, **CONFLICT}, dependencies=[Depends(auth)])
    def engine_down(name: str = Path(..., pattern=NAME_PATTERN),
                    now: bool = Query(False, description="skip the drain: do not wait for in-flight requests")) -> Any:
        """Start a job that takes ``name`` down (public listener closed, in-flight requests
        given up to ``gate_drain_s`` unless ``now``, processes killed, /dev/shm files removed).
        Its result says ``was_up``: false when nothing was recorded. 409 while another job
        works on this engine."""

        def run(rep: JobReporter, job: Job) -> dict:
            supervisor.forget(name)  # a down is wanted: never restarted
            with rep.phase("down", f"stopping {name}"):
                st = lifecycle.down(name, s, now=now)
            return {"was_up": st is not None, "state": st.model_dump(mode="json") if st else None}

        return _submit("down", name, [f"engine:{name}"], run, {})

    # -- snapshots ------------------------------------------------------------------------

    @app.get("/v1/snapshots", response_model=list[SnapshotView], tags=["snapshots"], **v1)
    def snapshots() -> list[SnapshotView]:
        """Snapshots named in the local store's catalog (``warmctl ls``), each with whether it was
        made from the profile now on disk (``profile_current``) and, when not, which fields
        changed (``profile_changes``)."""
        from warmctl.fleet import snapshots as named
        from warmctl.host import HostFingerprint

        from warmctl.drift import DriftCache

        cache = DriftCache(s.profile_dirs)
        out = []
        for e, m in named(s):
            try:
                hs = HostFingerprint.model_validate(e.host).summary()
            except ValueError:
                hs = "(unreadable fingerprint)"
            d = cache.drift(e.name, e.profile_digest, m.profile if m else None)
            out.append(SnapshotView(name=e.name, tag=e.tag, digest=e.manifest, size=e.size, created=e.created.isoformat(),
                                    profile_digest=e.profile_digest, host=hs, profile_current=d.current,
                                    profile_changes=d.as_json()["changes"],
                                    layout=None if isinstance(m, str) or m.restore.layout is None
                                    else m.restore.layout.model_dump(mode="json")))
        return out

    @app.post("/v1/snapshots", status_code=202, response_model=Job, tags=["snapshots"],
              responses={**ERRORS, **CONFLICT}, dependencies=[Depends(auth)])
    def snapshot_create(req: SnapshotRequest) -> Any:
        """Start a job that snapshots profile ``profile`` (cold start, warm-up, canary, CRIU
        dump, store) as ``profile:tag`` and, with ``push`` (default: when the agent has a
        remote store), publishes it there. 409 while a job works on that engine or its port."""
        from warmctl.profile import ProfileError, load_profile

        try:
            prof = load_profile(req.profile, s.profile_dirs)
        except ProfileError as e:
            raise ApiError(404, "not_found", str(e)) from None
        resources = [f"engine:{prof.name}", f"port:{prof.engine.port}"]

        def run(rep: JobReporter, job: Job) -> dict:
            from warmctl.snapshot import snapshot as run_snapshot

            push_to = s.remote_store if req.push is not False else None
            if req.push and not push_to:
                raise WarmctlError("push: the agent has no remote store configured (remote_store)")
            res = run_snapshot(prof, s, rep, tag=req.tag, push_to=push_to)
            return {"name": prof.name, "tag": req.tag, "digest": res.digest, "size": res.size, "pushed_to": push_to}

        return _submit("snapshot", prof.name, resources, run, req.model_dump())

    @app.delete("/v1/snapshots/{name}/{tag}", response_model=Deleted, tags=["snapshots"],
                responses={**ERRORS, **NOT_FOUND, **CONFLICT}, dependencies=[Depends(auth)])
    def snapshot_delete(name: str = Path(..., pattern=NAME_PATTERN), tag: str = Path(..., pattern=TAG_PATTERN)) -> Deleted:
        """Remove ``name:tag`` from the catalog (``warmctl rm``): every kind of host's entry, in
        the local store and in the catalog ``up`` reads (the remote store on a fleet node), so
        no node's ``up`` finds it any more; the data stays until ``warmctl gc``. 404 when no
        catalog names it; 409 while a job works on engine ``name``."""
        from warmctl.fleet import remove_snapshot

        holder = agent.jobs.holder(f"engine:{name}")
        if holder is not None:
            raise ApiError(409, "conflict", str(Conflict(f"engine:{name}", holder)), holder.id)
        removed = remove_snapshot(s, name, tag)
        digests = sorted({d for ds in removed.values() for d in ds})
        if not digests:
            raise ApiError(404, "not_found", f"no snapshot {name}:{tag} in the catalog at {', '.join(removed)}")
        return Deleted(name=name, tag=tag, digests=digests, catalogs=[k for k, v in removed.items() if v])

    # -- catalog, host ----------------------------------------------------------------------

    @app.get("/v1/catalog", tags=["catalog"], **v1)
    def catalog() -> list[dict[str, Any]]:
        """Every catalog entry (name, tag, manifest, host fingerprint, signatures), as
        ``warmctl catalog ls --json`` prints them."""
        from warmctl.catalog import Catalog
        from warmctl.store import open_store

        return [e.model_dump(mode="json") for e in Catalog(open_store(s.catalog_url, settings=s)).all_entries()]

    @app.get("/v1/host", tags=["host"], **v1)
    def host() -> dict[str, Any]:
        """This host's fingerprint (GPUs, driver, CPU, kernel, CRIU, engine), as
        ``warmctl host --json`` prints it. Cached for 60 s."""
        from warmctl.host import fingerprint

        now = time.monotonic()
        if agent._host_cache is None or now - agent._host_cache[0] > 60:
            agent._host_cache = (now, fingerprint(criu=s.criu).model_dump(mode="json"))
        return agent._host_cache[1]

    # -- jobs ------------------------------------------------------------------------------

    @app.get("/v1/jobs", response_model=list[Job], tags=["jobs"], **v1)
    def jobs(state: Literal["queued", "running", "succeeded", "failed", "interrupted"] | None = None,
             limit: int = Query(50, ge=1, le=500), log_lines: int = Query(10, ge=0, le=500)) -> list[Job]:
        """Jobs, newest first (at most ``limit``; each with its last ``log_lines`` lines)."""
        out = [j for j in agent.jobs.list() if state is None or j.state == state][:limit]
        for j in out:
            j.log = j.log[len(j.log) - log_lines:] if log_lines else []
        return out

    @app.get("/v1/jobs/{job_id}", response_model=Job, tags=["jobs"], responses={**ERRORS, **NOT_FOUND},
             dependencies=[Depends(auth)])
    def job(job_id: str = Path(..., pattern=JOB_PATTERN), log_lines: int = Query(50, ge=0, le=500)) -> Job:
        """Job ``job_id``: state, progress (phases with seconds, bytes), the last ``log_lines``
        log lines, and the outcome (``result`` or ``error``)."""
        j = agent.jobs.get(job_id)
        if j is None:
            raise ApiError(404, "not_found", f"no job {job_id} (finished jobs are kept: the last 200)")
        j.log = j.log[len(j.log) - log_lines:] if log_lines else []
        return j

    @app.get("/v1/jobs/{job_id}/events", tags=["jobs"], dependencies=[Depends(auth)], responses={
        **ERRORS, **NOT_FOUND,
        200: {"content": {"text/event-stream": {"schema": {"type": "string"}}},
              "description": "Server-sent events: `id` = seq, `event` = type, `data` = JSON"}})
    async def job_events(request: Request, job_id: str = Path(..., pattern=JOB_PATTERN),
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
                if time.monotonic() - last_sent > 15:
                    yield b": keep-alive\n\n"
                    last_sent = time.monotonic()
                await asyncio.sleep(0.1)

        return StreamingResponse(stream(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    return app


def _document_up_result(app: FastAPI) -> None:
    """Add ``UpResult`` (an ``up`` job's ``result``, :class:`warmctl.contract.UpResult` as
    :meth:`~warmctl.contract.UpResult.to_json` writes it) and the models it refers to to the
    OpenAPI document's schemas: a job's ``result`` is typed by its kind, so no route names it."""
    from pydantic.json_schema import models_json_schema

    generate = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            doc = generate()
            _, defs = models_json_schema([(UpResult, "serialization")], ref_template="#/components/schemas/{model}")
            schemas = doc.setdefault("components", {}).setdefault("schemas", {})
            for k, v in defs.get("$defs", {}).items():
                schemas.setdefault(k, v)
        return app.openapi_schema  # type: ignore[return-value]

    app.openapi = openapi  # type: ignore[method-assign]


def _sse(e: Event) -> bytes:
    return f"id: {e.seq}\nevent: {e.type}\ndata: {dumps({**e.data, 'time': e.time})}\n\n".encode()


def _job_timings(phases: list[PhaseRecord]) -> dict[str, float]:
    now = time.time()
    return {p.name: (p.seconds if p.seconds is not None else now - p.started_at) for p in phases}
