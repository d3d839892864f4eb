"""Jobs: every long operation of the agent (up, down, snapshot) runs as a job.

A :class:`Job` has an id (``j-<12 hex>``), a kind, a target engine, a state
(``queued`` -> ``running`` -> ``succeeded`` | ``failed``; ``interrupted`` when the agent died
while it ran), progress (current phase, finished phases with seconds, bytes done/total), a
bounded log, an ordered list of events (what ``GET /v1/jobs/{id}/events`` streams) and an
outcome (``result`` on success, ``error`` = ``{type, message}`` on failure).

Jobs run in worker threads. Each job holds *resources* (``engine:NAME``, ``port:N``) for its
lifetime; :meth:`JobManager.submit` refuses a job whose resource another live job holds by
raising :class:`Conflict` naming the holder. Jobs are written to ``<home>/agent/jobs/ID.json``
at every state or phase change (atomic rename), so a restarted agent knows what was running.
"""

from __future__ import annotations

import builtins  # the method JobManager.list hides the builtin inside the class
import collections
import json
import logging
import os
import secrets
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Literal

from pydantic import BaseModel, Field

from warmctl.records.contract import Failure
from warmctl.base.errors import WarmctlError
from warmctl.base.private import private_dir, trusted, untrusted
from warmctl.records.progress import Reporter

JobState = Literal["queued", "running", "succeeded", "failed", "interrupted"]
JobKind = Literal["up", "down", "snapshot"]
LIVE_STATES = ("queued", "running")
log = logging.getLogger("warmctl.agent")
#: log lines kept per job (the tail served by the API)
LOG_LINES = 500
#: finished jobs kept in memory and on disk
KEEP_FINISHED = 200


class PhaseRecord(BaseModel):
    """One phase of a job: ``seconds`` is ``None`` while it runs; ``ok`` once it ended."""

    name: str
    desc: str = ""
    started_at: float
    seconds: float | None = None
    ok: bool | None = None


class Progress(BaseModel):
    """Where a job is: ``phase`` (running phase, or ``None``), the phases so far, and byte
    progress of the current transfer (``bytes_done``/``bytes_total``; 0 when none)."""

    phase: str | None = None
    phases: list[PhaseRecord] = []
    bytes_done: int = 0
    bytes_total: int = 0


#: Why a job failed (``{type, message, exit_code}``): the same :class:`~warmctl.records.contract.Failure`
#: a failed ``up`` reports everywhere else (``warmctl up --json``, the client).
JobError = Failure


#: Job ids: ``j-`` and 12 lower-case hex digits (:func:`new_id`); the file name is ``ID.json``.
JOB_ID_PATTERN = r"^j-[0-9a-f]{12}$"


class Job(BaseModel):
    """A long operation. Times are Unix seconds; ``log`` holds the last lines (newest last)."""

    id: str = Field(..., pattern=JOB_ID_PATTERN)
    kind: JobKind
    target: str
    params: dict[str, Any] = {}
    resources: list[str] = []
    state: JobState = "queued"
    created_at: float = Field(default_factory=time.time)
    started_at: float | None = None
    finished_at: float | None = None
    progress: Progress = Progress()
    log: list[str] = []
    result: dict[str, Any] | None = None
    error: JobError | None = None

    @property
    def live(self) -> bool:
        return self.state in LIVE_STATES


class Event(BaseModel):
    """One job event. ``seq`` counts from 1 per job (the SSE ``id``); ``type`` is ``state``,
    ``phase_started``, ``phase_finished``, ``log``, ``progress`` or ``end``."""

    seq: int
    type: str
    time: float
    data: dict[str, Any]


class Conflict(WarmctlError):
    """Another live job holds a resource the new job needs. ``holder`` is that job."""

    def __init__(self, resource: str, holder: Job | None, message: str | None = None):
        self.resource = resource
        self.holder = holder
        if message is None:
            assert holder is not None
            message = (f"{resource} is held by job {holder.id} ({holder.kind} {holder.target}, "
                       f"{holder.state}); wait for it or check GET /v1/jobs/{holder.id}")
        super().__init__(message)


@dataclass
class _Slot:
    job: Job
    events: list[Event]
    cond: threading.Condition
    last_write: float = 0.0


class JobReporter(Reporter):
    """A :class:`Reporter` that feeds a job's progress, log and events.

    ``on_phase(name, seconds, ok)`` (optional) is called when a phase ends (metrics hook);
    ``on_bytes(n)`` when ``n`` more bytes were transferred.
    """

    def __init__(self, manager: "JobManager", job_id: str,
                 on_phase: Callable[[str, float, bool], None] | None = None,
                 on_bytes: Callable[[int], None] | None = None) -> None:
        super().__init__()
        self.manager = manager
        self.job_id = job_id
        self.on_phase = on_phase
        self.on_bytes = on_bytes

    def started(self, name: str, desc: str) -> None:
        def f(job: Job) -> None:
            job.progress.phase = name
            job.progress.bytes_done = job.progress.bytes_total = 0
            job.progress.phases.append(PhaseRecord(name=name, desc=desc, started_at=time.time()))
            job.log.append(f"{name}: {desc}" if desc else name)
        self.manager._update(self.job_id, f, "phase_started", {"phase": name, "desc": desc}, persist=True)

    def finished(self, name: str, seconds: float, ok: bool) -> None:
        def f(job: Job) -> None:
            for p in reversed(job.progress.phases):
                if p.name == name and p.seconds is None:
                    p.seconds, p.ok = seconds, ok
                    break
            job.progress.phase = None
            job.log.append(f"{'ok' if ok else 'failed'} {name} {seconds:.2f} s")
        self.manager._update(self.job_id, f, "phase_finished", {"phase": name, "seconds": seconds, "ok": ok},
                             persist=True)
        if self.on_phase:
            self.on_phase(name, seconds, ok)

    def info(self, msg: str) -> None:
        self.manager._update(self.job_id, lambda job: job.log.append(msg), "log", {"line": msg})

    def bytes_progress(self, desc: str, total: int) -> Callable[[int], None]:
        self.manager._update(self.job_id, lambda job: setattr(job.progress, "bytes_total", total), None, {})
        last = [0.0]

        def advance(n: int) -> None:
            if self.on_bytes:
                self.on_bytes(n)
            now = time.monotonic()
            emit = now - last[0] >= 0.25
            if emit:
                last[0] = now

            def f(job: Job) -> None:
                job.progress.bytes_done += n
            self.manager._update(self.job_id, f, "progress" if emit else None,
                                 {"desc": desc, "bytes_total": total}, with_bytes=True)

        return advance


def new_id() -> str:
    return "j-" + secrets.token_hex(6)


class JobManager:
    """Runs jobs in threads, enforces resource exclusivity, keeps them on disk in ``jobs_dir``.

    ``on_finish(job)`` (optional) is called in the worker thread after a job ended (metrics).
    """

    def __init__(self, jobs_dir: Path, on_finish: Callable[[Job], None] | None = None) -> None:
        self.jobs_dir = Path(jobs_dir)
        private_dir(self.jobs_dir.parent)
        private_dir(self.jobs_dir)
        self._lock = threading.RLock()
        self._slots: dict[str, _Slot] = {}
        self._held: dict[str, str] = {}  # resource -> job id
        self.on_finish = on_finish
        self._threads: dict[str, threading.Thread] = {}

    # ---------------------------------------------------------------- persistence

    def _path(self, job_id: str) -> Path:
        return self.jobs_dir / f"{job_id}.json"

    def _write(self, job: Job) -> None:
        p = self._path(job.id)
        tmp = p.with_suffix(f".tmp{threading.get_ident()}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(job.model_dump_json())
        os.replace(tmp, p)

    def load_from_disk(self) -> list[Job]:
        """Load jobs written by an earlier agent process. Jobs that were queued or running are
        marked ``interrupted`` (and rewritten); returns those interrupted jobs.

        Only records this agent wrote are read: the jobs directory and each
        ``j-*.json`` must be real (no symbolic link), owned by the agent's user and not
        writable by others, the job's id must match :data:`JOB_ID_PATTERN` and its file be
        ``ID.json``. Anything else is logged and left untouched; the agent's own left-over
        temp files are removed."""
        interrupted = []
        jobs = []
        why = untrusted(self.jobs_dir, kind="dir")
        if why is not None:
            log.warning("jobs: %s is %s; no job loaded from it", self.jobs_dir, why)
            return []
        for p in sorted(self.jobs_dir.glob("j-*.json")):
            why = untrusted(p)
            if why is not None:
                log.warning("jobs: %s is %s; left untouched", p, why)
                continue
            try:
                job = Job.model_validate_json(p.read_text())
            except (OSError, ValueError) as e:
                log.warning("jobs: %s is not a job record (%s); left untouched", p, str(e).splitlines()[0][:200])
                continue
            if p.name != f"{job.id}.json":
                log.warning("jobs: %s holds job %r; left untouched", p, job.id[:40])
                continue
            jobs.append(job)
        for p in self.jobs_dir.glob("j-*.tmp*"):
            if trusted(p):
                p.unlink(missing_ok=True)
        jobs.sort(key=lambda j: j.created_at)
        with self._lock:
            for job in jobs:
                if job.live:
                    job.state = "interrupted"
                    job.finished_at = time.time()
                    job.error = JobError(type="Interrupted",
                                         message="the agent stopped while this job ran; see the agent's recovery report")
                    job.log.append("interrupted: the agent stopped while this job ran")
                    self._write(job)
                    interrupted.append(job)
                ev = [Event(seq=1, type="end", time=job.finished_at or job.created_at,
                            data={"state": job.state, "result": job.result,
                                  "error": job.error.model_dump() if job.error else None})]
                self._slots[job.id] = _Slot(job, ev, threading.Condition(self._lock))
            self._trim()
        return interrupted

    def _trim(self) -> None:
        done = [s.job for s in self._slots.values() if not s.job.live]
        done.sort(key=lambda j: j.created_at)
        for job in done[: max(0, len(done) - KEEP_FINISHED)]:
            del self._slots[job.id]
            self._path(job.id).unlink(missing_ok=True)

    # ---------------------------------------------------------------- queries

    def get(self, job_id: str) -> Job | None:
        """A copy of job ``job_id`` (safe to serialize while it runs), or ``None``."""
        with self._lock:
            s = self._slots.get(job_id)
            return s.job.model_copy(deep=True) if s else None

    def list(self) -> list[Job]:
        """Copies of every known job, newest first."""
        with self._lock:
            jobs = [s.job.model_copy(deep=True) for s in self._slots.values()]
        return sorted(jobs, key=lambda j: j.created_at, reverse=True)

    def holder(self, resource: str) -> Job | None:
        """The live job holding ``resource`` (``engine:NAME``, ``port:N``), or ``None``."""
        with self._lock:
            jid = self._held.get(resource)
            return self._slots[jid].job.model_copy(deep=True) if jid else None

    def events_since(self, job_id: str, after: int, timeout: float) -> tuple[builtins.list[Event], bool]:
        """Events of ``job_id`` with ``seq > after``, waiting up to ``timeout`` seconds for one.
        Returns (events, ended). Raises KeyError for an unknown job."""
        with self._lock:
            s = self._slots[job_id]
            if timeout > 0 and not any(e.seq > after for e in s.events) and s.job.live:
                s.cond.wait(timeout)
            return [e for e in s.events if e.seq > after], not s.job.live

    def counts(self) -> dict[tuple[str, str], int]:
        """(kind, state) -> number of jobs known."""
        out: dict[tuple[str, str], int] = collections.Counter()
        with self._lock:
            for s in self._slots.values():
                out[(s.job.kind, s.job.state)] += 1
        return dict(out)

    # ---------------------------------------------------------------- running

    def submit(self, kind: JobKind, target: str, resources: builtins.list[str], fn: Callable[["JobReporter", Job], dict[str, Any] | None],
               params: dict[str, Any] | None = None,
               reporter_factory: Callable[[str], JobReporter] | None = None) -> Job:
        """Start ``fn(reporter, job)`` in a worker thread as a new job holding ``resources``.

        ``fn`` returns the job's ``result`` (a JSON-friendly dict). A :class:`WarmctlError` it
        raises becomes the job's ``error`` (type, message); any other exception too, with
        type ``InternalError`` and the traceback in the log. Raises :class:`Conflict` (and
        starts nothing) when a live job holds one of ``resources``. Returns a copy of the job.
        """
        with self._lock:
            for r in resources:
                jid = self._held.get(r)
                if jid:
                    raise Conflict(r, self._slots[jid].job)
            job = Job(id=new_id(), kind=kind, target=target, params=params or {}, resources=list(resources))
            slot = _Slot(job, [], threading.Condition(self._lock))
            self._slots[job.id] = slot
            for r in resources:
                self._held[r] = job.id
            self._emit(slot, "state", {"state": "queued"})
            self._write(job)
            self._trim()
        reporter = reporter_factory(job.id) if reporter_factory else JobReporter(self, job.id)
        t = threading.Thread(target=self._run, args=(job.id, fn, reporter), name=f"job-{job.id}", daemon=True)
        self._threads[job.id] = t
        t.start()
        return self.get(job.id)  # type: ignore[return-value]

    def _run(self, job_id: str, fn: Callable, reporter: JobReporter) -> None:
        def start(job: Job) -> None:
            job.state = "running"
            job.started_at = time.time()
        self._update(job_id, start, "state", {"state": "running"}, persist=True)
        result: dict[str, Any] | None = None
        error: JobError | None = None
        tb = ""
        try:
            result = fn(reporter, self._slots[job_id].job)
        except WarmctlError as e:
            error = Failure.of(e)
        except BaseException as e:  # noqa: BLE001 - a job must always end with an outcome
            error = Failure.of(e)  # InternalError
            tb = traceback.format_exc()

        def end(job: Job) -> None:
            job.finished_at = time.time()
            job.progress.phase = None
            if error is None:
                job.state, job.result = "succeeded", result
                job.log.append("succeeded")
            else:
                job.state, job.error = "failed", error
                if tb:
                    job.log.extend(tb.rstrip().splitlines())
                job.log.append(f"failed: {error.type}: {error.message}")
            for r in job.resources:
                if self._held.get(r) == job.id:
                    del self._held[r]
        self._update(job_id, end, "end", {"state": "succeeded" if error is None else "failed", "result": result,
                                          "error": error.model_dump() if error else None}, persist=True)
        self._threads.pop(job_id, None)
        if self.on_finish:
            try:
                self.on_finish(self.get(job_id))  # type: ignore[arg-type]
            except Exception:  # noqa: BLE001 - metrics must not break jobs, nor fail unseen
                log.exception("job %s: the on_finish callback (metrics) failed; the job's outcome stands", job_id)

    def _emit(self, slot: _Slot, etype: str, data: dict[str, Any]) -> None:
        slot.events.append(Event(seq=len(slot.events) + 1, type=etype, time=time.time(), data=data))
        slot.cond.notify_all()

    def _update(self, job_id: str, mutate: Callable[[Job], None], etype: str | None, data: dict[str, Any],
                persist: bool = False, with_bytes: bool = False) -> None:
        with self._lock:
            slot = self._slots.get(job_id)
            if slot is None:
                return
            mutate(slot.job)
            if len(slot.job.log) > LOG_LINES:
                del slot.job.log[: len(slot.job.log) - LOG_LINES]
            if etype:
                if with_bytes:
                    data = {**data, "bytes_done": slot.job.progress.bytes_done}
                self._emit(slot, etype, data)
            now = time.monotonic()
            if persist or (etype and now - slot.last_write > 1.0):
                slot.last_write = now
                self._write(slot.job)

    def wait(self, job_id: str, timeout: float | None = None) -> Job | None:
        """Block until ``job_id`` ended (or ``timeout`` seconds); returns a copy of it."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            s = self._slots.get(job_id)
            if s is None:
                return None
            while s.job.live:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    break
                s.cond.wait(left if left is not None else 1.0)
            return s.job.model_copy(deep=True)

    def running(self) -> builtins.list[Job]:
        with self._lock:
            return [s.job.model_copy(deep=True) for s in self._slots.values() if s.job.live]


def dumps(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"))
