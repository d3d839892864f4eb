"""The supervisor's readiness endpoint (warmctl.kube.readiness, ``up --foreground --ready-port``)
on its own, over real sockets: a probe held until the port opens, the check's answer after, a
stop releasing held probes, bad requests; and the CLI's refusals before anything starts. The
walk with a real restore (held while the canary is, 200 as the port opens, 503 while draining)
is in tests/test_kube_pod.py."""

from __future__ import annotations

import socket
import threading
import time

import httpx
import pytest

from tests.conftest import warmctl
from tests.ports import free_port
from warmctl.kube.readiness import ReadinessServer


def _get(port: int, path: str, method: str = "GET") -> tuple[int, str]:
    r = httpx.request(method, f"http://127.0.0.1:{port}{path}", timeout=30)
    return r.status_code, r.text.strip()


@pytest.fixture
def server():
    state = {"ok": True, "why": ""}
    srv = ReadinessServer("127.0.0.1", 0, lambda: (state["ok"], state["why"]))
    yield srv, state
    srv.close()


def test_a_probe_is_held_until_the_port_opens_then_gets_the_checks_answer(server):
    srv, state = server
    t0 = time.monotonic()
    assert _get(srv.port, "/ready") == (503, "not ready: up has not opened the public port yet")
    assert _get(srv.port, "/ready?wait=0.5")[0] == 503
    assert 0.4 < time.monotonic() - t0 < 5  # the second waited its half second
    held: dict = {}
    probes = [threading.Thread(target=lambda i=i: held.update({i: (_get(srv.port, "/ready?wait=30"), time.monotonic())}))
              for i in range(3)]
    for t in probes:
        t.start()
    time.sleep(0.5)
    assert not held  # every probe is held (one thread each)
    t_open = time.monotonic()
    srv.opened()
    for t in probes:
        t.join(30)
    assert [held[i][0] for i in range(3)] == [(200, "serving")] * 3
    assert all(held[i][1] - t_open < 0.5 for i in range(3)), (held, t_open)
    # once open, each probe is the check's answer at once, whatever ?wait says
    state.update(ok=False, why="the gate's /health on 127.0.0.1:8000 did not answer 200")
    t0 = time.monotonic()
    assert _get(srv.port, "/ready?wait=30") == (503, "not ready: the gate's /health on 127.0.0.1:8000 did not answer 200")
    assert time.monotonic() - t0 < 5
    state["ok"] = True
    assert _get(srv.port, "/ready")[0] == 200


def test_a_failing_check_is_a_503_and_the_endpoint_lives_on(server):
    srv, _ = server
    srv.check = lambda: 1 / 0  # type: ignore[assignment,return-value]
    srv.opened()
    assert _get(srv.port, "/ready") == (503, "not ready: ZeroDivisionError: division by zero")
    srv.check = lambda: (True, "")
    assert _get(srv.port, "/ready")[0] == 200


def test_close_answers_held_probes_and_frees_the_port():
    srv = ReadinessServer("127.0.0.1", 0, lambda: (True, ""))
    held: dict = {}
    t = threading.Thread(target=lambda: held.update(answer=_get(srv.port, "/ready?wait=30")))
    t.start()
    time.sleep(0.3)
    t0 = time.monotonic()
    srv.close()
    t.join(30)
    assert held["answer"] == (503, "not ready: the supervisor is stopping")
    assert time.monotonic() - t0 < 5
    with socket.socket() as s:  # nothing listens there any more
        assert s.connect_ex(("127.0.0.1", srv.port)) != 0


def test_an_ipv6_address():
    srv = ReadinessServer("::1", 0, lambda: (True, ""))
    try:
        srv.opened()
        assert httpx.get(f"http://[::1]:{srv.port}/ready", timeout=10).status_code == 200
    finally:
        srv.close()


def test_bad_requests(server):
    srv, _ = server
    srv.opened()
    assert _get(srv.port, "/health")[0] == 404
    for bad in ("soon", "nan", "inf"):
        assert _get(srv.port, f"/ready?wait={bad}") == (400, "wait: a number of seconds"), bad
    assert _get(srv.port, "/ready", "POST")[0] == 405
    assert _get(srv.port, "/ready?wait=-5")[0] == 200  # a negative wait is no wait


def test_the_cli_refuses_a_ready_port_without_foreground_and_a_taken_one_before_anything_starts(fk_env, tmp_path):
    r = warmctl("up", "fake", "--ready-port", str(free_port()), env=fk_env, check=False)
    assert r.returncode == 2 and "--foreground" in r.stderr, r
    term = tmp_path / "termination-log"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        taken = s.getsockname()[1]
        r = warmctl("up", "fake", "--foreground", "--ready-port", str(taken),
                    env={**fk_env, "WARMCTL_TERMINATION_MESSAGE_PATH": str(term)}, check=False)
    assert r.returncode == 10, r  # HostError
    assert f"the readiness port (--ready-port) 127.0.0.1:{taken} is already in use" in r.stderr, r.stderr
    assert term.read_text().startswith("HostError (exit 10): the readiness port"), term.read_text()
    assert "Resolving" not in r.stderr and "restore" not in r.stderr.lower(), r.stderr  # up never began
    assert warmctl("status", "--json", env=fk_env).stdout.strip() == "[]"
