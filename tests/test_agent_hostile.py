"""The agent as an attack surface (issue 19), on the real agent: start-up recovery on a home
with planted records (it acts only on records it wrote), and the REST API under hostile or
broken clients (run as ``python -m warmctl agent``, the real uvicorn server).

Processes started here are ``sleep``/``sh`` trees in their own sessions; each test kills what
it started. No timed assertions: bounds are generous (an answer at all within seconds).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.test_agent_api import TOKEN, LiveAgent
from warmctl.proc import kill_child
from warmctl.state import EngineState, save as save_state

NOBODY = 65534  # the unprivileged user/group of Debian and most distributions


def _sleep(cwd: Path | None = None) -> subprocess.Popen:
    return subprocess.Popen(["sleep", "300"], cwd=cwd, start_new_session=True)


def _reap(*procs: subprocess.Popen) -> None:
    """Kill each tree we started (its children too) and reap it."""
    for p in procs:
        kill_child(p, timeout_s=2)
        p.wait(10)


def _state(name: str, run: Path, **kw) -> EngineState:
    return EngineState(name=name, phase="health", source="restore", internal_port=1, public_host="127.0.0.1",
                       public_port=2, served_model_name=name, log_path=str(run / "engine.log"), **kw)


def _recovery(home: Path) -> dict:
    a = LiveAgent(home)
    try:
        return a.http.get("/v1/agent").json()["recovery"]
    finally:
        a.stop()


def _ident(p: subprocess.Popen) -> dict:
    """The fields a record holds for ``p`` (pid and creation time; what any version records)."""
    import psutil

    return {"root_pid": p.pid, "root_ctime": psutil.Process(p.pid).create_time()}


@pytest.fixture
def shm_victim():
    f = Path("/dev/shm") / f"warmctl-test-victim-{os.getpid()}-{time.monotonic_ns()}"
    f.write_bytes(b"x")
    yield f
    f.unlink(missing_ok=True)


# ------------------------------------------------------------------------ recovery


def test_recovery_leaves_records_of_another_user_alone(tmp_path, shm_victim):
    """A run directory, and a state.json in a directory of ours, planted by uid 65534: the
    recorded live process is not killed, the recorded files (one outside /dev/shm) stay."""
    home = tmp_path / "home"
    victim = tmp_path / "victim.txt"  # outside /dev/shm
    victim.write_text("mine")
    p1, p2 = _sleep(), _sleep()
    try:
        for name, proc, chown_dir in (("evil", p1, True), ("tiny", p2, False)):
            run = home / "run" / name
            save_state(home / "run", _state(name, run, shm_files=[str(victim), str(shm_victim)], **_ident(proc)))
            os.chown(run / "state.json", NOBODY, NOBODY)
            if chown_dir:
                os.chown(run, NOBODY, NOBODY)
        rep = _recovery(home)
        acts = {a["engine"]: a for a in rep["actions"]}
        assert p1.poll() is None and p2.poll() is None
        assert victim.read_text() == "mine" and shm_victim.exists()
        assert (home / "run" / "evil" / "state.json").exists() and (home / "run" / "tiny" / "state.json").exists()
        assert acts["evil"]["action"] == "ignored" and "owned by uid 65534" in acts["evil"]["detail"]
        assert acts["tiny"]["action"] == "ignored" and "state.json" in acts["tiny"]["detail"]
    finally:
        _reap(p1, p2)


def test_recovery_never_follows_a_symlinked_run_directory(tmp_path):
    home = tmp_path / "home"
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "images").mkdir(parents=True)
    p = _sleep()
    try:
        save_state(tmp_path, _state("elsewhere", elsewhere, **_ident(p)))
        (home / "run").mkdir(parents=True)
        (home / "run" / "tiny").symlink_to(elsewhere)
        rep = _recovery(home)
        assert p.poll() is None
        assert (elsewhere / "images").is_dir() and (elsewhere / "state.json").exists()
        act = {a["engine"]: a for a in rep["actions"]}["tiny"]
        assert act["action"] == "ignored" and "symbolic link" in act["detail"]
    finally:
        _reap(p)


def test_recovery_never_writes_through_a_job_id_with_dotdot(tmp_path):
    """A job file whose id climbs out of the jobs directory: nothing is written or removed
    outside it (the old agent rewrote it as interrupted at jobs/../../NAME.json)."""
    home = tmp_path / "home"
    jobs = home / "agent" / "jobs"
    jobs.mkdir(parents=True)
    job = {"id": "../../escape", "kind": "up", "target": "tiny", "state": "running", "created_at": time.time()}
    planted = jobs / "j-0123456789ab.json"
    planted.write_text(json.dumps(job))
    outside = home / "escape.json"
    rep = _recovery(home)
    assert not outside.exists() and not list(home.glob("*.json"))
    assert json.loads(planted.read_text())["state"] == "running"  # left untouched
    assert rep["interrupted_jobs"] == []


def test_recovery_leaves_a_stale_engine_pid_alone(tmp_path):
    """``engine.pid``/``restore.pid`` left from before a reboot, naming what is now an
    unrelated live process (a ``sleep`` started here): not killed."""
    home = tmp_path / "home"
    run = home / "run" / "tiny"
    run.mkdir(parents=True)
    unrelated, other = _sleep(), _sleep()
    try:
        (run / "engine.pid").write_text(f"{unrelated.pid}\n")
        (run / "restore.pid").write_text(f"{other.pid}\n")
        _recovery(home)
        assert unrelated.poll() is None and other.poll() is None
    finally:
        _reap(unrelated, other)


def test_recovery_leaves_a_shell_in_a_run_directory_alone(tmp_path):
    """An operator's shell whose working directory is ``run/NAME`` of an engine already down."""
    home = tmp_path / "home"
    run = home / "run" / "tiny"
    run.mkdir(parents=True)
    shell = subprocess.Popen(["sh", "-c", "sleep 300"], cwd=run, start_new_session=True)
    try:
        _recovery(home)
        assert shell.poll() is None
    finally:
        _reap(shell)
