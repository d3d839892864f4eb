"""What the agent does at start: re-adopt engines that still run, clean up what a
half-finished operation left behind, and report it.

Recovery acts only on records it wrote: ``<home>/run`` and every ``run/NAME``
must be real directories (no symbolic links) owned by the agent's user and not writable by
group or others, ``NAME`` must follow the one name rule (:data:`warmctl.naming.catalog.NAME_RE`),
and ``state.json`` / ``engine.pid`` / ``restore.pid`` in it must be regular files with the
same owner; ``state.json`` must name its own directory. Anything else is **ignored**: left
untouched and reported with the reason. Jobs are read the same way
(:meth:`warmctl.agent.jobs.JobManager.load_from_disk`).

For every trusted engine directory:

- phase ``serving`` with the engine and gate processes alive: **adopted** (left running; the
  agent serves its status and can take it down);
- anything else (a phase short of ``serving`` -- the agent died mid-``up`` --, or a dead
  engine or gate), and every engine directory without a record (an ``up`` or snapshot that
  died before the state file was written): **cleaned** with the run's one teardown
  (:meth:`warmctl.engine.run.EngineRun.teardown` with ``strays``): gate and engine tree killed
  while each still is the recorded process (PID, creation time, executable), as is a root
  whose identity only reached ``engine.pid`` and a tree CRIU restored during the recorded
  restore whose PID only reached ``restore.pid``; never a process for its working directory;
  ``/dev/shm`` files, a left-over materialized image directory (``images/``), the engine's
  sockets directory (``tmp/``: vLLM's ZMQ IPC sockets), the PID files and the state removed.

Then ``/dev/shm`` semaphores created since the interrupted jobs started that no live process
maps are removed (:func:`warmctl.checkpoint.capture.orphaned_shm`).

The result is a :class:`RecoveryReport` (also logged, counted in metrics, and served at
``GET /v1/agent``).
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

from pydantic import BaseModel

from warmctl.checkpoint import capture
from warmctl.records.config import Settings
from warmctl.engine.run import EngineRun
from warmctl.records.enginelock import LOCKS
from warmctl.naming.catalog import NAME_RE
from warmctl.base.private import untrusted
from warmctl.records.state import EngineState

from .jobs import Job

log = logging.getLogger("warmctl.agent")


class RecoveryAction(BaseModel):
    """One thing done at start: ``action`` is ``adopted``, ``cleaned`` or ``ignored`` (a
    directory or record recovery did not write: left untouched); ``engine`` its name (``*``:
    the whole run directory); ``detail`` what exactly (PIDs killed, files removed, the phase
    it was left in, what was left alone and why)."""

    action: str
    engine: str
    detail: str


class RecoveryReport(BaseModel):
    """Everything the agent did at start (Unix seconds; ``interrupted_jobs`` are job ids)."""

    at: float
    actions: list[RecoveryAction] = []
    interrupted_jobs: list[str] = []
    removed_shm: list[str] = []


def recover(settings: Settings, interrupted: list[Job]) -> RecoveryReport:
    """Adopt or clean every engine (see the module doc). ``interrupted`` are the jobs the
    previous agent left running. Never raises for one engine's trouble: it is reported."""
    report = RecoveryReport(at=time.time(), interrupted_jobs=[j.id for j in interrupted])
    run_dir = Path(settings.run_dir)
    why = untrusted(run_dir, kind="dir") if run_dir.exists() or run_dir.is_symlink() else "missing"
    entries = sorted(os.listdir(run_dir)) if why is None else []
    if why not in (None, "missing"):
        report.actions.append(RecoveryAction(action="ignored", engine="*", detail=f"{run_dir}: {why}; nothing in it is touched"))
    for name in entries:
        if name == LOCKS:  # the per-name locks of up/down/snapshot (warmctl.records.enginelock), not an engine
            continue
        d = run_dir / name
        if not (d.is_dir() or d.is_symlink()):
            continue
        st, why = _record(d, name)
        if why is not None:
            report.actions.append(RecoveryAction(action="ignored", engine=name, detail=f"{d}: {why}; left untouched"))
            continue
        if st is not None and st.phase == "serving" and st.engine_alive() and st.gate_alive():
            report.actions.append(RecoveryAction(
                action="adopted", engine=name,
                detail=f"serving on {st.public_host}:{st.public_port}, engine pid {st.root_pid}, gate pid {st.gate_pid}"))
            continue
        action = _clean(settings, name, st)
        if action is not None:
            report.actions.append(action)

    if interrupted:
        since = min(j.started_at or j.created_at for j in interrupted) - 1
        for p in capture.orphaned_shm(since):
            p.unlink(missing_ok=True)
            report.removed_shm.append(str(p))

    for a in report.actions:
        log.warning("recovery: %s %s: %s", a.action, a.engine, a.detail)
    for j in interrupted:
        log.warning("recovery: job %s (%s %s) was interrupted by the agent's stop", j.id, j.kind, j.target)
    if report.removed_shm:
        log.warning("recovery: removed %d orphaned /dev/shm files", len(report.removed_shm))
    return report


def _record(d: Path, name: str) -> tuple[EngineState | None, str | None]:
    """The engine directory ``d``'s record, or why recovery must not act on it: (state or
    None when there is none, None) when trusted; (None, reason) otherwise."""
    if not NAME_RE.fullmatch(name):
        return None, "not an engine name (the name rule: letter or digit, then letters, digits, '.', '_', '-'; at most 128)"
    why = untrusted(d, kind="dir")
    if why is not None:
        return None, why
    for f in ("state.json", "engine.pid", "restore.pid"):
        p = d / f
        if p.exists() or p.is_symlink():
            why = untrusted(p)
            if why is not None:
                return None, f"{f} is {why}"
    p = d / "state.json"
    if not p.exists():
        return None, None
    try:
        st = EngineState.model_validate_json(p.read_text())
    except (OSError, ValueError) as e:
        return None, f"state.json is unreadable ({str(e).splitlines()[0][:200]})"
    if st.name != name:
        return None, f"state.json names engine {st.name!r}, not its directory"
    return st, None


def _clean(settings: Settings, name: str, st: EngineState | None) -> RecoveryAction | None:
    """Tear down engine ``name`` (recorded as ``st``, or only its directory left) with the
    strays a dead ``up`` may have left (:meth:`EngineRun.teardown`); None if there was nothing."""
    if st is not None:
        run = EngineRun.of_state(settings.run_dir, st)
        why = (f"left in phase {st.phase}" + ("" if st.engine_alive() else ", engine dead")
               + ("" if st.gate_alive() else ", gate closed"))
    else:
        run = EngineRun(settings.run_dir, name, 0)
        why = ""
    recorded = {p.pid for p in (run.root, run.gate) if p is not None and p.alive()}
    try:
        rep = run.teardown(strays=True)
    except Exception as e:  # noqa: BLE001 - report, go on with the others
        return RecoveryAction(action="cleaned", engine=name, detail=f"{why}; cleanup failed: {e}")
    parts = [why] if why else []
    if st is not None:
        parts.append(f"killed engine pid {st.root_pid} and gate pid {st.gate_pid}, removed {len(rep.removed_shm)} shm files")
    strays = [p for p in rep.killed if p not in recorded]
    if strays:
        parts.append(f"killed left-over processes {strays}")
    if rep.removed_scratch:
        parts.append("removed a half-written image directory")
    if rep.removed_tmp:
        parts.append(f"removed the engine's sockets directory ({len(rep.removed_tmp) - 1} sockets)"
                     if run.tmp is not None and str(run.tmp) in rep.removed_tmp
                     else f"removed {len(rep.removed_tmp)} engine sockets")
    if rep.refused:
        parts.append("left alone: " + "; ".join(rep.refused))
    if st is None and not (strays or rep.removed_scratch or rep.removed_tmp or rep.refused):
        return None
    return RecoveryAction(action="cleaned", engine=name, detail=", ".join(parts[:1]) + "".join("; " + x for x in parts[1:]))
