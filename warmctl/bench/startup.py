"""``bench startup``: cold start vs ``up`` from a snapshot, N runs each, by phase (seed 000
section 10).

Each run calls the library, not the CLI: :func:`warmctl.pipelines.lifecycle.up` with a tag that has no
snapshot (the cold path: engine start, warm-up grid, canary record, gate) and with the
snapshot's tag (the restore path: materialize, CRIU restore, health, canary, gate), then one
streamed completion on the public port (the first request a user would send), then
:func:`warmctl.pipelines.lifecycle.down`. Phase seconds are those ``up`` records (the cold engine's own
start-up breakdown — weights, torch.compile, graph capture — is read from vLLM's log by
:func:`warmctl.engine.startlog.parse_startup_phases`); ``up_wall_s`` is the wall time of the
``up`` call, ``first_request_s`` the completion's total time, and ``ready_s`` their sum: how
long until a user has an answer. Medians are over runs; ``ratio`` = cold ``ready_s`` / restore
``ready_s``.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Callable

import httpx

from warmctl.pipelines import lifecycle
from warmctl.records.config import Settings
from warmctl.records.contract import UpRequest
from warmctl.engine.startlog import PHASE_NAMES
from warmctl.base.errors import HostError, SnapshotNotFound, WarmctlError
from warmctl.records.profile import Profile
from warmctl.records.progress import Reporter

#: A tag no snapshot has: ``up`` with it takes the cold path.
COLD_TAG = "bench-startup-no-such-tag"

#: Display order and labels of phases (cold first, then restore); others follow as recorded.
PHASE_LABELS = {
    # the cold engine's own start-up, read from its log (warmctl.engine.startlog.startup_breakdown)
    **{k: v for k, v in PHASE_NAMES.items()},
    "other": "other engine start-up", "cold_start": "engine start (launch to /health)",
    "warmup": "warm-up grid", "canary_record": "canary (record)",
    "materialize": "materialize (verify chunks, write image)", "restore": "CRIU restore", "health": "health",
    "canary": "canary (replay, bit for bit)", "gate": "open the public port",
}


@dataclass
class StartupRun:
    """One ``up`` + first request + ``down``. Seconds throughout."""

    path: str
    phases: dict[str, float]
    up_wall_s: float
    first_request_s: float | None
    first_request_tokens: int | None
    ready_s: float | None
    error: str | None = None
    snapshot_digest: str | None = None
    reason: str = ""


@dataclass
class StartupResult:
    """All runs, with per-path medians by phase (seconds) and the cold/restore ratio."""

    profile: str
    tag: str
    snapshot_digest: str
    cold: list[StartupRun] = field(default_factory=list)
    restore: list[StartupRun] = field(default_factory=list)

    @staticmethod
    def medians(runs: list[StartupRun]) -> dict[str, float]:
        """Median seconds per phase over the successful runs, plus ``up_wall_s``,
        ``first_request_s`` and ``ready_s``."""
        ok = [r for r in runs if r.error is None]
        keys: list[str] = []
        for r in ok:
            keys += [k for k in r.phases if k not in keys]
        out = {k: statistics.median([r.phases[k] for r in ok if k in r.phases]) for k in keys}
        for k in ("up_wall_s", "first_request_s", "ready_s"):
            vals = [getattr(r, k) for r in ok if getattr(r, k) is not None]
            if vals:
                out[k] = statistics.median(vals)
        return out

    def ratio(self) -> float | None:
        c, r = self.medians(self.cold).get("ready_s"), self.medians(self.restore).get("ready_s")
        return c / r if c and r else None

    def to_json(self) -> dict:
        return {"kind": "warmctl-bench-startup", "format": 1, "profile": self.profile, "tag": self.tag,
                "snapshot": self.snapshot_digest, "cold": [asdict(r) for r in self.cold],
                "restore": [asdict(r) for r in self.restore], "cold_median_s": self.medians(self.cold),
                "restore_median_s": self.medians(self.restore), "ratio": self.ratio()}


def _first_request(url: str, model: str) -> tuple[float, int]:
    """One greedy completion (16 tokens) on the public port: (seconds, completion tokens)."""
    t0 = time.perf_counter()
    r = httpx.post(f"{url}/v1/completions", json={"model": model, "prompt": "The capital of France is",
                                                  "max_tokens": 16, "temperature": 0.0}, timeout=120)
    r.raise_for_status()
    return time.perf_counter() - t0, int(r.json()["usage"]["completion_tokens"])


def _one(name: str, settings: Settings, profile: Profile, tag: str, reporter: Reporter) -> StartupRun:
    t0 = time.perf_counter()
    try:
        res = lifecycle.up(UpRequest(name=name, tag=tag), settings, reporter, profile=profile)
    except WarmctlError as e:
        return StartupRun("failed", {p.name: p.seconds for p in reporter.phases}, time.perf_counter() - t0,
                          None, None, None, error=str(e))
    wall = time.perf_counter() - t0
    try:
        st = res.state
        host = "127.0.0.1" if st.public_host in ("0.0.0.0", "") else st.public_host
        try:
            fr, ntok = _first_request(f"http://{host}:{st.public_port}", st.served_model_name)
            err = None
        except (httpx.HTTPError, KeyError, ValueError) as e:
            fr, ntok, err = None, None, f"first request failed: {e}"
        phases = {k: v for k, v in res.timings.items() if k != "total"}
        reporter.info(f"  {res.source}: up {wall:.2f} s" + (f", first answer {fr:.2f} s, ready {wall + fr:.2f} s"
                                                           if fr is not None else f"; {err}"))
        return StartupRun(res.source, phases, wall, fr, ntok, None if fr is None else wall + fr, error=err,
                          snapshot_digest=res.snapshot_digest, reason=res.reason)
    finally:
        lifecycle.down(name, settings)


def run_startup(profile: Profile, settings: Settings, runs: int = 3, tag: str = "latest",
                reporter_factory: Callable[[str], Reporter] | None = None) -> StartupResult:
    """Restore, then cold start, ``runs`` times each (see module doc).

    ``reporter_factory(label)`` gives the reporter for one ``up`` (``label`` like ``"cold 1/3"``).
    Each iteration restores first; refuses (:class:`HostError`) if the engine is already up, and
    stops (:class:`SnapshotNotFound`) if ``up NAME:TAG`` takes the cold path. A failed run is recorded with its
    error and left out of the medians; the engine is always brought down after each run.
    """
    name = profile.name
    if any(s.engine_alive() or s.gate_alive() for s in (x.state for x in lifecycle.status(settings, name))):
        raise HostError(f"engine {name} is up; `warmctl down {name}` before measuring its start-up")
    make = reporter_factory or (lambda label: Reporter())
    out = StartupResult(name, tag, "")
    for i in range(runs):
        # restore first: if `up` would not restore (no snapshot for this host in the catalog,
        # another profile), stop before spending a cold start
        r = _one(name, settings, profile, tag, make(f"restore {i + 1}/{runs}"))
        if r.error is None and r.path != "restore":
            raise SnapshotNotFound(f"`warmctl up {name}:{tag}` does not restore on this host ({r.reason}); "
                                   f"`warmctl snapshot {name}` first")
        out.snapshot_digest = out.snapshot_digest or (r.snapshot_digest or "")
        out.restore.append(r)
        out.cold.append(_one(name, settings, profile, COLD_TAG, make(f"cold {i + 1}/{runs}")))
    return out


def markdown(res: StartupResult) -> str:
    """Table of median seconds by phase, cold vs restore, and a seed-000-style summary line."""
    c, r = StartupResult.medians(res.cold), StartupResult.medians(res.restore)
    keys = [k for k in PHASE_LABELS if k in c or k in r]
    keys += [k for k in list(c) + list(r) if k not in keys and k not in ("up_wall_s", "first_request_s", "ready_s")]
    f = lambda x: "—" if x is None else f"{x:,.2f} s"  # noqa: E731
    n_ok = lambda runs: sum(x.error is None for x in runs)  # noqa: E731
    lines = [f"# Start-up: {res.profile} (snapshot {res.profile}:{res.tag}, {res.snapshot_digest[:19] or 'none'})", "",
             f"Medians of {n_ok(res.cold)} cold and {n_ok(res.restore)} restore runs "
             f"({len(res.cold)} and {len(res.restore)} attempted).", "",
             "| Phase | Cold start | Restore (`up` from snapshot) |", "|---|---:|---:|"]
    for k in keys:
        lines.append(f"| {PHASE_LABELS.get(k, k)} | {f(c.get(k))} | {f(r.get(k))} |")
    lines += [f"| **`up` (wall)** | {f(c.get('up_wall_s'))} | {f(r.get('up_wall_s'))} |",
              f"| first request (16 tokens) | {f(c.get('first_request_s'))} | {f(r.get('first_request_s'))} |",
              f"| **ready: `up` + first answer** | {f(c.get('ready_s'))} | {f(r.get('ready_s'))} |", ""]
    ratio = res.ratio()
    if ratio:
        parts = ", ".join(f"{r[k]:.1f} s {PHASE_LABELS.get(k, k)}" for k in ("materialize", "restore", "health", "canary", "gate") if k in r)
        lines += [f"A cold start takes {c['ready_s']:.1f} s to a first answer; `warmctl up` from the snapshot takes "
                  f"{r['ready_s']:.1f} s ({parts}): **{ratio:.1f}x faster**.", ""]
    errs = [(p, x.error) for p, runs in (("cold", res.cold), ("restore", res.restore)) for x in runs if x.error]
    if errs:
        lines += ["Failed runs:", ""] + [f"- {p}: " + e.strip().replace("\n", "\n  ") for p, e in errs] + [""]
    return "\n".join(lines)
