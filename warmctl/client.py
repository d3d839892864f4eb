"""A small client for the warmctl agent's REST API (``warmctl agent``), used by the CLI when
``agent_url`` is configured so that ``warmctl up/down/status`` behave the same either way.

``AgentClient(url, token)`` returns the same types as :mod:`warmctl.pipelines.lifecycle`
(:class:`~warmctl.records.contract.UpResult`, :class:`~warmctl.records.state.EngineState`,
:class:`~warmctl.pipelines.lifecycle.EngineStatus`) and feeds a job's phases and log lines into a
:class:`~warmctl.records.progress.Reporter` while following its server-sent events. A failed job
raises the same :class:`~warmctl.base.errors.WarmctlError` subclass (and exit code) the local
call would have; the agent being unreachable raises :class:`HostError`, a wrong token or a
409 a :class:`AgentError` with the agent's message (which names the holder job).

Tests pass ``transport=httpx.ASGITransport(app)`` or talk to a real agent.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Iterator

import httpx

from warmctl.base import errors
from warmctl.records.config import Settings
from warmctl.records.contract import Failure, UpRequest, UpResult
from warmctl.base.errors import HostError, WarmctlError
from warmctl.records.manifest import Phase
from warmctl.base.private import read_token
from warmctl.records.progress import Reporter
from warmctl.records.state import EngineState


class AgentError(WarmctlError):
    """The agent refused a request (401 wrong token, 404, 409 conflict, 422 invalid).
    ``status`` is the HTTP status, ``holder`` the conflicting job id (409) or ``None``."""

    def __init__(self, message: str, status: int, holder: str | None = None):
        super().__init__(message)
        self.status = status
        self.holder = holder


class JobFailed(WarmctlError):
    """A job failed with an error type this client does not know (an agent of another
    version); ``exit_code`` is the one the agent reported (the class's own, 22, if none)."""

    def __init__(self, type_: str, message: str, exit_code: int | None = None):
        super().__init__(f"{message}")
        self.type = type_
        if exit_code is not None:
            self.exit_code = exit_code

    @property
    def failure(self) -> Failure:
        """The job's failure as the agent reported it (its type, not this class's name)."""
        return Failure(type=self.type, message=str(self), exit_code=self.exit_code)


def _error_for(err: dict[str, Any]) -> WarmctlError:
    """The error a failed job reports (``{"type", "message", "exit_code"}``) as the same
    :class:`WarmctlError` subclass the local call raises (:func:`warmctl.base.errors.rebuild`, every
    class in :data:`warmctl.base.errors.EXIT_CODES`), else :class:`JobFailed` with the agent's code."""
    found = errors.rebuild(str(err.get("type", "")), str(err.get("message", "")))
    if found is not None:
        return found
    code = err.get("exit_code")
    return JobFailed(err.get("type", "error"), err.get("message", ""), int(code) if code is not None else None)


class AgentClient:
    """Client for the agent at ``url`` (``http[s]://host:port``) with bearer ``token``.

    ``timeout``: seconds per request (streams wait as long as the job runs); ``transport``:
    an httpx transport (tests); ``verify``: TLS verification (``True``, ``False`` or a CA
    bundle path; ``$SSL_CERT_FILE`` is honoured)."""

    def __init__(self, url: str, token: str | None, *, timeout: float = 30.0,
                 transport: httpx.BaseTransport | None = None, verify: bool | str = True) -> None:
        self.url = url.rstrip("/")
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        if isinstance(verify, (str, Path)):
            import ssl

            verify = ssl.create_default_context(cafile=str(verify))  # type: ignore[assignment]
        self.http = httpx.Client(base_url=self.url, headers=headers, timeout=timeout, transport=transport,
                                 verify=verify)

    @classmethod
    def from_settings(cls, settings: Settings, **kw: Any) -> "AgentClient":
        """A client for ``settings.agent_url`` with the token in ``settings.agent_token_file``
        (else ``<home>/agent/token``)."""
        if not settings.agent_url:
            raise HostError("no agent configured (set agent_url or $WARMCTL_AGENT_URL)")
        tf = settings.agent_token_file or settings.home / "agent" / "token"
        return cls(settings.agent_url, read_token(tf, private=False), **kw)

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> "AgentClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ plumbing

    def request(self, method: str, path: str, **kw: Any) -> Any:
        """One API call; returns the decoded JSON. Raises :class:`HostError` when the agent
        cannot be reached, :class:`AgentError` for a 4xx answer, ``httpx.HTTPStatusError``
        for a 5xx."""
        try:
            r = self.http.request(method, path, **kw)
        except httpx.TransportError as e:
            raise HostError(f"cannot reach the warmctl agent at {self.url}: {e}") from None
        if 400 <= r.status_code < 500:
            try:
                body = r.json()
            except ValueError:
                body = {"message": r.text}
            msg = body.get("message") or body.get("detail") or r.text
            if r.status_code == 401:
                msg = f"the agent at {self.url} refused the token: {msg}"
            raise AgentError(str(msg), r.status_code, body.get("holder"))
        r.raise_for_status()
        return r.json()

    def events(self, job_id: str, after: int = 0) -> Iterator[dict[str, Any]]:
        """Follow job ``job_id``'s server-sent events (``{"seq", "type", "data"}``) until its
        ``end`` event; reconnects (resuming after the last seen ``seq``) when the stream
        drops early."""
        last = after
        while True:
            try:
                with self.http.stream("GET", f"/v1/jobs/{job_id}/events", params={"after": last},
                                      timeout=httpx.Timeout(self.http.timeout.connect, read=60.0)) as r:
                    if r.status_code != 200:
                        r.read()
                        raise AgentError(r.text, r.status_code)
                    ev: dict[str, Any] = {}
                    for line in r.iter_lines():
                        if not line:
                            if ev.get("type"):
                                last = int(ev.get("seq", last))
                                yield ev
                                if ev["type"] == "end":
                                    return
                            ev = {}
                        elif line.startswith(":"):
                            continue
                        else:
                            k, _, v = line.partition(":")
                            v = v[1:] if v.startswith(" ") else v
                            if k == "id":
                                ev["seq"] = int(v)
                            elif k == "event":
                                ev["type"] = v
                            elif k == "data":
                                ev["data"] = json.loads(v)
            except (httpx.RemoteProtocolError, httpx.ReadError, httpx.ReadTimeout):
                time.sleep(0.5)
                continue
            except httpx.TransportError as e:
                raise HostError(f"lost the warmctl agent at {self.url}: {e}") from None
            # the stream closed without an end event: the job may be from an earlier agent
            job = self.request("GET", f"/v1/jobs/{job_id}")
            if job["state"] not in ("queued", "running"):
                yield {"seq": last + 1, "type": "end",
                       "data": {"state": job["state"], "result": job["result"], "error": job["error"]}}
                return

    def follow(self, job_id: str, reporter: Reporter | None = None) -> dict[str, Any]:
        """Wait for job ``job_id``, showing its phases and log on ``reporter``. Returns the
        job's ``result``; raises the job's error (see the module doc)."""
        rep = reporter or Reporter()
        for ev in self.events(job_id):
            d = ev.get("data", {})
            t = ev["type"]
            if t == "phase_started":
                rep.started(d["phase"], d.get("desc", ""))
            elif t == "phase_finished":
                rep.phases.append(Phase(name=d["phase"], seconds=d["seconds"]))
                rep.finished(d["phase"], d["seconds"], d["ok"])
            elif t == "log":
                rep.info(d["line"])
            elif t == "end":
                if d.get("state") == "succeeded":
                    return d.get("result") or {}
                raise _error_for(d.get("error") or {"type": "error", "message": f"job {job_id} {d.get('state')}"})
        raise HostError(f"the event stream of job {job_id} ended without an outcome")

    # ------------------------------------------------------------------ operations

    def up(self, request: UpRequest, reporter: Reporter | None = None, *, check: bool = True) -> UpResult:
        """Like :func:`warmctl.pipelines.lifecycle.up` through the agent: the job's result parsed back into
        the same :class:`~warmctl.records.contract.UpResult` (:meth:`~warmctl.records.contract.UpResult.from_json`).
        A failed job raises its error (see the module doc); with ``check=False`` it is returned
        instead, as an ``UpResult`` whose ``failure`` says why (type, message, exit code)."""
        job = self.request("POST", f"/v1/engines/{request.name}/up",
                           json=request.options().model_dump(mode="json", exclude_defaults=True))
        try:
            res = self.follow(job["id"], reporter)
        except WarmctlError as e:
            if check:
                raise
            failure = e.failure if isinstance(e, JobFailed) else Failure.of(e)
            return UpResult.failed(request.name, failure)
        return UpResult.from_json(res)

    def down(self, name: str, now: bool = False) -> EngineState | None:
        """Like :func:`warmctl.pipelines.lifecycle.down` through the agent: the stopped state, or
        ``None`` when nothing of that name was up. ``now``: no drain."""
        job = self.request("POST", f"/v1/engines/{name}/down", params={"now": "true"} if now else None)
        res = self.follow(job["id"])
        return EngineState.model_validate(res["state"]) if res.get("state") else None

    def status(self, name: str | None = None):
        """Like :func:`warmctl.pipelines.lifecycle.status` through the agent: ``EngineStatus`` rows of
        recorded engines (engines an ``up`` job has not recorded yet are left out)."""
        from warmctl.pipelines.lifecycle import EngineStatus

        rows = self.request("GET", "/v1/engines")
        return [EngineStatus(EngineState.model_validate(r["state"]), r["engine_alive"], r["gate_alive"], r["healthy"],
                             r.get("shm_count", 0), r.get("shm_bytes", 0), r.get("lazy_copy"), r.get("failure") or "")
                for r in rows if r.get("state") and (name is None or r["name"] == name)]

    def snapshot(self, profile: str, reporter: Reporter | None = None, *, tag: str = "latest") -> dict[str, Any]:
        """Snapshot ``profile`` through the agent; returns ``{name, tag, digest, size}``."""
        job = self.request("POST", "/v1/snapshots", json={"profile": profile, "tag": tag})
        return self.follow(job["id"], reporter)
