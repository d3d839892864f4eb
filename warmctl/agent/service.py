"""What the agent's routes share: :class:`AgentState` (settings, jobs, metrics, readiness,
the restart supervisor, cached engine status) and the operations that start jobs.

One :class:`AgentState` per app, in ``app.state.agent``; routes get it with the
:func:`warmctl.agent.deps.get_agent` dependency. Nothing here knows about HTTP beyond
raising :class:`~.errors.ApiError` for a conflict or a missing object."""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, cast

from warmctl.pipelines import lifecycle
from warmctl.records.config import Settings
from warmctl.records.contract import UpOptions, UpRequest
from warmctl.base.errors import WarmctlError

from .errors import ApiError
from .jobs import Conflict, Job, JobManager, JobReporter, PhaseRecord
from .metrics import Metrics
from .models import EngineView, LazyCopy
from .recovery import RecoveryReport, recover
from .supervise import Supervisor

#: seconds an engine status answer is fresh (see :meth:`AgentState.engine_status`)
STATUS_TTL_S = 0.5
#: seconds a caller waits for the first engine status when none was taken yet
STATUS_FIRST_WAIT_S = 10.0
#: seconds the host fingerprint (``GET /v1/host``) is kept
HOST_TTL_S = 60.0


class AgentState:
    """What the app's handlers share: settings, the bearer token (``None``: no auth), jobs,
    metrics, readiness, the recovery report and the restart supervisor."""

    def __init__(self, settings: Settings, token: str | None, tls: bool):
        self.settings = settings
        self.token = token
        self.tls = tls
        self.started_at = time.time()
        self.jobs = JobManager(settings.home / "agent" / "jobs", on_finish=self._finished)
        self.metrics = Metrics(settings, self.jobs.counts)
        self.supervisor = Supervisor(settings.home / "agent" / "restart.json", dead=self._engine_dead,
                                     busy=lambda name: self.live_job(name) is not None, restart=self._restart)
        self.ready = False
        self.ready_detail = "starting: recovery not finished"
        self.recovery: RecoveryReport | None = None
        self._host_cache: tuple[float, dict] | None = None
        self._status_lock = threading.Lock()
        self._status_cache: tuple[float, list[lifecycle.EngineStatus]] | None = None
        self._status_gen = 0  # bumped by forget_status: a refresh started before is stale
        self._status_refreshing = False
        self._status_ready = threading.Event()

    # -- start-up ---------------------------------------------------------------------------

    def start(self) -> None:
        """Load jobs from disk, recover engines (see :mod:`.recovery`), become ready."""
        interrupted = self.jobs.load_from_disk()
        self.recovery = recover(self.settings, interrupted)
        for a in self.recovery.actions:
            self.metrics.recovered.labels(a.action).inc()
        self.ready = True
        self.ready_detail = "ready"

    # -- engine status ----------------------------------------------------------------------

    def engine_status(self) -> list[lifecycle.EngineStatus]:
        """:func:`warmctl.pipelines.lifecycle.status` of every engine (stale-while-revalidate).

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

    def host_fingerprint(self) -> dict[str, Any]:
        """This host's fingerprint as JSON (:func:`warmctl.host.fingerprint`), kept for
        :data:`HOST_TTL_S` seconds."""
        from warmctl.host import fingerprint

        now = time.monotonic()
        if self._host_cache is None or now - self._host_cache[0] > HOST_TTL_S:
            self._host_cache = (now, fingerprint(criu=self.settings.criu, image_digest=self.settings.image_digest).model_dump(mode="json"))
        return self._host_cache[1]

    # -- engines ----------------------------------------------------------------------------

    def live_job(self, name: str) -> Job | None:
        """The job working on engine ``name`` now, if any."""
        return self.jobs.holder(f"engine:{name}")

    def view(self, name: str, st: lifecycle.EngineStatus | None) -> EngineView:
        """Engine ``name`` as the API shows it: its recorded status ``st`` (None: nothing
        recorded) merged with the job working on it and its restart policy."""
        job = self.live_job(name)
        v = EngineView(name=name, phase="down", job=job.id if job else None,
                       job_phase=job.progress.phase if job else None, restart=self.supervisor.view(name))
        if st is not None:
            v.state, v.engine_alive, v.gate_alive, v.healthy = st.state, st.engine_alive, st.gate_alive, st.healthy
            v.shm_count, v.shm_bytes = st.shm_count, st.shm_bytes
            v.lazy_copy = cast(LazyCopy, st.lazy_copy)  # "running", "done" or None (lifecycle._lazy_copy)
            v.failure = st.failure or None
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

    def engine_names(self) -> list[str]:
        """Engines recorded on this host, those an ``up`` job is bringing up, and supervised ones."""
        rows = {r.state.name for r in self.engine_status()}
        return sorted(rows | {j.target for j in self.jobs.running() if j.kind == "up"}
                      | set(self.supervisor.policies))

    # -- jobs -------------------------------------------------------------------------------

    def submit(self, kind: str, target: str, resources: list[str], fn: Callable[[JobReporter, Job], dict],
               params: dict, reporter: Callable[[str], JobReporter] | None = None, join_same: bool = False) -> Job:
        """Submit a job; :class:`ApiError` 409 naming the holder on a conflict, except with
        ``join_same`` when the holder is the same request (kind, target, parameters): that job
        is answered instead, so a repeated request follows the one under way and gets its outcome."""
        try:
            return self.jobs.submit(kind, target, resources, fn, params, reporter)  # type: ignore[arg-type]
        except Conflict as e:
            h = e.holder
            if join_same and h is not None and (h.kind, h.target, h.params) == (kind, target, params):
                return h
            raise ApiError(409, "conflict", str(e), h.id if h else None) from None

    def start_up(self, name: str, req: UpOptions) -> Job:
        """Submit the job that brings engine ``name`` up (see ``POST /v1/engines/{name}/up``);
        409 (:class:`ApiError`) when another job or engine holds the engine or its ports."""
        public, internal = self._ports_for(name, req.port)
        self._port_conflict(name, public)
        resources = [f"engine:{name}"] + ([f"port:{public}"] if public else []) + (
            [f"port:{internal}"] if internal and internal != public else [])
        s, supervisor, metrics = self.settings, self.supervisor, self.metrics

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
                    metrics.canary.labels("pass" if ok else "fail").inc()
            return JobReporter(self.jobs, job_id, on_phase=on_phase, on_bytes=metrics.bytes_pulled.inc)

        return self.submit("up", name, resources, run, req.model_dump(), reporter, join_same=True)

    def start_down(self, name: str, now: bool) -> Job:
        """Submit the job that takes engine ``name`` down (see ``POST /v1/engines/{name}/down``)."""
        s, supervisor = self.settings, self.supervisor

        def run(rep: JobReporter, job: Job) -> dict:
            supervisor.forget(name)  # a down is wanted: never restarted
            with rep.phase("down", f"stopping {name}"):
                st = lifecycle.down(name, s, now=now)
            return {"was_up": st is not None, "state": st.model_dump(mode="json") if st else None}

        return self.submit("down", name, [f"engine:{name}"], run, {})

    def _port_conflict(self, name: str, port: int | None) -> None:
        if port is None:
            return
        for st in self.engine_status():
            if st.state.name != name and st.state.public_port == port and (st.engine_alive or st.gate_alive):
                raise ApiError(409, "conflict", f"port {port} is held by engine {st.state.name} "
                                                f"({st.state.phase}); choose another port or take it down first")

    def _ports_for(self, name: str, req_port: int | None) -> tuple[int | None, int | None]:
        """(public port, internal engine port) ``up name`` would use, when they can be known."""
        from warmctl.records.profile import Profile, ProfileError, load_profile

        s = self.settings
        prof = None
        try:
            prof = load_profile(name, s.profile_dirs)
        except (ProfileError, OSError):
            try:
                from warmctl.naming.catalog import Catalog
                from warmctl.store import open_store

                doc = Catalog(open_store(s.catalog_url, settings=s)).profile(name)
                if doc:
                    prof = Profile.model_validate(doc["profile"])
            except (WarmctlError, ValueError, OSError):
                prof = None
        public = req_port or s.gate_port or (prof.gate.port if prof else None)
        return public, (prof.engine.port if prof else None)

    # -- the supervisor's callbacks and the jobs' end ---------------------------------------

    def _engine_dead(self, name: str) -> bool:
        from warmctl.engine.run import EngineRun

        run = EngineRun.load(self.settings.run_dir, name)
        return run is None or not (run.alive() and run.gate is not None and run.gate.alive())

    def _restart(self, name: str, params: dict) -> str:
        job = self.start_up(name, UpOptions.model_validate(params))
        self.forget_status()
        return job.id

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


def _job_timings(phases: list[PhaseRecord]) -> dict[str, float]:
    now = time.time()
    return {p.name: (p.seconds if p.seconds is not None else now - p.started_at) for p in phases}
