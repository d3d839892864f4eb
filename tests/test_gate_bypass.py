"""Request smuggling and bypass probes, each a regression test against the real gate process: raw sockets on one
side, an upstream on the other that records, with a strict parser of its own (h11), every
request that reaches it. A bypass is any request the upstream sees that the gate should not
have let through."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.gate_upstream import KEY, RecordingUpstream, read_response
from tests.ports import free_port
from warmctl import gate

AUTH = f"Authorization: Bearer {KEY}\r\n".encode()


@pytest.fixture(scope="module")
def upstream():
    up = RecordingUpstream()
    yield up
    up.close()


@pytest.fixture(scope="module")
def engine_pid():
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    yield p.pid
    p.kill()
    p.wait()


@pytest.fixture(scope="module")
def gated(upstream, engine_pid, tmp_path_factory):
    """(port, log): a gate with a key, short limits, in front of ``upstream``."""
    d = tmp_path_factory.mktemp("gate")
    keys = d / "keys"
    keys.write_text(KEY + "\n")
    keys.chmod(0o600)
    port = free_port()
    log = d / "gate.log"
    pid = gate.start("127.0.0.1", port, upstream.port, engine_pid, log, config=gate.GateConfig(
        api_key_file=keys, limits={"head_timeout_s": 2, "body_timeout_s": 2, "body_min_rate": 100,
                                   "keep_alive_s": 2}).check())
    yield port, log
    subprocess.run(["kill", str(pid)], check=False)


def _send(port: int, data: bytes, shut: bool = False, timeout: float = 15) -> bytes:
    """Send ``data``, optionally half-close, and read until the gate closes (at most ``timeout`` s)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(data)
        if shut:
            s.shutdown(socket.SHUT_WR)
        out = b""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                got = s.recv(65536)
            except (ConnectionResetError, socket.timeout):
                break
            if not got:
                break
            out += got
        return out


def _statuses(raw: bytes) -> list[int]:
    """The status of each response in ``raw`` (their bodies here hold no status line)."""
    return [int(m) for m in re.findall(rb"HTTP/1\.[01] (\d{3})", raw)]


def test_upgrade_header_opens_no_tunnel(gated, upstream):
    port, _ = gated
    for upgrade in (b"Upgrade: x\r\n", b"upgrade: a\r\n", b"Upgrade:\r\n", b"Connection: Upgrade\r\nUpgrade: h2c\r\n",
                    b"Connection: upgrade\r\nUpgrade: websocket\r\nSec-WebSocket-Version: 13\r\n"):
        for first in (b"GET /health HTTP/1.1\r\nHost: x\r\n", b"GET /v1/models HTTP/1.1\r\nHost: x\r\n" + AUTH):
            upstream.clear()
            raw = _send(port, first + upgrade + b"\r\n"
                        b"POST /is_scaling_elastic_ep HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n"
                        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}")
            assert _statuses(raw) == [400], (upgrade, raw)
            assert b"upgrade" in raw.lower()
            assert upstream.seen() == [], upgrade  # nothing reached the engine, not even the first request


def test_upgrade_after_an_authorized_request_is_refused_in_order(gated, upstream):
    port, _ = gated
    upstream.clear()
    raw = _send(port, b"GET /v1/models HTTP/1.1\r\nHost: x\r\n" + AUTH + b"\r\n"
                b"GET /health HTTP/1.1\r\nHost: x\r\nUpgrade: x\r\n\r\n"
                b"POST /collective_rpc HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n")
    assert _statuses(raw) == [200, 400]
    assert [(r.method, r.path) for r in upstream.seen()] == [("GET", "/v1/models")]


def test_connect_and_http2_prefaces_are_refused(gated, upstream):
    port, _ = gated
    upstream.clear()
    assert _statuses(_send(port, b"CONNECT 127.0.0.1:22 HTTP/1.1\r\nHost: x\r\n" + AUTH + b"\r\n")) == [405]
    assert _statuses(_send(port, b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")) == [505]
    assert _statuses(_send(port, b"GET /v1/models HTTP/2.0\r\nHost: x\r\n" + AUTH + b"\r\n")) == [505]
    assert upstream.seen() == []


@pytest.mark.parametrize("route", ["/is_scaling_elastic_ep", "/sleep", "/collective_rpc", "/wake_up", "/v1/models",
                                   "/health"])
@pytest.mark.parametrize("suffix", ["%0A", "%0a", "%0D", "%0D%0A", "%00", "%09", "%7F", "%7f%0a"])
def test_a_control_character_suffix_never_reaches_the_engine(gated, upstream, route, suffix):
    port, _ = gated
    upstream.clear()
    raw = _send(port, f"POST {route}{suffix} HTTP/1.1\r\nHost: x\r\n".encode() + AUTH + b"Content-Length: 0\r\n\r\n")
    assert _statuses(raw) == [400] and b"control character" in raw
    assert upstream.seen() == []


@pytest.mark.parametrize("path", ["/inference/v1/abort_requests", "/inference/v1/generate", "/INFERENCE/v1/generate"])
def test_disaggregated_inference_routes_are_closed(gated, upstream, path):
    port, _ = gated
    upstream.clear()
    raw = _send(port, f"POST {path} HTTP/1.1\r\nHost: x\r\n".encode() + AUTH + b"Content-Length: 2\r\n\r\n{}")
    assert _statuses(raw) == [403]
    assert upstream.seen() == []


@pytest.mark.parametrize("path", ["/v2/anything_new", "/server_load", "/ping", "/metrics", "/invocations",
                                  "/v1/chat/completions/render", "/v1/models/", "/V1/MODELS", "/docs", "/openapi.json"])
def test_routes_outside_the_allow_list_are_404_without_the_engine(gated, upstream, path):
    port, _ = gated
    upstream.clear()
    raw = _send(port, f"GET {path} HTTP/1.1\r\nHost: x\r\n".encode() + AUTH + b"\r\n")
    assert _statuses(raw) == [404] and b"route_not_served" in raw
    assert upstream.seen() == []


@pytest.mark.parametrize("target", [b"http://[::1/v1/models", b"http://[::1]:x/v1/models", b"http://a b/",
                                    b"http://%zz/v1/models"])
def test_malformed_absolute_form_is_400_not_a_traceback(gated, upstream, target):
    port, log = gated
    upstream.clear()
    raw = _send(port, b"GET " + target + b" HTTP/1.1\r\nHost: x\r\n" + AUTH + b"\r\n")
    assert _statuses(raw) == [400]
    assert upstream.seen() == []
    assert "Traceback" not in log.read_text()


def test_absolute_form_is_forwarded_in_origin_form(gated, upstream):
    port, _ = gated
    upstream.clear()
    raw = _send(port, f"GET http://127.0.0.1:{port}/v1/models?x=1 HTTP/1.1\r\nHost: x\r\nConnection: close\r\n".encode()
                + AUTH + b"\r\n")
    assert _statuses(raw) == [200]
    assert [(r.method, r.target) for r in upstream.seen()] == [("GET", "/v1/models?x=1")]


def test_writes_to_a_closed_engine_connection_are_no_traceback(gated, upstream):
    """50 clients whose request bodies are still coming when the engine closes on them."""
    port, log = gated
    socks = []
    for _ in range(50):
        s = socket.create_connection(("127.0.0.1", port), timeout=10)
        s.sendall(b"POST /v1/completions?close_after_head=1 HTTP/1.1\r\nHost: x\r\n" + AUTH
                  + b"Content-Length: 100000\r\n\r\n" + b"x" * 1000)
        socks.append(s)
    time.sleep(0.5)
    for s in socks:
        try:
            s.sendall(b"x" * 50000)
            s.sendall(b"x" * 49000)
        except OSError:
            pass
    for s in socks:
        s.close()
    time.sleep(0.5)
    text = log.read_text()
    assert "Traceback" not in text and "RuntimeError" not in text


def test_a_trickled_body_is_cut_by_the_minimum_rate(gated, upstream):
    port, _ = gated
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n" + AUTH + b"Content-Length: 1000\r\n\r\n")
        t0 = time.monotonic()
        raw = b""
        try:
            while time.monotonic() - t0 < 20:
                s.sendall(b"{")
                time.sleep(0.5)
                s.settimeout(0.01)
                try:
                    got = s.recv(65536)
                except socket.timeout:
                    continue
                if not got:
                    break
                raw += got
        except (BrokenPipeError, ConnectionResetError):
            pass
        took = time.monotonic() - t0
    assert 2 <= took < 6, took  # body_timeout_s 2 + 1000 B at 100 B/s would be 12 s; a byte every 0.5 s is far slower
    assert b" 408 " in raw.split(b"\r\n")[0] and b"request_timeout" in raw


def test_a_slow_head_is_cut(gated):
    port, _ = gated
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        t0 = time.monotonic()
        s.sendall(b"GET /v1/models HTTP/1.1\r\nHo")
        s.settimeout(10)
        raw = s.recv(65536)
        assert 1.5 < time.monotonic() - t0 < 6
    assert b" 408 " in raw.split(b"\r\n")[0]


@pytest.mark.parametrize("delay", [0, 1.5])
def test_an_idle_keep_alive_connection_is_closed(gated, delay):
    """The idle time counts from the end of the last response, not from the end of the request:
    an engine that takes 1.5 s to answer leaves the client the same 2 s of idle keep-alive."""
    port, _ = gated
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(f"GET /health?delay={delay} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
        f = s.makefile("rb")
        assert read_response(f)[0] == 200
        t0 = time.monotonic()
        assert f.read() == b""  # EOF after keep_alive_s (2 s here)
        assert 1.7 < time.monotonic() - t0 < 6


@pytest.mark.parametrize("close_from", ["client", "client-http10", "engine"])
def test_connection_close_is_honoured_both_ways(gated, upstream, close_from):
    port, _ = gated
    upstream.clear()
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        if close_from == "client":
            s.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\n" + AUTH + b"\r\n")
        elif close_from == "client-http10":
            s.sendall(b"GET /v1/models HTTP/1.0\r\nHost: x\r\n" + AUTH + b"\r\n")
        else:
            s.sendall(b"GET /v1/models?respond_close=1 HTTP/1.1\r\nHost: x\r\n" + AUTH + b"\r\n")
        f = s.makefile("rb")
        t0 = time.monotonic()
        status, headers, _ = read_response(f)
        assert status == 200
        assert f.read() == b""  # EOF right after the response
        assert time.monotonic() - t0 < 3
    seen = upstream.seen()
    assert len(seen) == 1
    if close_from != "engine":
        assert seen[0].headers.get("connection") == "close"  # the engine was told too


@pytest.mark.parametrize("shut", [False, True])
@pytest.mark.parametrize("status", [400, 405, 422])
def test_engine_errors_always_reach_the_client(gated, upstream, shut, status):
    """The engine's own 4xx (here after the whole request, and with the client half-closing
    right after sending it: the gate must not pass the half-close on and lose the answer)."""
    port, _ = gated
    for _ in range(5):
        raw = _send(port, f"POST /v1/completions?status={status}&like_uvicorn=1 HTTP/1.1\r\nHost: x\r\n".encode() + AUTH
                    + b"Content-Length: 2\r\nConnection: close\r\n\r\n{}", shut=shut)
        assert _statuses(raw) == [status], raw


def test_the_gate_logs_which_engine_routes_stay_closed(gated):
    _, log = gated
    deadline = time.monotonic() + 10
    while "routes; " not in log.read_text() and time.monotonic() < deadline:
        time.sleep(0.1)
    line = next(x for x in log.read_text().splitlines() if "the engine serves" in x)
    assert "stay closed" in line
    closed = line.split(": ", 2)[-1].split()
    assert "/collective_rpc" in closed and "/sleep" in closed and "/inference/v1/generate" in closed
    assert "/v1/models" not in closed and "/v1/completions" not in closed
    assert json.dumps(line)  # one line


def _wait_read(port: int, peer_port: int, timeout: float = 10) -> None:
    """Wait until the process listening on ``port`` has read every byte its connection from
    ``peer_port`` received: that socket's receive queue in ``/proc/net/tcp`` is empty."""
    local, remote = f"0100007F:{port:04X}", f"0100007F:{peer_port:04X}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
            f = line.split()
            if f[1] == local and f[2] == remote and int(f[4].split(":")[1], 16) == 0:
                return
        time.sleep(0.01)
    raise AssertionError(f"the gate on port {port} did not read its client's bytes in {timeout} s")


@pytest.mark.parametrize("phase", ["head", "body", "keep-alive"])
def test_bytes_that_came_in_time_count_when_the_gate_runs_late(upstream, engine_pid, tmp_path, phase):
    """A host that leaves the gate without CPU past a limit (SIGSTOP here, for longer than the
    limit) does not make the client late: bytes that reached the gate's socket within the limit
    are read and the request is answered, not cut with 408 or closed as idle."""
    keys = tmp_path / "keys"
    keys.write_text(KEY + "\n")
    keys.chmod(0o600)
    port = free_port()
    pid = gate.start("127.0.0.1", port, upstream.port, engine_pid, tmp_path / "gate.log", config=gate.GateConfig(
        api_key_file=keys, limits={"head_timeout_s": 1, "body_timeout_s": 1, "body_min_rate": 1,
                                   "keep_alive_s": 1}).check())
    try:
        upstream.clear()
        rest = b"st: x\r\nConnection: close\r\n" + AUTH + b"Content-Length: 2\r\n\r\n{}"
        first, second = {"head": (b"POST /v1/completions HTTP/1.1\r\nHo", rest),
                         "body": (b"POST /v1/completions HTTP/1.1\r\nHo" + rest[:-2], rest[-2:]),
                         "keep-alive": (b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n",
                                        b"POST /v1/completions HTTP/1.1\r\nHo" + rest)}[phase]
        with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
            s.sendall(first)
            _wait_read(port, s.getsockname()[1])
            time.sleep(0.2)  # the gate has read it and parsed it: the limit's clock runs
            os.kill(pid, signal.SIGSTOP)
            try:
                s.sendall(second)  # in time, into the stopped gate's socket
                time.sleep(1.5)  # past the limit
            finally:
                os.kill(pid, signal.SIGCONT)
            raw = b""
            while got := s.recv(65536):
                raw += got
    finally:
        subprocess.run(["kill", str(pid)], check=False)
    assert _statuses(raw) == [200] * (2 if phase == "keep-alive" else 1), raw
    assert [(x.method, x.path, x.body) for x in upstream.seen()][-1] == ("POST", "/v1/completions", b"{}")
