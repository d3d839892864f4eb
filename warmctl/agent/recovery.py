"""What the agent does at start: re-adopt engines that still run, clean up what a
half-finished operation left behind, and report it.

For every engine recorded in ``<home>/run/NAME/state.json``:

- phase ``serving`` with the engine and gate processes alive: **adopted** (left running; the
  agent serves its status and can take it down);
- anything else (a phase short of ``serving`` -- the agent died mid-``up`` --, or a dead
  engine or gate), and every engine directory ``<home>/run/NAME`` without a record (an ``up``
  that died before the state file was written): **cleaned** with the run's one teardown
  (:meth:`warmctl.engine.run.EngineRun.teardown` with ``strays``): gate and engine tree killed
  while each still is the recorded process (PID, creation time, executable), as is a root
  whose identity only reached ``engine.pid`` and a tree CRIU restored during the recorded
  restore whose PID only reached ``restore.pid``; never a process for its working directory;
  ``/dev/shm`` files, a left-over materialized image directory (``images/``), the PID files
  and the state removed.

Then ``/dev/shm`` semaphores created since the interrupted jobs started that no live process
maps are removed (:func:`warmctl.checkpoint.capture.orphaned_shm`).

The result is a :class:`RecoveryReport` (also logged, counted in metrics, and served at
``GET /v1/agent``).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from pydantic import BaseModel

from warmctl.checkpoint import capture
from warmctl.config import Settings
from warmctl.engine.run import EngineRun
from warmctl.state import EngineState, all_states

from .jobs import Job

log = logging.getLogger("warmctl.agent")


class RecoveryAction(BaseModel):
    """One thing done at start: ``action`` is ``adopted`` or ``cleaned``; ``engine`` its name;
    ``detail`` what exactly (PIDs killed, files removed, the phase it was left in)."""

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
    recorded = {st.name: st for st in all_states(run_dir)}
    dirs = sorted(p.name for p in run_dir.glob("*") if p.is_dir()) if run_dir.exists() else []
    for name in sorted(set(recorded) | set(dirs)):
        st = recorded.get(name)
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
    if st is None and not (strays or rep.removed_scratch):
        return None
    return RecoveryAction(action="cleaned", engine=name, detail=", ".join(parts[:1]) + "".join("; " + x for x in parts[1:]))
