"""The agent as an attack surface, on the real agent: start-up recovery on a home
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

from tests.conftest import read_to_close, stop_process, wait_agent_ready
from tests.test_agent_api import TOKEN, LiveAgent
from warmctl.base.proc import kill_child
from warmctl.records.state import EngineState, save as save_state

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


# ------------------------------------------------------------------------ the API under hostile clients


#: the test agent's ``agent_header_timeout_s`` and ``agent_keep_alive_s`` (seconds)
HEADER_TIMEOUT_S = 2.0
KEEP_ALIVE_S = 1


class AgentProc:
    """``python -m warmctl agent`` (the real server: uvicorn with the agent's protocol and
    limits) on a free loopback port, home ``home``; ``http`` carries the token."""

    def __init__(self, home: Path, *args: str):
        home.mkdir(parents=True, exist_ok=True)
        (home / "agent").mkdir(mode=0o700, exist_ok=True)
        (home / "agent" / "token").write_text(TOKEN + "\n")
        os.chmod(home / "agent" / "token", 0o600)
        cfg = home / "config.toml"
        # short connection bounds (defaults 10 s and 5 s) keep the slow-client tests short
        cfg.write_text(f'home = "{home}"\nkeys_dir = "{home / "keys"}"\n'
                       f'agent_header_timeout_s = {HEADER_TIMEOUT_S}\nagent_keep_alive_s = {KEEP_ALIVE_S}\n')
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("WARMCTL_")}
        self.env.update({"WARMCTL_CONFIG": str(cfg), "PYTHONUNBUFFERED": "1"})
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = home / "agent.log"
        self.proc = subprocess.Popen([sys.executable, "-m", "warmctl", "agent", "--port", str(self.port), *args],
                                     env=self.env, stdout=open(self.log, "w"), stderr=subprocess.STDOUT)
        wait_agent_ready(self.url, self.proc, self.log.read_text)
        self.http = httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30)

    def stop(self) -> None:
        self.http.close()
        stop_process(self.proc, 15)


@pytest.fixture(scope="module")
def agent_proc(tmp_path_factory):
    """One agent for the module's request-level probes (each test sends its own requests and
    waits for its own connections to end; none changes the agent's state)."""
    a = AgentProc(tmp_path_factory.mktemp("agent-hostile") / "home")
    yield a
    a.stop()


class HungServer:
    """A TCP server on a loopback port (0: the kernel's choice) that accepts connections and
    reads them but never answers: an engine whose ``/health`` hangs."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(512)
        self.port = self.sock.getsockname()[1]
        self.stop_ev = threading.Event()
        self.conns: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        self.sock.settimeout(0.2)
        while not self.stop_ev.is_set():
            try:
                c, _ = self.sock.accept()
                self.conns.append(c)  # held open, never answered
            except OSError:
                continue

    def close(self) -> None:
        self.stop_ev.set()
        for c in self.conns:
            c.close()
        self.sock.close()


def test_healthz_answers_while_60_pollers_wait_on_a_hung_engine(tmp_path):
    """An engine (alive, serving) whose ``/health`` never answers, 60 clients polling
    ``GET /v1/engines`` in a loop: ``/healthz`` still answers (within 5 s each time: a bound
    that only a starved agent misses -- the old agent's callers queued 2 s each behind one
    lock, 40 worker threads deep), and the pollers get answers too."""
    home = tmp_path / "home"
    hung = HungServer()
    engine, gate = _sleep(), _sleep()
    import psutil

    stop = threading.Event()
    answered: list[int] = []
    try:
        run = home / "run" / "hung"
        save_state(home / "run", _state("hung", run, **_ident(engine)).model_copy(update={
            "phase": "serving", "internal_port": hung.port, "gate_pid": gate.pid,
            "gate_ctime": psutil.Process(gate.pid).create_time()}))
        a = AgentProc(home)
        try:
            def poll() -> None:
                with httpx.Client(base_url=a.url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=60) as c:
                    while not stop.is_set():
                        try:
                            answered.append(c.get("/v1/engines").status_code)
                        except httpx.HTTPError:
                            pass
            threads = [threading.Thread(target=poll, daemon=True) for _ in range(60)]
            for t in threads:
                t.start()
            time.sleep(3)  # every poller has sent a request; the probes hang
            for _ in range(5):
                r = httpx.get(a.url + "/healthz", timeout=5)
                assert r.status_code == 200 and r.json()["status"] == "ok"
                time.sleep(0.5)
            rows = a.http.get("/v1/engines", timeout=15).json()
            assert [(x["name"], x["engine_alive"], x["healthy"]) for x in rows] == [("hung", True, False)]
            assert answered and set(answered) == {200}
        finally:
            stop.set()
            a.stop()
    finally:
        hung.close()
        _reap(engine, gate)


def _read_status(s: socket.socket, timeout: float) -> bytes:
    s.settimeout(timeout)
    data = b""
    try:
        while b"\r\n" not in data:
            chunk = s.recv(4096)
            if not chunk:
                break
            data += chunk
    except socket.timeout:
        pass
    return data.split(b"\r\n", 1)[0]


@pytest.mark.parametrize("token", [None, TOKEN])
def test_a_10mb_body_is_refused_before_it_is_read(agent_proc, token):
    """``POST`` with ``Content-Length: 10 MB``, of which only the first 64 KiB are sent: the
    agent answers (401 without the token, 413 with it) while the client still owes 99% of
    the body -- it did not wait for, read or parse it -- and its memory did not grow by the
    body's size."""
    import psutil

    size = 10 * 2**20
    auth = f"Authorization: Bearer {token}\r\n" if token else ""
    rss0 = psutil.Process(agent_proc.proc.pid).memory_info().rss
    with socket.create_connection(("127.0.0.1", agent_proc.port)) as s:
        s.sendall((f"POST /v1/engines/tiny/up HTTP/1.1\r\nHost: x\r\n{auth}Content-Type: application/json\r\n"
                   f"Content-Length: {size}\r\n\r\n").encode() + b"{" + b" " * (64 * 1024))
        status = _read_status(s, timeout=10)
    assert status.startswith(b"HTTP/1.1 401" if token is None else b"HTTP/1.1 413"), status
    assert psutil.Process(agent_proc.proc.pid).memory_info().rss - rss0 < size / 2
    assert agent_proc.http.get("/healthz").status_code == 200


def test_a_chunked_body_over_the_cap_is_refused(agent_proc):
    def body():
        for _ in range(40):
            yield b"x" * 65536  # 2.5 MiB in all, no Content-Length
    r = agent_proc.http.post("/v1/snapshots", content=body(), headers={"Content-Type": "application/json"})
    assert r.status_code == 413 and r.json()["error"] == "too_large"


def test_slow_header_clients_are_cut_off(agent_proc):
    """50 connections that send a header line every 0.5 s and never finish: all closed by the
    agent within 15 s (its header timeout, ``agent_header_timeout_s``, is 2 s here, 10 s by
    default; the old agent kept them 60 s and more), while a normal client is served meanwhile."""
    conns = []
    for _ in range(50):
        s = socket.create_connection(("127.0.0.1", agent_proc.port))
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
        conns.append(s)
    closed: set[int] = set()
    t0 = time.monotonic()
    deadline = t0 + 15
    n = 0
    while len(closed) < len(conns) and time.monotonic() < deadline:
        n += 1
        for i, s in enumerate(conns):
            if i in closed:
                continue
            try:
                s.sendall(f"X-Slow-{n}: 1\r\n".encode())
                s.settimeout(0.01)
                if s.recv(1) == b"":
                    closed.add(i)
            except socket.timeout:
                pass
            except OSError:
                closed.add(i)
        assert httpx.get(agent_proc.url + "/healthz", timeout=5).status_code == 200
        time.sleep(0.5)
    for s in conns:
        s.close()
    assert len(closed) == len(conns), f"{len(conns) - len(closed)} slow-header connections still open after 15 s"
    assert time.monotonic() - t0 >= HEADER_TIMEOUT_S - 0.5  # closed by the timeout, not at once


def test_listening_beyond_loopback_without_tls_is_refused(tmp_path):
    from warmctl.agent.server import is_loopback

    home = tmp_path / "home"
    cfg = home / "config.toml"
    home.mkdir()
    cfg.write_text(f'home = "{home}"\n')
    env = {k: v for k, v in os.environ.items() if not k.startswith("WARMCTL_")} | {"WARMCTL_CONFIG": str(cfg)}
    r = subprocess.run([sys.executable, "-m", "warmctl", "agent", "--host", "0.0.0.0", "--port", "1"], env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "beyond loopback" in r.stderr + r.stdout and "--insecure-no-tls" in r.stderr + r.stdout
    assert [is_loopback(h) for h in ("127.0.0.1", "::1", "localhost", "127.0.0.2", "0.0.0.0", "::", "10.0.0.1",
                                       "node7.example")] == [True, True, True, True, False, False, False, False]


def test_security_flags_take_only_json_booleans(tmp_path):
    a = LiveAgent(tmp_path / "home")
    try:
        for body in ({"insecure": "true"}, {"insecure": 1}, {"snapshot_after": "yes"}, {"port": "8080"}):
            r = a.http.post("/v1/engines/tiny/up", json=body)
            assert r.status_code == 422, (body, r.status_code, r.text)
        assert a.agent.jobs.list() == []  # nothing was started
        r = a.http.post("/v1/snapshots", json={"profile": "tiny", "push": "false"})
        assert r.status_code == 422
    finally:
        a.stop()


def test_last_event_id_is_validated(tmp_path):
    a = LiveAgent(tmp_path / "home")
    try:
        job = a.agent.jobs.submit("down", "tiny", ["engine:tiny"], lambda rep, j: {})
        a.agent.jobs.wait(job.id, 10)
        for bad in ("9" * 5000, "²".encode(), "-1", "1e3"):
            r = a.http.get(f"/v1/jobs/{job.id}/events", headers={"Last-Event-ID": bad})
            assert r.status_code == 400 and r.json()["error"] == "bad_request", (bad[:10], r.status_code)
        r = a.http.get(f"/v1/jobs/{job.id}/events", headers={"Last-Event-ID": "1"})
        assert r.status_code == 200 and "event: end" in r.text
    finally:
        a.stop()


def test_home_files_are_private_and_docs_are_not_served(tmp_path):
    home = tmp_path / "home"
    a = LiveAgent(home)
    try:
        job = a.agent.jobs.submit("down", "tiny", ["engine:tiny"], lambda rep, j: {})
        a.agent.jobs.wait(job.id, 10)
        save_state(home / "run", _state("tiny", home / "run" / "tiny"))
        for d in (home / "agent", home / "agent" / "jobs", home / "run", home / "run" / "tiny"):
            assert oct(d.stat().st_mode & 0o777) == "0o700", d
        for f in (home / "agent" / "jobs" / f"{job.id}.json", home / "run" / "tiny" / "state.json"):
            assert oct(f.stat().st_mode & 0o777) == "0o600", f
        for path in ("/docs", "/redoc"):
            assert httpx.get(a.url + path).status_code == 401  # not open
            assert a.http.get(path).status_code == 404  # not served at all
        assert httpx.get(a.url + "/openapi.json").status_code == 200
    finally:
        a.stop()


def _exchange(port: int, data: bytes, timeout: float = 10) -> bytes:
    """Send ``data`` and read until the agent closes (at most ``timeout`` s). (No half-close:
    uvicorn closes a half-closed connection before its app answers.)"""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(data)
        return read_to_close(s)


@pytest.mark.parametrize("upgrade", [b"Upgrade: x\r\n", b"Connection: Upgrade\r\nUpgrade: h2c\r\n",
                                     b"Connection: Upgrade\r\nUpgrade: websocket\r\nSec-WebSocket-Version: 13\r\n"
                                     b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"])
def test_the_gates_probes_on_the_agent_upgrade_opens_nothing(agent_proc, upgrade):
    """The gate's Upgrade tunnel probe, tried on the agent: a request with ``Upgrade`` after an open
    probe, then one to a /v1 route without the token; the /v1 route never answers 200 or
    switches protocols."""
    raw = _exchange(agent_proc.port, b"GET /healthz HTTP/1.1\r\nHost: x\r\n" + upgrade + b"\r\n"
                    b"GET /v1/engines HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    statuses = [line.split()[1] for line in raw.split(b"\r\n") if line.startswith(b"HTTP/1.1 ")]
    assert b"101" not in statuses and b'"engines"' not in raw, raw
    assert statuses.count(b"200") <= 1  # /healthz at most; /v1/engines never
    # the same straight to a /v1 route
    raw = _exchange(agent_proc.port, b"GET /v1/engines HTTP/1.1\r\nHost: x\r\nConnection: close\r\n" + upgrade
                    + b"\r\n")
    assert raw.startswith(b"HTTP/1.1 401") or raw.startswith(b"HTTP/1.1 400"), raw


@pytest.mark.parametrize("suffix", ["%0A", "%0D%0A", "%00", "%09"])
def test_the_gates_probes_on_the_agent_a_control_suffix_is_no_name(agent_proc, suffix):
    """``%0A`` after an open path needs the token like any other path; after an engine name
    (with the token) it is not that engine: Python's ``$`` matches before a final newline, the
    name rule must not."""
    raw = _exchange(agent_proc.port, f"GET /healthz{suffix} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
    assert raw.startswith(b"HTTP/1.1 401"), raw
    auth = f"Authorization: Bearer {TOKEN}\r\n".encode()
    raw = _exchange(agent_proc.port, f"GET /v1/engines/tiny{suffix} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n".encode()
                    + auth + b"\r\n")
    assert raw.startswith((b"HTTP/1.1 400", b"HTTP/1.1 422")), raw
    raw = _exchange(agent_proc.port, f"POST /v1/engines/tiny{suffix}/down HTTP/1.1\r\nHost: x\r\nConnection: close\r\n".encode() + auth
                    + b"Content-Length: 0\r\n\r\n")
    assert raw.startswith((b"HTTP/1.1 400", b"HTTP/1.1 422")), raw
    from warmctl.base.names import check_name

    with pytest.raises(ValueError):
        check_name("engine name", "tiny\n")


@pytest.mark.parametrize("target,status", [(b"http://127.0.0.1/v1/engines", b"401"), (b"http://[::1/v1/engines", b"400"),
                                           (b"http://x/healthz", b"200")])
def test_the_gates_probes_on_the_agent_absolute_form(agent_proc, target, status):
    raw = _exchange(agent_proc.port, b"GET " + target + b" HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert raw.startswith(b"HTTP/1.1 " + status), raw
    assert b"Traceback" not in agent_proc.log.read_bytes()
