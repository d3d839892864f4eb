"""What the agent does at start: re-adopt engines that still run, clean up what a
half-finished operation left behind, and report it.

For every engine recorded in ``<home>/run/NAME/state.json``:

- phase ``serving`` with the engine and gate processes alive: **adopted** (left running; the
  agent serves its status and can take it down);
- anything else (a phase short of ``serving`` -- the agent died mid-``up`` --, or a dead
  engine or gate): **cleaned** with :func:`warmctl.lifecycle.down` (gate and engine tree
  killed, ``/dev/shm`` files removed, state removed).

Then, for every engine directory ``<home>/run/NAME`` without an adopted engine (including
those whose ``up`` died before the state file was written):

- a tree that CRIU restored but whose PID never reached the state file (``engine.pid``) is
  killed, as is any process whose working directory is that engine directory;
- a left-over materialized image directory (``images/``) is removed;
- ``/dev/shm`` files changed since the interrupted job started that no live process maps are
  removed (:func:`warmctl.checkpoint.capture.orphaned_shm`).

The result is a :class:`RecoveryReport` (also logged, counted in metrics, and served at
``GET /v1/agent``).
"""

from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path

import psutil
from pydantic import BaseModel

from warmctl import lifecycle
from warmctl.checkpoint import capture
from warmctl.config import Settings
from warmctl.engine import vllm
from warmctl.state import all_states

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


def _procs_in(d: Path) -> list[psutil.Process]:
    out = []
    for p in psutil.process_iter():
        try:
            if Path(p.cwd()) == d:
                out.append(p)
        except (psutil.Error, OSError):
            continue
    return out


def recover(settings: Settings, interrupted: list[Job]) -> RecoveryReport:
    """Adopt or clean every engine (see the module doc). ``interrupted`` are the jobs the
    previous agent left running. Never raises for one engine's trouble: it is reported."""
    report = RecoveryReport(at=time.time(), interrupted_jobs=[j.id for j in interrupted])
    adopted: set[str] = set()
    for st in all_states(settings.run_dir):
        if st.phase == "serving" and st.engine_alive() and st.gate_alive():
            adopted.add(st.name)
            report.actions.append(RecoveryAction(
                action="adopted", engine=st.name,
                detail=f"serving on {st.public_host}:{st.public_port}, engine pid {st.root_pid}, gate pid {st.gate_pid}"))
            continue
        why = (f"left in phase {st.phase}" + ("" if st.engine_alive() else ", engine dead")
               + ("" if st.gate_alive() else ", gate closed"))
        try:
            lifecycle.down(st.name, settings)
            detail = f"{why}; killed engine pid {st.root_pid} and gate pid {st.gate_pid}, removed {len(st.shm_files)} shm files"
        except Exception as e:  # noqa: BLE001 - report, go on with the others
            detail = f"{why}; cleanup failed: {e}"
        report.actions.append(RecoveryAction(action="cleaned", engine=st.name, detail=detail))

    run_dir = Path(settings.run_dir)
    for d in sorted(p for p in run_dir.glob("*") if p.is_dir()) if run_dir.exists() else []:
        if d.name in adopted:
            continue
        killed: list[int] = []
        pidfile = d / "engine.pid"
        try:
            pid = int(pidfile.read_text().strip())
        except (OSError, ValueError):
            pid = 0
        if pid and vllm.pid_alive(pid):
            vllm.kill_tree(pid)
            killed.append(pid)
        for p in _procs_in(d.resolve()):
            if p.pid in killed or p.pid == psutil.Process().pid:
                continue
            vllm.kill_tree(p.pid)
            killed.append(p.pid)
        removed_images = (d / "images").exists()
        if removed_images:
            shutil.rmtree(d / "images", ignore_errors=True)
        if killed or removed_images:
            parts = []
            if killed:
                parts.append(f"killed left-over processes {killed}")
            if removed_images:
                parts.append("removed a half-written image directory")
            existing = next((a for a in report.actions if a.engine == d.name), None)
            if existing:
                existing.detail += "; " + ", ".join(parts)
            else:
                report.actions.append(RecoveryAction(action="cleaned", engine=d.name, detail=", ".join(parts)))

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
