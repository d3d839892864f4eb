"""Restart policy of the agent's engines: ``restart = "on-failure"`` per engine.

An ``up`` request with ``"restart": "on-failure"`` registers the engine here once its job
succeeded. A thread then looks at every registered engine each :data:`CHECK_INTERVAL_S`: when
its process tree or its gate died (``lifecycle.status``: not alive, or nothing recorded any
more) and no job works on it, it submits the same ``up`` again, which tears down what was left
and restores (or cold-starts) it as the first time did.

Backoff and limit: the first restart is submitted at once, each next one waits twice as long
as the one before (:data:`BACKOFF_FIRST_S` doubling up to :data:`BACKOFF_MAX_S`; reset after
the engine served for :data:`STABLE_S`). At most ``limit`` restarts
(:data:`DEFAULT_LIMIT` unless the request says) within :data:`WINDOW_S`; past that the engine
is left down, the policy dropped and the reason kept (``gave_up``), so a snapshot that crashes
on every restore does not loop forever. ``down`` drops the policy first.

Policies are kept in ``<home>/agent/restart.json`` so that a restarted agent keeps
supervising the engines it re-adopted.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

log = logging.getLogger("warmctl.agent")

#: seconds between looks at the supervised engines
CHECK_INTERVAL_S = 1.0
#: wait before the second restart in a row; doubles for each further one
BACKOFF_FIRST_S = 2.0
#: the longest wait between restarts
BACKOFF_MAX_S = 60.0
#: an engine serving this long since its last restart resets the backoff
STABLE_S = 300.0
#: restarts counted within this many seconds for the limit
WINDOW_S = 600.0
#: restarts allowed within WINDOW_S when the request gives no ``restart_limit``
DEFAULT_LIMIT = 5


@dataclass
class Policy:
    """One supervised engine: the ``up`` request to repeat (``params``, as the API took it),
    the ``limit``, Unix times of the restarts submitted, and when the next may be."""

    name: str
    params: dict
    limit: int = DEFAULT_LIMIT
    restarts: list[float] = field(default_factory=list)
    next_at: float = 0.0
    backoff_s: float = 0.0
    gave_up: str | None = None


class Supervisor:
    """The restart loop (module doc). ``dead(name)`` says whether engine ``name`` needs
    restarting (its tree or gate died or nothing is recorded); ``busy(name)`` whether a job
    works on it; ``restart(name, params)`` submits the ``up`` job (raises when it cannot)."""

    def __init__(self, path: Path, dead: Callable[[str], bool], busy: Callable[[str], bool],
                 restart: Callable[[str, dict], str]) -> None:
        self.path = path
        self._dead, self._busy, self._restart = dead, busy, restart
        self._lock = threading.Lock()
        self.policies: dict[str, Policy] = {}
        self.given_up: dict[str, str] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._load()

    # -- policies -------------------------------------------------------------------------

    def watch(self, name: str, params: dict, limit: int | None = None) -> None:
        """Supervise ``name`` from now on (after its ``up`` succeeded); keeps the restart
        history when it is already supervised (a restart's own ``up``)."""
        with self._lock:
            old = self.policies.get(name)
            p = Policy(name, params, limit or DEFAULT_LIMIT)
            if old is not None:
                p.restarts, p.backoff_s = old.restarts, old.backoff_s
            self.policies[name] = p
            self.given_up.pop(name, None)
            self._save()

    def forget(self, name: str) -> None:
        """Stop supervising ``name`` (``down``, or an ``up`` without a restart policy)."""
        with self._lock:
            if self.policies.pop(name, None) is not None:
                self._save()

    def view(self, name: str, now: float | None = None) -> dict | None:
        """What the API shows: ``{"policy", "restarts", "limit", "next_at", "gave_up"}`` (restarts
        within the last :data:`WINDOW_S` before ``now``, default the current time) or None."""
        with self._lock:
            p = self.policies.get(name)
            if p is None:
                return {"policy": "no", "gave_up": self.given_up[name]} if name in self.given_up else None
            now = time.time() if now is None else now
            return {"policy": "on-failure", "restarts": len([t for t in p.restarts if now - t < WINDOW_S]),
                    "limit": p.limit, "next_at": p.next_at or None, "gave_up": None}

    # -- the loop -------------------------------------------------------------------------

    def start(self) -> None:
        """Start the loop thread (daemon)."""
        self._thread = threading.Thread(target=self._loop, name="warmctl-supervisor", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _loop(self) -> None:
        while not self._stop.wait(CHECK_INTERVAL_S):
            try:
                self.tick()
            except Exception:  # the loop must outlive any one engine's trouble
                log.exception("supervisor tick failed")

    def tick(self, now: float | None = None) -> list[str]:
        """One look at every supervised engine; returns the names restarted."""
        now = time.time() if now is None else now
        done = []
        with self._lock:
            policies = list(self.policies.values())
        for p in policies:
            if self._busy(p.name):
                continue
            if not self._dead(p.name):
                if p.restarts and now - p.restarts[-1] > STABLE_S:
                    p.backoff_s = 0.0
                continue
            if now < p.next_at:
                continue
            recent = [t for t in p.restarts if now - t < WINDOW_S]
            if len(recent) >= p.limit:
                why = (f"engine {p.name} died {len(recent) + 1} times within {WINDOW_S:.0f} s "
                       f"(restart limit {p.limit}); left down")
                log.error(why)
                with self._lock:
                    self.policies.pop(p.name, None)
                    self.given_up[p.name] = why
                    self._save()
                continue
            try:
                job = self._restart(p.name, p.params)
            except Exception as e:  # a conflict or a port held: try again after the backoff
                log.warning("restart of %s not submitted: %s", p.name, e)
                job = None
            p.restarts = recent + [now]
            p.backoff_s = min(BACKOFF_MAX_S, p.backoff_s * 2 if p.backoff_s else BACKOFF_FIRST_S)
            # the first restart goes at once; the next waits backoff_s after this one
            p.next_at = now + p.backoff_s
            if job is not None:
                log.warning("engine %s died; restart %d/%d submitted as job %s", p.name, len(p.restarts), p.limit, job)
                done.append(p.name)
            with self._lock:
                self._save()
        return done

    # -- persistence ----------------------------------------------------------------------

    def _save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"policies": [asdict(p) for p in self.policies.values()],
                                   "given_up": self.given_up}, indent=1))
        tmp.replace(self.path)

    def _load(self) -> None:
        try:
            doc = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return
        for d in doc.get("policies", []):
            try:
                self.policies[d["name"]] = Policy(**d)
            except TypeError:
                log.warning("ignoring an unreadable restart policy in %s: %r", self.path, d)
        self.given_up = dict(doc.get("given_up", {}))
