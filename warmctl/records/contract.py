"""The one contract of ``up``: what is asked (:class:`UpRequest`) and what came of it
(:class:`UpResult`, with :class:`Failure` when it failed), shared by every front end.

* the library: :func:`warmctl.pipelines.lifecycle.up` takes an :class:`UpRequest` and returns an
  :class:`UpResult` (or raises);
* the CLI: ``warmctl up --json`` prints :meth:`UpResult.to_json` (docs/cli-json.md), also for a
  failed ``up`` (then with ``failure`` set);
* the agent: ``POST /v1/engines/{name}/up`` takes :class:`UpOptions` (the request without the
  name, which is in the path) as its body and records :meth:`UpResult.to_json` as the job's
  ``result``; a failed job's ``error`` is a :class:`Failure` (docs/openapi.json);
* the client (:mod:`warmctl.client`) parses the agent's JSON back with :meth:`UpResult.from_json`.

One JSON document, one parser: a field added here reaches every path, and
``tests/test_up_contract.py`` fails when a path drops or renames one. New fields take a
default, so an older agent's document still parses.

Low in the layers: pydantic, :mod:`warmctl.base.errors`, :mod:`warmctl.base.names`, :mod:`warmctl.records.state`.
"""

# No `from __future__ import annotations` here: pydantic would then evaluate each field's
# annotation from its string when the class is made (compiling it), about 4 ms of every
# `warmctl up` over the model modules it imports (docs/benchmarks.md).

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, computed_field

from warmctl.base.errors import WarmctlError
from warmctl.base.names import NAME_PATTERN
from warmctl.records.state import EngineSource, EngineState

DIGEST_PATTERN = r"^sha256:[0-9a-f]{64}$"


class UpOptions(BaseModel):
    """How to bring an engine up (everything of :class:`UpRequest` but its name): from snapshot
    ``NAME:tag`` (or ``NAME@digest``), or cold from the profile NAME.

    ``port``/``host``: public address (default: settings, then the profile's);
    ``snapshot_after``: on the cold path, snapshot the warmed engine (it keeps serving);
    ``insecure``: accept an unsigned or untrusted snapshot (a snapshot is executable state: only
    for tests); ``allow_rollback``: restore ``NAME:tag`` even when it is older than the newest
    snapshot of it this node accepted (``digest`` also pins one); ``cold_start``: ``fallback``
    or ``never`` when no snapshot fits (default: the ``cold_start`` setting); with ``never``
    ``up`` fails naming every rejected candidate. ``restart``/``restart_limit``: the agent's
    restart policy (:mod:`warmctl.agent.supervise`); the library and the CLI ignore them.
    Strict types: ``"true"`` is not a boolean, ``"8080"`` not a port; unknown fields are refused.
    """

    # built when defined, unlike the other models here: the agent's request body, which FastAPI
    # wraps with the parameter's name as an alias (pydantic warns that the alias does nothing
    # when it must build a deferred model inside that wrapper)
    model_config = ConfigDict(extra="forbid", strict=True)
    tag: str = Field("latest", pattern=NAME_PATTERN)
    digest: str | None = Field(None, pattern=DIGEST_PATTERN)
    cold_start: Literal["fallback", "never"] | None = None
    port: int | None = Field(None, ge=1, le=65535)
    host: str | None = Field(None, max_length=255, pattern=r"^[A-Za-z0-9.:-]+$")
    snapshot_after: StrictBool = False
    #: INSECURE: restore an unsigned or untrusted snapshot (logged as a loud warning); only a
    #: JSON ``true`` turns it on
    insecure: StrictBool = False
    allow_rollback: StrictBool = False
    #: ``on-failure``: when the engine dies later, the agent brings it up again the same way,
    #: with backoff, at most ``restart_limit`` times in 10 minutes (:mod:`warmctl.agent.supervise`)
    restart: Literal["no", "on-failure"] = "no"
    restart_limit: int | None = Field(None, ge=1, le=100)


class UpRequest(UpOptions):
    """``up`` of engine ``name`` (also the profile to cold-start from) with :class:`UpOptions`."""

    model_config = ConfigDict(defer_build=True)

    name: str = Field(..., pattern=NAME_PATTERN)

    @classmethod
    def of(cls, name: str, options: UpOptions) -> "UpRequest":
        """``options`` for engine ``name`` (the agent: the name is in the path)."""
        return cls(name=name, **dict(options))

    def options(self) -> UpOptions:
        """The request without its name (the agent's request body)."""
        return UpOptions(**{k: v for k, v in dict(self).items() if k != "name"})


class Failure(BaseModel):
    """Why an ``up`` (or any agent job) failed: ``type``, the error's class name
    (``HostError``, ``CanaryMismatch``, ...), its operator-facing ``message``, and the
    ``exit_code`` the CLI exits with for it (docs/exit-codes.md)."""

    model_config = ConfigDict(defer_build=True)

    type: str
    message: str
    exit_code: int = 1

    @classmethod
    def of(cls, e: BaseException) -> "Failure":
        """The failure ``e`` stands for (a non-:class:`WarmctlError` is ``InternalError``, 1)."""
        if isinstance(e, WarmctlError):
            return cls(type=type(e).__name__, message=str(e), exit_code=e.exit_code)
        return cls(type="InternalError", message=f"{type(e).__name__}: {e}")


class Streamed(BaseModel):
    """What CRIU read from an image streamed to it while it was written (``restore_stream``):
    ``files`` (image files), ``bytes`` (bytes read), ``waited_s`` (seconds its readers waited
    for bytes not yet written, summed over files)."""

    model_config = ConfigDict(defer_build=True)

    files: int
    bytes: int
    waited_s: float


class UpResult(BaseModel):
    """Outcome of ``up`` of engine ``name``.

    ``state``: the engine's state record (None when ``up`` failed before one was made);
    ``source``: how it came up, ``"restore"`` (from a snapshot) or ``"cold"`` (from its
    profile), as ``state.source``; ``already_up``: ``up`` found it serving and changed nothing.
    ``timings``: seconds by phase of this ``up``, ``total`` their sum (a cold path also lists
    the engine's own start-up breakdown, which ``total`` does not add again). ``reason``: why
    the cold path was taken. ``snapshot_digest``: the manifest restored (or made with
    ``snapshot_after``). ``fetched``: stored bytes of the chunks loaded, from the ``remote``
    store and from the ``local`` one. ``streamed``: :class:`Streamed`, for a restore that read
    its image while it was written; None otherwise. ``lazy_copy``: for a lazy restore,
    ``"running"`` when ``up`` returned while the lazy-pages daemon still copied pages,
    ``"done"`` when it had finished (None: eager or cold). ``snapshot_error``: why the snapshot
    ``snapshot_after`` asked for was not made while the engine kept serving (one line; nothing
    of it is named in the catalog; ``up`` succeeded), else None. ``failure``: why ``up`` failed
    (:class:`Failure`); None when it succeeded.
    """

    model_config = ConfigDict(defer_build=True, populate_by_name=True)
    name: str
    source: EngineSource | None = None
    already_up: bool = False
    reason: str = ""
    snapshot_digest: str | None = Field(None, alias="snapshot")
    fetched: dict[str, int] = {}
    streamed: Streamed | None = None
    lazy_copy: Literal["running", "done"] | None = None
    snapshot_error: str | None = None
    timings: dict[str, float] = Field({}, alias="timings_s")
    state: EngineState | None = None
    failure: Failure | None = None

    @classmethod
    def failed(cls, name: str, e: BaseException | Failure) -> "UpResult":
        """The result of an ``up`` of ``name`` that raised ``e``."""
        return cls(name=name, failure=e if isinstance(e, Failure) else Failure.of(e))

    @computed_field  # type: ignore[prop-decorator]
    @property
    def path(self) -> str | None:
        """``"already-up"``, else ``source`` (None for a failed ``up``): kept for clients
        written against it."""
        return "already-up" if self.already_up else self.source

    @property
    def outcome(self) -> str | None:
        """:attr:`path`."""
        return self.path

    @computed_field  # type: ignore[prop-decorator]
    @property
    def public(self) -> str | None:
        """``HOST:PORT`` of the public port (None without a state)."""
        return None if self.state is None else f"{self.state.public_host}:{self.state.public_port}"

    @computed_field  # type: ignore[prop-decorator]
    @property
    def pid(self) -> int | None:
        """The engine tree's root process (None without a state)."""
        return None if self.state is None else self.state.root_pid

    @computed_field(alias="timings")  # type: ignore[prop-decorator]
    @property
    def timings_again(self) -> dict[str, float]:
        """``timings`` under the agent's name for it (``timings_s`` is the CLI's): the same
        seconds, kept for clients written against either."""
        return self.timings

    def to_json(self) -> dict[str, Any]:
        """The JSON document of this result, the same for ``up --json`` and the agent's job
        result (docs/cli-json.md): every field under its alias (``snapshot``:
        ``snapshot_digest``, ``timings_s``: ``timings``) and the derived ``path``, ``public``,
        ``pid`` and ``timings``."""
        return self.model_dump(mode="json", by_alias=True)

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> "UpResult":
        """Parse :meth:`to_json`'s document (the agent's job result). The derived keys
        (``path``, ``public``, ``pid``, ``timings``) are not read (they follow from the fields);
        keys this version does not know are ignored (a newer agent). Raises
        ``pydantic.ValidationError``."""
        doc = dict(doc)
        if "timings_s" not in doc and "timings" in doc:  # an agent from before timings_s
            doc["timings_s"] = doc["timings"]
        if "name" not in doc and isinstance(doc.get("state"), dict):
            doc["name"] = doc["state"].get("name")
        known = {f.alias or k for k, f in cls.model_fields.items()}
        res = cls.model_validate({k: v for k, v in doc.items() if k in known})
        if "already_up" not in doc and doc.get("path") == "already-up":
            res.already_up = True
        if res.source is None and res.state is not None and res.failure is None:
            res.source = res.state.source
        return res

    def error(self) -> WarmctlError | None:
        """The error of a failed ``up``, as the class its ``failure.type`` names
        (:func:`warmctl.base.errors.rebuild`), else a :class:`WarmctlError` with its exit code;
        None when it succeeded."""
        f = self.failure
        if f is None:
            return None
        from warmctl.base import errors

        e = errors.rebuild(f.type, f.message)
        if e is None:
            e = WarmctlError(f.message)
            e.exit_code = f.exit_code
        return e
