"""The agent's request and answer bodies (pydantic), and the patterns its paths take.

Every model here is part of the published OpenAPI document (``docs/openapi.json``); a change
shows up there (``python -m warmctl.agent.openapi --check``)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field, StrictBool

from warmctl.base import names
from warmctl.records.state import EngineState

from .recovery import RecoveryReport

NAME_PATTERN = TAG_PATTERN = names.NAME_PATTERN  # the one name rule, the CLI's too (warmctl.base.names)
JOB_PATTERN = r"^j-[0-9a-f]{12}$"

LazyCopy = Literal["running", "done"] | None

EngineViewPhase = Literal["down", "pending", "starting", "restoring", "health", "canary", "serving",
                          "failed", "dead", "stopping"]


class ErrorBody(BaseModel):
    """Every error answer: a short ``error`` code (``unauthorized``, ``not_found``,
    ``conflict``, ``unprocessable``), a message for the operator, and for ``conflict`` the id
    of the job that holds the engine or port (``null`` when an engine, not a job, holds it)."""

    error: str
    message: str
    holder: str | None = None


class SnapshotRequest(BaseModel):
    """Snapshot profile ``profile`` (a profile NAME the agent can find) as ``profile:tag``.
    Strict types, as :class:`~warmctl.records.contract.UpOptions`."""

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
    lazy_copy: LazyCopy = None
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
