"""The agent's API on a real uvicorn on loopback (ports the kernel picks), no engine: auth, 409,
jobs and their SSE stream, metrics, the OpenAPI document, token files, TLS, sd_notify,
job persistence and start-up recovery of left-overs, and the client's error mapping."""

from __future__ import annotations

import datetime
import json
import os
import socket
import ssl
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import uvicorn

from warmctl.agent import create_app, read_token, sd_notify
from warmctl.agent.jobs import JobManager
from warmctl.client import AgentClient, AgentError
from warmctl.records.config import Settings
from warmctl.records.contract import UpRequest
from warmctl.base.errors import HostError, SnapshotNotFound
from warmctl.base.proc import ProcessId
from warmctl.records.state import EngineState, save as save_state
from tests.ports import free_port

REPO = Path(__file__).resolve().parent.parent
TOKEN = "test-token-0123456789"


class LiveAgent:
    """The agent app on a real uvicorn server in a thread."""

    def __init__(self, home: Path, token: str | None = TOKEN):
        self.settings = Settings(home=home, keys_dir=home / "keys", profile_dirs=[home / "profiles"])
        self.app = create_app(self.settings, token)
        self.agent = self.app.state.agent
        sock = socket.socket()  # port 0: the kernel picks a free one (no race with other suites)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning",
                                                    lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            assert time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.02)
        self.http = httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10)

    def stop(self) -> None:
        self.http.close()
        self.server.should_exit = True
        self.thread.join(10)


@pytest.fixture
def live(tmp_path):
    a = LiveAgent(tmp_path / "home")
    yield a
    a.stop()


V1_GETS = ["/v1/agent", "/v1/engines", "/v1/engines/tiny", "/v1/snapshots", "/v1/catalog", "/v1/host", "/v1/jobs",
           "/v1/jobs/j-000000000000", "/v1/jobs/j-000000000000/events", "/metrics"]


def test_probes_need_no_token(live):
    assert live.agent.ready
    r = httpx.get(live.url + "/healthz")
    assert r.status_code == 200 and r.json()["status"] == "ok"
    r = httpx.get(live.url + "/readyz")
    assert r.status_code == 200 and r.json()["status"] == "ready"


@pytest.mark.parametrize("path", V1_GETS)
def test_401_without_or_with_wrong_token(live, path):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {TOKEN}"}):
        r = httpx.get(live.url + path, headers=headers)
        assert r.status_code == 401, (path, headers, r.text)
        assert r.json()["error"] == "unauthorized"
        assert r.headers["www-authenticate"] == "Bearer"
    r = httpx.post(live.url + "/v1/engines/tiny/down")
    assert r.status_code == 401
    assert not live.agent.jobs.list(), "an unauthenticated request started a job"


def test_engine_down_job_and_its_event_stream(live):
    r = live.http.post("/v1/engines/nothing/down")
    assert r.status_code == 202
    job = r.json()
    assert r.headers["location"] == f"/v1/jobs/{job['id']}"
    assert job["kind"] == "down" and job["target"] == "nothing"
    with live.http.stream("GET", f"/v1/jobs/{job['id']}/events") as s:
        assert s.headers["content-type"].startswith("text/event-stream")
        text = "".join(s.iter_text())
    types = [ln.split(": ", 1)[1] for ln in text.splitlines() if ln.startswith("event: ")]
    assert types[0] == "state" and types[-1] == "end", types
    assert "phase_started" in types and "phase_finished" in types
    end = json.loads([ln for ln in text.splitlines() if ln.startswith("data: ")][-1][6:])
    assert end["state"] == "succeeded" and end["result"] == {"was_up": False, "state": None}
    j = live.http.get(f"/v1/jobs/{job['id']}").json()
    assert j["state"] == "succeeded" and j["progress"]["phases"][0]["name"] == "down"
    assert j["log"][-1] == "succeeded"
    # resuming after the last event yields nothing more
    with live.http.stream("GET", f"/v1/jobs/{job['id']}/events", headers={"Last-Event-ID": "99"}) as s:
        assert "".join(s.iter_text()) == ""
    assert (live.settings.home / "agent" / "jobs" / f"{job['id']}.json").exists()


def test_409_names_the_holder_job(live):
    release = threading.Event()

    def blocking(rep, job):
        with rep.phase("restore", "held open by the test"):
            release.wait(20)
        return {"ok": True}

    holder = live.agent.jobs.submit("up", "tiny", ["engine:tiny", "port:18580"], blocking)
    try:
        r = live.http.post("/v1/engines/tiny/down")
        assert r.status_code == 409, r.text
        body = r.json()
        assert body["error"] == "conflict" and body["holder"] == holder.id
        assert holder.id in body["message"] and "engine:tiny" in body["message"]
        r = live.http.post("/v1/engines/tiny/up", json={})
        assert r.status_code == 409 and r.json()["holder"] == holder.id
        # another engine on the same public port is refused too
        r = live.http.post("/v1/engines/other/up", json={"port": 18580})
        assert r.status_code == 409 and r.json()["holder"] == holder.id and "port:18580" in r.json()["message"]
        r = live.http.delete("/v1/snapshots/tiny/latest")
        assert r.status_code == 409 and r.json()["holder"] == holder.id
        # status shows the job's phase and its running timing
        v = live.http.get("/v1/engines/tiny").json()
        assert v["phase"] == "pending" and v["job"] == holder.id and v["job_phase"] == "restore"
        assert v["timings"]["restore"] >= 0
        assert [e["name"] for e in live.http.get("/v1/engines").json()] == ["tiny"]
    finally:
        release.set()
    assert live.agent.jobs.wait(holder.id, 10).state == "succeeded"
    r = live.http.post("/v1/engines/tiny/down")
    assert r.status_code == 202


def test_the_same_up_while_one_is_under_way_answers_that_job(live):
    """Two schedulers asking for the same up at once get one job (idempotent), not a 409."""
    from warmctl.records.contract import UpOptions

    release = threading.Event()

    def blocking(rep, job):
        release.wait(20)
        return {"ok": True}

    params = UpOptions(tag="latest").model_dump()
    holder = live.agent.jobs.submit("up", "tiny", ["engine:tiny"], blocking, params)
    try:
        r = live.http.post("/v1/engines/tiny/up", json={})
        assert r.status_code == 202 and r.json()["id"] == holder.id, r.text
        assert r.headers["location"] == f"/v1/jobs/{holder.id}"
        r = live.http.post("/v1/engines/tiny/up", json={"insecure": True})  # another request: refused
        assert r.status_code == 409 and r.json()["holder"] == holder.id
    finally:
        release.set()
    assert live.agent.jobs.wait(holder.id, 10).state == "succeeded"
    assert [j.id for j in live.agent.jobs.list() if j.kind == "up"] == [holder.id]


def test_up_without_snapshot_or_profile_fails_with_the_reason(live):
    c = AgentClient(live.url, TOKEN)
    with pytest.raises(SnapshotNotFound, match="no snapshot nosuch:latest"):
        c.up(UpRequest(name="nosuch"))
    j = live.http.get("/v1/jobs", params={"state": "failed"}).json()[0]
    assert j["error"]["type"] == "SnapshotNotFound" and j["error"]["exit_code"] == 4
    m = live.http.get("/metrics").text
    assert 'warmctl_jobs_finished_total{kind="up",state="failed"} 1.0' in m
    assert 'warmctl_jobs{kind="up",state="failed"} 1.0' in m


def test_metrics_exposition(live):
    save_state(live.settings.run_dir, EngineState(
        name="ghost", phase="serving", source="restore", root_pid=2**22 + 7, internal_port=1, public_host="127.0.0.1",
        public_port=2, served_model_name="x", log_path="/dev/null"))
    r = live.http.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    for name in ("warmctl_restore_phase_seconds", "warmctl_bytes_pulled_total", "warmctl_canary_total",
                 "warmctl_cold_start_seconds", "warmctl_agent_recovered_total"):
        assert f"# TYPE {name.removesuffix('_total')}" in r.text, name
    assert 'warmctl_engine_state{name="ghost",phase="dead"} 1.0' in r.text
    assert 'warmctl_engine_up{name="ghost"} 0.0' in r.text
    assert 'warmctl_canary_total{result="fail"} 0.0' in r.text
    v = live.http.get("/v1/engines/ghost").json()
    assert v["phase"] == "dead" and not v["engine_alive"]


def test_validation_and_not_found(live):
    assert live.http.get("/v1/jobs/j-ffffffffffff").status_code == 404
    assert live.http.get("/v1/jobs/not-a-job").status_code == 422
    assert live.http.get("/v1/engines/..%2Fetc").status_code in (404, 422)
    r = live.http.post("/v1/engines/tiny/up", json={"port": 0})
    assert r.status_code == 422 and r.json()["error"] == "unprocessable" and "port" in r.json()["message"]
    r = live.http.post("/v1/engines/tiny/up", json={"bogus": 1})
    assert r.status_code == 422
    r = live.http.delete("/v1/snapshots/tiny/latest")
    assert r.status_code == 404 and "no snapshot tiny:latest" in r.json()["message"]
    r = live.http.post("/v1/snapshots", json={"profile": "nosuchprofile"})
    assert r.status_code == 404 and "no profile named" in r.json()["message"]
    assert not live.agent.jobs.list()


def test_client_errors_are_clear(live):
    with pytest.raises(AgentError, match="refused the token") as e:
        AgentClient(live.url, "wrong").status()
    assert e.value.status == 401
    port = free_port()
    with pytest.raises(HostError, match=f"cannot reach the warmctl agent at http://127.0.0.1:{port}"):
        AgentClient(f"http://127.0.0.1:{port}", TOKEN).status()
    assert AgentClient(live.url, TOKEN).status() == []
    assert AgentClient(live.url, TOKEN).down("nothing") is None


def test_openapi_document_is_current():
    r = subprocess.run([sys.executable, "-m", "warmctl.agent.openapi", "--check"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    doc = json.loads((REPO / "docs" / "openapi.json").read_text())
    assert doc["paths"]["/v1/engines/{name}/up"]["post"]["responses"]["409"]
    assert doc["components"]["securitySchemes"]["HTTPBearer"]["scheme"] == "bearer"


def test_openapi_served_without_token(live):
    r = httpx.get(live.url + "/openapi.json")
    assert r.status_code == 200 and "/v1/jobs/{job_id}/events" in r.json()["paths"]


def test_token_file(tmp_path):
    p = tmp_path / "agent" / "token"
    tok = read_token(p)
    assert len(tok) >= 40 and p.stat().st_mode & 0o777 == 0o600
    assert read_token(p) == tok
    p.chmod(0o644)
    with pytest.raises(HostError, match="readable by group or others"):
        read_token(p)
    p.chmod(0o600)
    p.write_text("\n")
    with pytest.raises(HostError, match="empty"):
        read_token(p)
    # the client reads the same file with the same reader, minus the mode check (a copy elsewhere)
    p.write_text("  client-token-0123  \nsecond line\n")
    p.chmod(0o644)
    settings = Settings(home=tmp_path, agent_url="http://127.0.0.1:9", agent_token_file=p)
    assert AgentClient.from_settings(settings).http.headers["authorization"] == "Bearer client-token-0123"
    p.write_text("")
    with pytest.raises(HostError, match=f"agent token file {p} is empty"):
        AgentClient.from_settings(settings)


def test_sd_notify_datagram(tmp_path):
    sock_path = str(tmp_path / "notify")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.bind(sock_path)
        s.settimeout(2)
        assert sd_notify("READY=1", {"NOTIFY_SOCKET": sock_path})
        assert s.recv(1024) == b"READY=1"
    assert not sd_notify("READY=1", {})
    assert not sd_notify("READY=1", {"NOTIFY_SOCKET": str(tmp_path / "absent")})


def _agent_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    cfg = tmp_path / "config.toml"
    cfg.write_text(f'home = "{tmp_path / "home"}"\nkeys_dir = "{tmp_path / "keys"}"\n')
    env = {k: v for k, v in os.environ.items() if not k.startswith("WARMCTL_") and k != "NOTIFY_SOCKET"}
    env.update({"WARMCTL_CONFIG": str(cfg), "PYTHONUNBUFFERED": "1", **extra})
    return env


def test_agent_process_notifies_ready_only_when_serving(tmp_path):
    """`warmctl agent` as systemd runs it: READY=1 arrives once the port answers."""
    port = free_port()
    sock_path = str(tmp_path / "notify")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.bind(sock_path)
        s.settimeout(120)
        proc = subprocess.Popen([sys.executable, "-m", "warmctl", "agent", "--port", str(port)],
                                env=_agent_env(tmp_path, NOTIFY_SOCKET=sock_path),
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            msg = s.recv(4096).decode()
            assert msg.startswith("READY=1\n") and f"MAINPID={proc.pid}" in msg, msg
            r = httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=2)
            assert r.status_code == 200
            tok = (tmp_path / "home" / "agent" / "token").read_text().strip()
            r = httpx.get(f"http://127.0.0.1:{port}/v1/agent", headers={"Authorization": f"Bearer {tok}"})
            assert r.json()["pid"] == proc.pid and r.json()["tls"] is False
            proc.terminate()
            assert s.recv(4096) == b"STOPPING=1"
            # uvicorn re-raises SIGTERM after a clean shutdown; systemd counts that as success
            assert proc.wait(15) in (0, -15)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def test_agent_process_refuses_a_taken_port(tmp_path):
    port = free_port()
    with socket.socket() as held:
        held.bind(("127.0.0.1", port))
        held.listen()
        r = subprocess.run([sys.executable, "-m", "warmctl", "agent", "--port", str(port)], env=_agent_env(tmp_path),
                           capture_output=True, text=True, timeout=60)
    assert r.returncode == 10 and f"agent address 127.0.0.1:{port} is already in use" in r.stderr


def _self_signed(tmp_path: Path) -> tuple[Path, Path]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID
    import ipaddress

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(1).not_valid_before(now - datetime.timedelta(minutes=1))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False)
            .sign(key, hashes.SHA256()))
    c, k = tmp_path / "cert.pem", tmp_path / "key.pem"
    c.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    k.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                    serialization.NoEncryption()))
    k.chmod(0o600)
    return c, k


def test_agent_process_with_tls(tmp_path):
    cert, key = _self_signed(tmp_path)
    port = free_port()
    tokf = tmp_path / "tok"
    tokf.write_text("tls-token\n")
    tokf.chmod(0o600)
    proc = subprocess.Popen([sys.executable, "-m", "warmctl", "agent", "--port", str(port), "--token-file", str(tokf),
                             "--tls-cert", str(cert), "--tls-key", str(key)], env=_agent_env(tmp_path),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                r = httpx.get(f"https://127.0.0.1:{port}/healthz", verify=ssl.create_default_context(cafile=str(cert)), timeout=2)
                break
            except httpx.TransportError:
                assert proc.poll() is None and time.monotonic() < deadline, "TLS agent did not start"
                time.sleep(0.2)
        assert r.status_code == 200
        with pytest.raises(httpx.TransportError):
            httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2).raise_for_status()
        c = AgentClient(f"https://127.0.0.1:{port}", "tls-token", verify=str(cert))
        assert c.request("GET", "/v1/agent")["tls"] is True
        with pytest.raises(AgentError):
            AgentClient(f"https://127.0.0.1:{port}", "nope", verify=str(cert)).status()
    finally:
        proc.terminate()
        proc.wait(15)


def test_half_a_tls_pair_is_refused(tmp_path):
    cert, _ = _self_signed(tmp_path)
    r = subprocess.run([sys.executable, "-m", "warmctl", "agent", "--port", str(free_port()), "--tls-cert", str(cert)],
                       env=_agent_env(tmp_path), capture_output=True, text=True, timeout=60)
    assert r.returncode == 10 and "TLS needs both --tls-cert and --tls-key" in r.stderr


def test_jobs_survive_a_restart_as_interrupted(tmp_path):
    jobs_dir = tmp_path / "jobs"
    m = JobManager(jobs_dir)
    gate = threading.Event()

    def slow(rep, job):
        with rep.phase("restore"):
            gate.wait(10)

    j = m.submit("up", "tiny", ["engine:tiny"], slow)
    time.sleep(0.2)
    # a second manager on the same directory = the agent restarted after kill -9
    m2 = JobManager(jobs_dir)
    interrupted = m2.load_from_disk()
    gate.set()
    assert [x.id for x in interrupted] == [j.id]
    again = m2.get(j.id)
    assert again.state == "interrupted" and again.error.type == "Interrupted"
    assert again.progress.phases[0].name == "restore"
    assert m2.holder("engine:tiny") is None  # nothing is held after a restart


def test_recovery_cleans_what_a_dead_up_left(tmp_path):
    """A state file short of `serving` whose engine process still runs (its identity recorded),
    a tree CRIU restored after the record whose PID only reached `restore.pid`, plus a
    half-written image directory: the agent kills and removes them at start. An operator's
    shell whose working directory is the run directory is left alone."""
    home = tmp_path / "home"
    run = home / "run" / "tiny"
    (run / "images").mkdir(parents=True)
    (run / "images" / "pages-1.img").write_bytes(b"x" * 10)
    shell = subprocess.Popen(["sleep", "300"], cwd=run, start_new_session=True)
    st = EngineState(name="tiny", phase="health", source="restore", internal_port=1, public_host="127.0.0.1",
                     public_port=2, served_model_name="tiny", log_path=str(run / "engine.log"), started_at=time.time())
    save_state(home / "run", st)
    recorded = subprocess.Popen(["sleep", "300"], start_new_session=True)
    orphan = subprocess.Popen(["sleep", "300"], start_new_session=True)
    (run / "restore.pid").write_text(str(orphan.pid))  # CRIU wrote it; the record never got it
    _wait_exec(recorded, "sleep")
    st.set_root(ProcessId.of(recorded.pid))
    save_state(home / "run", st)
    a = LiveAgent(home)
    try:
        rep = a.http.get("/v1/agent").json()["recovery"]
        acts = {x["engine"]: x for x in rep["actions"]}
        assert acts["tiny"]["action"] == "cleaned" and "left in phase health" in acts["tiny"]["detail"]
        assert "half-written image directory" in acts["tiny"]["detail"]
        assert recorded.wait(10) is not None and orphan.wait(10) is not None
        assert shell.poll() is None  # its working directory makes nothing ours
        assert not (run / "state.json").exists() and not (run / "images").exists()
        assert not (run / "restore.pid").exists()
        assert a.http.get("/v1/engines/tiny").json()["phase"] == "down"
        assert 'warmctl_agent_recovered_total{action="cleaned"} 1.0' in a.http.get("/metrics").text
    finally:
        a.stop()
        for p in (recorded, orphan, shell):
            if p.poll() is None:
                p.kill()
                p.wait()


def _wait_exec(p: subprocess.Popen, name: str) -> None:
    """Until ``p`` runs ``name`` (Popen returns after exec, but be explicit for the identity)."""
    import psutil

    deadline = time.monotonic() + 10
    while Path(psutil.Process(p.pid).exe()).name != name:
        assert time.monotonic() < deadline
        time.sleep(0.01)
