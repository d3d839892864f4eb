"""End to end: `warmctl agent` as a subprocess on loopback, driven like a scheduler over REST;
the CLI through the agent; and the agent killed with SIGKILL in the middle of an ``up`` and
while an engine serves.

What is tested is the agent's own work (jobs, locks, recovery, its CLI path), so the engine is
the two-process stand-in ``tests/fake_vllm.py`` (``fake_snapshot`` in ``fk_env``), restored by
the real CRIU; its canary is held (``fk_env``'s hold file) where a test needs the ``up`` caught
in flight. The agent with the real engine is tested by test_e2e_fleet.py
(``test_agent_on_b_restores_from_the_remote``) and test_first_hour.py.

Only one engine runs at a time; every test leaves nothing running.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest

from tests.conftest import procs_under, stop_process, wait_agent_ready, warmctl
from tests.ports import free_port

pytestmark = pytest.mark.e2e


class Agent:
    """`python -m warmctl agent` with ``env``; ``http`` carries its token."""

    def __init__(self, env: dict[str, str], port: int | None = None):
        self.env = env
        self.home = Path(env["WARMCTL_TEST_HOME"])
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(self.home.parent / f"agent-{self.port}-{time.time():.0f}.log", "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "warmctl", "agent", "--port", str(self.port)], env=env,
                                     stdout=self.log, stderr=subprocess.STDOUT)
        wait_agent_ready(self.url, self.proc, self.logtext, timeout_s=120)
        token = (self.home / "agent" / "token").read_text().strip()
        self.http = httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {token}"}, timeout=30)

    def logtext(self) -> str:
        self.log.flush()
        return Path(self.log.name).read_text()

    def wait_job(self, job_id: str, timeout: float = 300) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            j = self.http.get(f"/v1/jobs/{job_id}").json()
            if j["state"] not in ("queued", "running"):
                return j
            assert time.monotonic() < deadline, f"job {job_id} still {j['state']}: {j['log'][-5:]}"
            time.sleep(0.2)

    def kill9(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)
        self.http.close()

    def stop(self) -> None:
        stop_process(self.proc)
        self.http.close()
        self.log.close()


def _engine_procs(home: Path) -> list[psutil.Process]:
    """Live processes of the engines of ``home`` (:func:`procs_under` its run directory)."""
    return procs_under(home / "run")


def _snapshot_shm(env, name: str = "tiny") -> list[str]:
    """Names of /dev/shm files the newest snapshot ``name`` restores."""
    from warmctl.naming.catalog import Catalog
    from warmctl.records.config import load_settings
    from warmctl.store import open_store

    old = os.environ.get("WARMCTL_CONFIG")
    os.environ["WARMCTL_CONFIG"] = env["WARMCTL_CONFIG"]
    try:
        s = load_settings()
    finally:
        if old is None:
            os.environ.pop("WARMCTL_CONFIG")
        else:
            os.environ["WARMCTL_CONFIG"] = old
    st = open_store(s.store_dir)
    m = st.get_manifest(Catalog(st).newest(name))
    return [f.path for f in m.files if f.role == "shm"]


def _hold(env) -> Path:
    """The file that, while it exists, holds the fake engine's canary (:func:`tests.conftest.fake_env`)."""
    return Path(env["WARMCTL_CONFIG"]).parent / "hold"


@pytest.fixture
def clean(fk_env):
    """Make sure no fake engine is left, and its canary not held, before and after."""
    _hold(fk_env).unlink(missing_ok=True)
    warmctl("down", "fake", env=fk_env, check=False)
    yield
    _hold(fk_env).unlink(missing_ok=True)
    warmctl("down", "fake", env=fk_env, check=False)
    home = Path(fk_env["WARMCTL_TEST_HOME"])
    left = _engine_procs(home)
    for p in left:
        p.kill()
    assert not left, f"processes left behind: {left}"
    # no PID record survives down: engine.pid, CRIU's restore.pid
    assert not list((home / "run").glob("*/*.pid")), list((home / "run").glob("*/*.pid"))


def test_scheduler_drives_up_status_down(fk_env, fake_snapshot, fake_ports, clean):
    wc_env, engine_ports, snap = fk_env, fake_ports, fake_snapshot
    # no verified image kept by an earlier test's up in this home: this up reads the store
    shutil.rmtree(Path(wc_env["WARMCTL_TEST_HOME"]) / "cache" / "images", ignore_errors=True)
    agent = Agent(wc_env)
    try:
        h = agent.http
        assert h.get("/v1/snapshots").json()[0]["digest"] == snap["digest"]
        _hold(wc_env).touch()  # the up waits in its canary until the phases were seen
        r = h.post("/v1/engines/fake/up", json={"tag": "latest"})
        assert r.status_code == 202, r.text
        job = r.json()
        # a second operation on the same engine is refused, naming the holder
        r2 = h.post("/v1/engines/fake/down")
        assert r2.status_code == 409 and r2.json()["holder"] == job["id"]
        # the same up again follows the job under way (idempotent); another request is refused
        r3 = h.post("/v1/engines/fake/up", json={})
        assert r3.status_code == 202 and r3.json()["id"] == job["id"], r3.text
        r4 = h.post("/v1/engines/fake/up", json={"tag": "other"})
        assert r4.status_code == 409 and r4.json()["holder"] == job["id"]
        seen_phases = set()
        deadline = time.monotonic() + 300
        while True:
            v = h.get("/v1/engines/fake").json()
            seen_phases.add(v["phase"])
            if v["phase"] == "canary":
                _hold(wc_env).unlink(missing_ok=True)
            if v["phase"] == "serving" and v["job"] is None:
                break
            assert v["phase"] != "failed" and time.monotonic() < deadline, v
            time.sleep(0.1)
        j = agent.wait_job(job["id"])
        assert j["state"] == "succeeded", j
        assert j["result"]["source"] == "restore" and j["result"]["snapshot"] == snap["digest"]
        names = [p["name"] for p in j["progress"]["phases"]]
        assert names == ["catalog", "materialize", "restore", "ranks", "health", "canary", "gate"], names
        assert "canary" in seen_phases, seen_phases
        assert v["healthy"] and v["engine_alive"] and v["gate_alive"]
        assert set(v["timings"]) >= {"materialize", "restore", "health", "canary", "gate", "total"}
        # the root's identity is recorded (engine.pid and the state), CRIU's bare PID file is gone
        run = agent.home / "run" / "fake"
        rec = json.loads((run / "engine.pid").read_text())
        assert rec["pid"] == v["state"]["root_pid"] and rec["exe"] and rec["exe"] == v["state"]["root_exe"]
        assert not (run / "restore.pid").exists()
        # the engine answers on the public port
        r = httpx.post(f"http://127.0.0.1:{engine_ports[1]}/v1/completions",
                       json={"model": "fake", "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0},
                       timeout=60)
        assert r.status_code == 200 and r.json()["choices"][0]["text"]
        m = h.get("/metrics").text
        assert 'warmctl_canary_total{result="pass"} 1.0' in m
        assert 'warmctl_engine_state{name="fake",phase="serving"} 1.0' in m
        assert 'warmctl_restore_phase_seconds_count{phase="restore"} 1.0' in m
        pulled = float(next(ln.split()[-1] for ln in m.splitlines() if ln.startswith("warmctl_bytes_pulled_total")))
        assert pulled >= sum(j["result"]["fetched"].values()) > 2**20
        # up again changes nothing
        j2 = agent.wait_job(h.post("/v1/engines/fake/up", json={}).json()["id"])
        assert j2["state"] == "succeeded" and j2["result"]["already_up"] and j2["result"]["path"] == "already-up"
        # down
        jd = agent.wait_job(h.post("/v1/engines/fake/down").json()["id"], 60)
        assert jd["state"] == "succeeded" and jd["result"]["was_up"] is True
        assert h.get("/v1/engines/fake").json()["phase"] == "down"
        assert not _engine_procs(agent.home)
        shm = _snapshot_shm(wc_env, "fake")
        assert shm
        for name in shm:
            assert not Path("/dev/shm", name).exists(), name
    finally:
        agent.stop()


def test_cli_through_the_agent_gives_the_same_output(fk_env, fake_snapshot, clean):
    wc_env = fk_env
    agent = Agent(wc_env)
    try:
        env = {**wc_env, "WARMCTL_AGENT_URL": agent.url}
        before = {j["id"] for j in agent.http.get("/v1/jobs", params={"limit": 500}).json()}
        up = warmctl("up", "fake", env=env, timeout=300)
        assert "fake up (restore)" in up.stdout and "serving fake on http://127.0.0.1:" in up.stdout, up.stdout
        for phase in ("materialize", "restore", "canary", "gate"):
            assert phase in up.stdout
        assert "ok canary" in up.stderr.replace("  ", " ") or "canary" in up.stderr
        new = [j for j in agent.http.get("/v1/jobs", params={"limit": 500}).json() if j["id"] not in before]
        assert [(j["kind"], j["target"], j["state"]) for j in new] == [("up", "fake", "succeeded")], \
            "the CLI did not go through the agent"
        via_agent = warmctl("status", "--json", env=env).stdout
        local = warmctl("status", "--json", env=wc_env).stdout
        import json

        a, b = json.loads(via_agent), json.loads(local)
        assert a == b and a[0]["phase"] == "serving" and a[0]["healthy"] is True
        tbl_a = warmctl("status", env=env).stdout
        tbl_b = warmctl("status", env=wc_env).stdout
        assert tbl_a == tbl_b
        again = warmctl("up", "fake", env=env, timeout=120)
        assert "is already up" in again.stdout and "nothing changed" in again.stdout
        down = warmctl("down", "fake", env=env, timeout=120)
        assert down.stdout.strip() == "fake is down"
        down2 = warmctl("down", "fake", env=env, timeout=120)
        assert down2.stdout.strip() == "fake is not up; nothing to do"
        r = warmctl("status", "fake", env=env, check=False)
        assert r.returncode == 1 and "no engines named fake" in r.stdout
        bad = warmctl("up", "nosuch", env=env, check=False)
        assert bad.returncode == 4 and "no snapshot nosuch:latest" in bad.stderr
    finally:
        agent.stop()


def test_kill9_mid_up_then_restart_cleans_up(fk_env, fake_snapshot, fake_ports, clean):
    wc_env, engine_ports = fk_env, fake_ports
    home = Path(wc_env["WARMCTL_TEST_HOME"])
    agent = Agent(wc_env)
    port = agent.port
    _hold(wc_env).touch()  # the restored engine's canary waits: the agent dies in the canary phase
    job = agent.http.post("/v1/engines/fake/up", json={}).json()
    deadline = time.monotonic() + 120
    while True:  # kill it once the restored tree exists and the canary has not passed yet
        j = agent.http.get(f"/v1/jobs/{job['id']}").json()
        done = {p["name"] for p in j["progress"]["phases"] if p["seconds"] is not None}
        if "restore" in done:
            break
        assert j["state"] == "running" and time.monotonic() < deadline, j
        time.sleep(0.05)
    agent.kill9()
    agent.log.close()
    assert (home / "run" / "fake" / "state.json").exists()
    assert _engine_procs(home), "the restored engine should outlive the killed agent"

    agent = Agent(wc_env, port)
    try:
        # it may have finished health/canary/gate in the background? No: those ran in the dead agent.
        report = agent.http.get("/v1/agent").json()["recovery"]
        assert report["interrupted_jobs"] == [job["id"]]
        acts = {a["engine"]: a for a in report["actions"]}
        assert acts["fake"]["action"] == "cleaned", report
        assert "recovery: cleaned fake" in agent.logtext()
        j = agent.http.get(f"/v1/jobs/{job['id']}").json()
        assert j["state"] == "interrupted" and j["error"]["type"] == "Interrupted"
        assert not (home / "run" / "fake" / "state.json").exists()
        assert not _engine_procs(home)
        _hold(wc_env).unlink()
        for name in _snapshot_shm(wc_env, "fake"):
            assert not Path("/dev/shm", name).exists(), name
        from warmctl.gate import port_free

        assert port_free("127.0.0.1", engine_ports[1]) and port_free("127.0.0.1", engine_ports[0])
        assert agent.http.get("/v1/engines/fake").json()["phase"] == "down"
        # and the engine comes up cleanly afterwards
        j = agent.wait_job(agent.http.post("/v1/engines/fake/up", json={}).json()["id"])
        assert j["state"] == "succeeded" and j["result"]["path"] == "restore", j

        # kill -9 while it serves: the next agent adopts it
        agent.kill9()
        agent.log.close()
        agent = Agent(wc_env, port)
        report = agent.http.get("/v1/agent").json()["recovery"]
        assert [(a["action"], a["engine"]) for a in report["actions"]] == [("adopted", "fake")], report
        v = agent.http.get("/v1/engines/fake").json()
        assert v["phase"] == "serving" and v["healthy"]
        jd = agent.wait_job(agent.http.post("/v1/engines/fake/down").json()["id"], 60)
        assert jd["result"]["was_up"] is True
        assert not _engine_procs(home)
    finally:
        agent.stop()
