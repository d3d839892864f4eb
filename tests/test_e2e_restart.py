"""An engine that dies comes back in seconds: a snapshot's engine killed with SIGKILL
(the root of its process tree)

- under ``warmctl up NAME --foreground`` (what systemd/warmctl-up@.service runs): READY=1
  reaches ``$NOTIFY_SOCKET`` only after the canary passed and the public port opened, WATCHDOG=1
  follows while healthy; the kill makes it tear down and exit 7; started again (as
  ``Restart=on-failure`` does) it restores the engine; SIGTERM takes the engine down, exit 0;
- under the agent with ``restart: on-failure``: it restores the engine by itself; ``down``
  is never undone.

What is tested is warmctl's supervision, so the engine is the two-process stand-in
``tests/fake_vllm.py`` (``fake_snapshot``: restored by the real CRIU in well under a second);
how fast the real engine comes back is measured by ``benchmarks/`` and the ``tiny`` restores of
the other e2e tests. The seconds from the kill until the public port answers again after a
passing canary are printed (``restart-seconds ...``, run with ``-s``), not asserted.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest

from tests.conftest import listening, warmctl
from tests.test_agent_e2e import Agent

pytestmark = pytest.mark.e2e


class NotifySocket:
    """A unix datagram socket standing in for systemd's ``$NOTIFY_SOCKET``; ``messages``
    holds (monotonic time, datagram text) in arrival order."""

    def __init__(self, path: Path):
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.settimeout(0.2)
        self.messages: list[tuple[float, str]] = []

    def wait_for(self, key: str, timeout: float, proc: subprocess.Popen | None = None) -> float:
        """Read until a datagram containing line ``key`` arrives; its arrival time."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                data = self.sock.recv(4096).decode()
            except TimeoutError:
                if proc is not None and proc.poll() is not None:
                    raise AssertionError(f"exited {proc.returncode} before {key}: {self.messages}") from None
                continue
            self.messages.append((time.monotonic(), data))
            if key in data.splitlines():
                return self.messages[-1][0]
        raise AssertionError(f"no {key} within {timeout} s: {self.messages}")

    def drain(self) -> str:
        """Read what is queued; every datagram received so far, joined by newlines."""
        self.sock.setblocking(False)
        try:
            while True:
                self.messages.append((time.monotonic(), self.sock.recv(4096).decode()))
        except BlockingIOError:
            pass
        finally:
            self.sock.settimeout(0.2)
        return "\n".join(m for _, m in self.messages)

    def close(self) -> None:
        self.sock.close()
        self.path.unlink(missing_ok=True)


def _completion(port: int) -> str:
    r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=60,
                   json={"model": "fake", "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def _status(env) -> list[dict]:
    return json.loads(warmctl("status", "--json", env=env).stdout)


def _foreground(env, sock: NotifySocket, log: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "warmctl", "up", "fake", "--foreground"],
                            env={**env, "NOTIFY_SOCKET": str(sock.path), "WATCHDOG_USEC": "4000000"},
                            stdout=open(log, "a"), stderr=subprocess.STDOUT)


def test_foreground_notifies_and_exits_when_the_engine_dies(fk_env, fake_snapshot, fake_ports, fake_clean, tmp_path):
    wc_env, gate = fk_env, fake_ports[1]
    sock = NotifySocket(tmp_path / "notify")
    log = tmp_path / "fg.log"
    procs = []
    try:
        p = _foreground(wc_env, sock, log)
        procs.append(p)
        sock.wait_for("READY=1", 300, p)
        texts = [m for _, m in sock.messages]
        # EXTEND_TIMEOUT_USEC with a STATUS per phase, the canary among them, all before READY
        assert any(m.startswith("EXTEND_TIMEOUT_USEC=") and "STATUS=canary:" in m for m in texts), texts
        ready = next(m for m in texts if "READY=1" in m.splitlines())
        assert f"127.0.0.1:{gate}" in ready or str(gate) in ready
        expected = _completion(gate)  # the port answers as soon as READY came
        sock.wait_for("WATCHDOG=1", 30, p)
        st = _status(wc_env)[0]
        assert st["phase"] == "serving" and st["healthy"]

        t_kill = time.monotonic()
        os.kill(st["root_pid"], signal.SIGKILL)
        assert p.wait(60) == 7, log.read_text()
        t_exit = time.monotonic()
        assert _status(wc_env) == []  # torn down: no record left
        text = log.read_text()
        assert "engine fake died: its process tree died" in text, text

        # what Restart=on-failure does: start the unit's command again
        p2 = _foreground(wc_env, sock, log)
        procs.append(p2)
        t_ready = sock.wait_for("READY=1", 300, p2)
        assert _completion(gate) == expected
        t_port = time.monotonic()
        print(f"\nrestart-seconds foreground: kill->exit {t_exit - t_kill:.2f} s, kill->READY (canary passed, "
              f"port open) {t_ready - t_kill:.2f} s, kill->first completion {t_port - t_kill:.2f} s "
              f"(relaunch of the command itself included, no RestartSec)")
        assert _status(wc_env)[0]["root_pid"] != st["root_pid"]

        p2.send_signal(signal.SIGTERM)
        assert p2.wait(120) == 0, log.read_text()
        assert "STOPPING=1" in sock.drain().splitlines()
        assert _status(wc_env) == []
    finally:
        for q in procs:
            if q.poll() is None:
                q.kill()
                q.wait()
        sock.close()


def test_agent_restarts_an_engine_that_dies(fk_env, fake_snapshot, fake_ports, fake_clean):
    wc_env, gate = fk_env, fake_ports[1]
    agent = Agent(wc_env)
    try:
        h = agent.http
        j = agent.wait_job(h.post("/v1/engines/fake/up", json={"restart": "on-failure", "restart_limit": 3}).json()["id"])
        assert j["state"] == "succeeded", j
        v = h.get("/v1/engines/fake").json()
        assert v["phase"] == "serving" and v["restart"]["policy"] == "on-failure" and v["restart"]["restarts"] == 0
        expected = _completion(gate)
        root = v["state"]["root_pid"]

        before = {x["id"] for x in h.get("/v1/jobs", params={"limit": 500}).json()}
        t_kill = time.monotonic()
        os.kill(root, signal.SIGKILL)
        deadline = time.monotonic() + 300
        while True:
            v = h.get("/v1/engines/fake").json()
            if v["phase"] == "serving" and v["job"] is None and v["state"]["root_pid"] != root and v["healthy"]:
                break
            assert time.monotonic() < deadline, v
            time.sleep(0.05)
        t_serving = time.monotonic()
        assert _completion(gate) == expected
        t_port = time.monotonic()
        assert v["restart"]["restarts"] == 1
        new = [x for x in h.get("/v1/jobs", params={"limit": 500}).json() if x["id"] not in before]
        assert [(x["kind"], x["state"]) for x in new] == [("up", "succeeded")], new
        print(f"\nrestart-seconds agent: kill->serving again (canary passed, gate open) {t_serving - t_kill:.2f} s, "
              f"kill->first completion {t_port - t_kill:.2f} s")
        assert psutil.pid_exists(v["state"]["root_pid"])

        # a down is never undone by the supervisor
        jd = agent.wait_job(h.post("/v1/engines/fake/down").json()["id"], 120)
        assert jd["state"] == "succeeded"
        time.sleep(3)
        v = h.get("/v1/engines/fake").json()
        assert v["phase"] == "down" and v["restart"] is None, v
    finally:
        agent.stop()


def test_a_stop_as_the_port_opens_drains_the_serving_engine(fk_env, fake_snapshot, fake_ports, fake_clean, tmp_path):
    """SIGTERM in the moment the public port is open but ``up`` has not yet returned (a pod
    deleted as soon as it is Ready; ``WARMCTL_TEST_KILL_AT_PHASE=serving:TERM`` sends it there) is
    held, then taken as a stop of the serving engine: drained and taken down, exit 0. It was
    once taken as a stop in the middle of ``up`` (exit 143)."""
    sock = NotifySocket(tmp_path / "notify")
    log = tmp_path / "fg.log"
    p = _foreground({**fk_env, "WARMCTL_TEST_KILL_AT_PHASE": "serving:TERM"}, sock, log)
    try:
        assert p.wait(120) == 0, log.read_text()
        text = log.read_text()
        assert "signal 15: taking fake down" in text and "fake is down" in text, text
        assert "while bringing fake up" not in text, text
        assert "READY=1" in sock.drain().splitlines()  # it served before it stopped
        assert _status(fk_env) == [] and not listening(fake_ports[1])
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        sock.close()
