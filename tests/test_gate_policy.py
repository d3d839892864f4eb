"""The gate as a front door, with real sockets: API keys from a file (rotation on change and
SIGHUP), control routes refused, every request of a keep-alive connection checked, TLS with a
CA made here (real ``ssl``), drain on SIGTERM. The upstream is a real uvicorn app that streams
SSE; the gate is the real gate process."""

import datetime
import hashlib
import ipaddress
import json
import os
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time

import httpx
import psutil
import pytest
import uvicorn
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from tests.gate_upstream import read_response as _read_response
from warmctl import gate
from warmctl.engine import loopback
from warmctl.gate.http import MAX_HEAD
from warmctl.gate.relay import ResponseTracker
from warmctl.base.errors import HostError
from tests.ports import free_port

KEY_A, KEY_B, KEY_C = "sk-warmctl-alpha-0001", "sk-warmctl-bravo-0002", "sk-warmctl-charlie-0003"


def _big_body(mib: int) -> bytes:
    return hashlib.sha256(b"warmctl").digest() * (mib * 2**15)


@pytest.fixture(scope="module")
def upstream():
    """(port, calls): a streaming upstream; ``calls`` lists the paths it was asked for."""
    app = FastAPI()
    calls: list[str] = []

    @app.middleware("http")
    async def record(request: Request, call_next):
        if request.url.path != "/openapi.json":  # the gate reads it for its log of closed routes
            calls.append(request.url.path)
        return await call_next(request)

    @app.get("/health")
    def health():
        return {}

    @app.get("/v1/models")
    def models():
        return {"data": [{"id": "tiny"}]}

    @app.post("/echo")
    async def echo(request: Request):
        return {"n": len(await request.body())}

    @app.get("/big")
    def big(mib: int):
        return Response(_big_body(mib), media_type="application/octet-stream")

    @app.post("/sleep")
    def sleep_():
        return {"slept": True}

    @app.post("/collective_rpc")
    def rpc():
        return {"results": []}

    @app.post("/v1/completions")
    def completions(body: dict):
        n, gap = int(body.get("max_tokens", 5)), float(body.get("gap", 0.05))

        def gen():
            for i in range(n):
                yield f"data: {json.dumps({'choices': [{'text': f't{i}'}]})}\n\n"
                time.sleep(gap)
            yield "data: [DONE]\n\n"
        return StreamingResponse(gen(), media_type="text/event-stream")

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                           timeout_keep_alive=1))  # closes idle connections after 1 s
    t = threading.Thread(target=server.run, daemon=True)
    t.start()
    while not server.started:
        time.sleep(0.02)
    yield port, calls
    server.should_exit = True
    t.join(5)


@pytest.fixture
def engine_pid():
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    yield p.pid
    p.kill()
    p.wait()


class Gated:
    def __init__(self, pid: int, port: int, log):
        self.pid, self.port, self.log = pid, port, log

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        _reap(self.pid)


def _reap(pid: int, timeout_s: float = 10) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if os.waitpid(pid, os.WNOHANG)[0] == pid:
                return True
        except ChildProcessError:
            return True
        time.sleep(0.05)
    return False


@pytest.fixture
def start_gate(upstream, engine_pid, tmp_path):
    made = []

    def _start(**kw) -> Gated:
        port = free_port()
        kw.setdefault("allow_paths", ["/echo", "/big"])  # the test upstream's own routes
        pid = gate.start("127.0.0.1", port, upstream[0], engine_pid, tmp_path / "gate.log", config=gate.GateConfig(**kw).check())
        made.append(Gated(pid, port, tmp_path / "gate.log"))
        return made[-1]

    yield _start
    for g in made:
        g.stop()


@pytest.fixture
def key_file(tmp_path):
    f = tmp_path / "keys"
    f.write_text(f"# rotated 2026-11\n{KEY_A}\n\n  {KEY_B}  \n")
    f.chmod(0o600)
    return f


def _auth(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def _raw(port: int, data: bytes, ctx: ssl.SSLContext | None = None) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    if ctx is not None:
        s = ctx.wrap_socket(s, server_hostname="127.0.0.1")
    s.sendall(data)
    return s


def test_keys_from_a_file_each_key_works_others_get_401(start_gate, key_file, upstream):
    g = start_gate(api_key_file=key_file)
    with httpx.Client(base_url=g.url) as c:
        for k in (KEY_A, KEY_B):
            assert c.get("/v1/models", headers=_auth(k)).json() == {"data": [{"id": "tiny"}]}
        for headers in ({}, _auth(KEY_C), _auth(KEY_A + "x"), {"Authorization": KEY_A}, {"Authorization": f"Basic {KEY_A}"}):
            r = c.get("/v1/models", headers=headers)
            assert r.status_code == 401, headers
            assert r.headers["www-authenticate"].startswith("Bearer")
            assert r.json()["error"]["code"] == "invalid_api_key"
        assert c.get("/health").status_code == 200  # public by default
        r = c.post("/v1/completions", json={"max_tokens": 3})
        assert r.status_code == 401


def test_control_routes_are_refused_even_with_a_key(start_gate, key_file, upstream):
    g = start_gate(api_key_file=key_file)
    _, calls = upstream
    before = len(calls)
    for path in ("/sleep", "/collective_rpc", "/wake_up", "/is_sleeping", "/reset_prefix_cache",
                 "/sleep/", "/SLEEP", "/sl%65ep", "//collective_rpc", "/v1/../sleep", "/sleep?level=1",
                 f"http://127.0.0.1:{g.port}/collective_rpc"):
        s = _raw(g.port, f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY_A}\r\n"
                         "Content-Length: 2\r\n\r\n{}".encode())
        status, _, body = _read_response(s.makefile("rb"))
        s.close()
        assert status == 403, path
        assert json.loads(body)["error"]["code"] == "forbidden_route"
    assert not [p for p in calls[before:] if p in ("/sleep", "/collective_rpc")]  # the engine never saw one
    # a gate without keys still refuses them
    g2 = start_gate()
    assert httpx.post(f"{g2.url}/collective_rpc", json={}).status_code == 403
    assert httpx.get(f"{g2.url}/v1/models").status_code == 200


def test_every_request_of_a_keep_alive_connection_is_checked(start_gate, key_file):
    g = start_gate(api_key_file=key_file)
    body = b'{"a": "GET /sleep HTTP/1.1\\r\\n\\r\\n"}'
    s = _raw(g.port, b"POST /echo HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY_A.encode()
             + b"\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    f = s.makefile("rb")
    status, headers, got = _read_response(f)
    assert status == 200 and json.loads(got) == {"n": len(body)}
    # a chunked body on the same connection, then a request with a key: both reach the engine
    s.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY_B.encode()
              + b"\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n3;ext=1\r\nabc\r\n0\r\n\r\n")
    status, _, got = _read_response(f)
    assert status == 200 and json.loads(got) == {"n": 8}
    s.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY_A.encode() + b"\r\n\r\n")
    assert _read_response(f)[0] == 200
    # the next request on the same connection without a key: 401, then the gate closes it
    s.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
    status, headers, got = _read_response(f)
    assert status == 401 and headers["connection"] == "close" and headers["www-authenticate"].startswith("Bearer")
    assert json.loads(got)["error"]["code"] == "invalid_api_key"
    assert f.read() == b""
    s.close()


def _read_chunked_response(f) -> tuple[int, bytes]:
    """One HTTP/1.1 response with a chunked body from ``f``: (status, body)."""
    status = int(f.readline().split()[1])
    headers = {}
    while (line := f.readline()) not in (b"\r\n", b""):
        k, _, v = line.decode().partition(":")
        headers[k.strip().lower()] = v.strip()
    assert headers.get("transfer-encoding") == "chunked", headers
    body = b""
    while size := int(f.readline().split(b";")[0], 16):
        body += f.read(size)
        assert f.read(2) == b"\r\n"
    assert f.readline() == b"\r\n"  # no trailers
    return status, body


@pytest.mark.parametrize("second,status", [
    (b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n", 401),  # no key
    (b"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer nope\r\n\r\n", 401),  # wrong key
    (b"POST /sleep HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY_A.encode()
     + b"\r\nContent-Length: 0\r\n\r\n", 403),  # control route
    (b"GET /v1/models HTTP/1.1\nHost: x\r\n\r\n", 400),  # malformed head
    (b"POST /echo HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY_A.encode()
     + b"\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", 400),  # malformed body: its head reached the engine
])
def test_a_refused_request_pipelined_behind_one_in_flight_is_answered_after_it(start_gate, key_file, upstream,
                                                                                second, status):
    g = start_gate(api_key_file=key_file)
    _, calls = upstream
    before = len(calls)
    body = json.dumps({"max_tokens": 5, "gap": 0.1}).encode()
    first = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY_A.encode()
             + b"\r\nContent-Type: application/json\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    s = _raw(g.port, first + second)  # both in one write: the second is read while the first streams
    f = s.makefile("rb")
    got, streamed = _read_chunked_response(f)  # the in-flight response first, whole
    assert got == 200
    assert [json.loads(x[6:])["choices"][0]["text"] for x in streamed.decode().split("\n\n") if x.startswith("data: {")] \
        == [f"t{i}" for i in range(5)]
    assert streamed.endswith(b"data: [DONE]\n\n")
    got, headers, err = _read_response(f)  # then the refusal
    assert got == status and headers["connection"] == "close"
    assert json.loads(err)["error"]["message"]
    assert f.read() == b""  # then the gate closes the connection
    s.close()
    if b"chunked" not in second:
        assert calls[before:] == ["/v1/completions"]  # the refused request never reached the engine


def test_engine_closing_an_idle_connection_does_not_close_the_clients(start_gate, key_file):
    g = start_gate(api_key_file=key_file)
    s = _raw(g.port, b"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY_A.encode() + b"\r\n\r\n")
    f = s.makefile("rb")
    assert _read_response(f)[0] == 200
    time.sleep(2.5)  # the upstream's keep-alive timeout (1 s) closed its side meanwhile
    s.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY_A.encode() + b"\r\n\r\n")
    assert _read_response(f)[0] == 200  # over a new engine connection, same client connection
    s.close()


@pytest.mark.parametrize("head,status", [
    (b"POST /echo HTTP/1.1\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n", 400),
    (b"GET /v1/models HTTP/1.1\nHost: x\r\n\r\n", 400),
    (b"GET /v1/models HTTP/1.1\r\n Authorization: Bearer x\r\n\r\n", 400),
    (b"POST /echo HTTP/1.1\r\nTransfer-Encoding: gzip, chunked\r\n\r\n", 501),
    (b"CONNECT 127.0.0.1:22 HTTP/1.1\r\n\r\n", 405),
    (b"GET /v1/models HTTP/1.1\r\nX: " + b"a" * (MAX_HEAD + 10) + b"\r\n\r\n", 431),
])
def test_malformed_or_ambiguous_heads_get_an_error_not_the_engine(start_gate, key_file, head, status):
    g = start_gate(api_key_file=key_file)
    s = _raw(g.port, head)
    assert _read_response(s.makefile("rb"))[0] == status
    s.close()


def _make_ca_and_cert(d, cn="gate-1"):
    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "warmctl test CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
          .not_valid_after(now + datetime.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .sign(ca_key, hashes.SHA256()))
    (d / "ca.pem").write_bytes(ca.public_bytes(serialization.Encoding.PEM))

    def leaf(name: str, key_mode: int = 0o600):
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
                .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
                .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
                .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
                .sign(ca_key, hashes.SHA256()))
        (d / "tls.key.new").write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                          serialization.NoEncryption()))
        (d / "tls.key.new").chmod(key_mode)
        (d / "tls.crt.new").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        os.replace(d / "tls.key.new", d / "tls.key")
        os.replace(d / "tls.crt.new", d / "tls.crt")
    leaf(cn)
    return d / "ca.pem", d / "tls.crt", d / "tls.key", leaf


def _peer_cn(port: int, ctx: ssl.SSLContext) -> str:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as raw, \
            ctx.wrap_socket(raw, server_hostname="127.0.0.1") as s:
        return dict(x[0] for x in s.getpeercert()["subject"])["commonName"]


def test_tls_streams_token_by_token_and_reloads_its_certificate(start_gate, key_file, tmp_path):
    ca, cert, key, reissue = _make_ca_and_cert(tmp_path)
    g = start_gate(api_key_file=key_file, tls_cert=cert, tls_key=key)
    ctx = ssl.create_default_context(cafile=str(ca))
    with httpx.Client(base_url=f"https://127.0.0.1:{g.port}", verify=ctx, headers=_auth(KEY_A)) as c:
        with c.stream("POST", "/v1/completions", json={"max_tokens": 6, "gap": 0.1}) as r:
            assert r.status_code == 200
            arrivals, texts = [], []
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    arrivals.append(time.monotonic())
                    texts.append(json.loads(line[6:])["choices"][0]["text"])
        assert texts == [f"t{i}" for i in range(6)]
        assert arrivals[-1] - arrivals[0] > 0.3  # each token as it was sent, not all at the end
        assert c.get("/v1/models", headers={"Authorization": "Bearer nope"}).status_code == 401
    s = _raw(g.port, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")  # plain HTTP on the TLS port
    try:
        assert not s.recv(100).startswith(b"HTTP/1.1 200")
    except ConnectionResetError:
        pass
    s.close()
    assert _peer_cn(g.port, ctx) == "gate-1"
    # the supervisor's readiness check of a TLS gate (warmctl.engine.loopback.healthy, tls=True)
    assert loopback.healthy(g.port, tls=True) and not loopback.healthy(g.port)
    reissue("gate-2")  # a renewed certificate: new handshakes get it within ~1 s
    deadline = time.monotonic() + 10
    while _peer_cn(g.port, ctx) != "gate-2" and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _peer_cn(g.port, ctx) == "gate-2"
    reissue("gate-3", key_mode=0o644)  # a private key group/others may read: not loaded, and logged why
    deadline = time.monotonic() + 10
    while f"TLS private key {key}: mode 0644" not in g.log.read_text() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert f"keeping the previous certificate: TLS private key {key}: mode 0644" in g.log.read_text()
    assert f"chmod 600 {key}" in g.log.read_text()
    assert _peer_cn(g.port, ctx) == "gate-2"
    key.chmod(0o600)  # fixed: picked up without a SIGHUP
    deadline = time.monotonic() + 10
    while _peer_cn(g.port, ctx) != "gate-3" and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _peer_cn(g.port, ctx) == "gate-3"


def test_rotating_the_key_file_keeps_open_streams(start_gate, key_file):
    g = start_gate(api_key_file=key_file)
    got: list[str] = []

    def stream():
        with httpx.Client(base_url=g.url, headers=_auth(KEY_A), timeout=30) as c:
            with c.stream("POST", "/v1/completions", json={"max_tokens": 30, "gap": 0.1}) as r:
                got.extend(line for line in r.iter_lines() if line.startswith("data: "))

    errors = []

    def run():
        try:
            stream()
        except Exception as e:  # noqa: BLE001 - reported by the assertion below
            errors.append(e)

    t = threading.Thread(target=run)
    t.start()
    time.sleep(0.3)
    key_file.write_text(f"{KEY_C}\n")  # A and B revoked, C added: no restart
    deadline = time.monotonic() + 10
    while httpx.get(f"{g.url}/v1/models", headers=_auth(KEY_A)).status_code != 401 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert httpx.get(f"{g.url}/v1/models", headers=_auth(KEY_A)).status_code == 401
    assert httpx.get(f"{g.url}/v1/models", headers=_auth(KEY_C)).status_code == 200
    t.join(30)
    assert not errors and len(got) == 31 and got[-1] == "data: [DONE]"  # the stream opened with A finished
    # SIGHUP reloads at once; a file that no longer parses keeps the keys loaded before
    key_file.write_text(f"{KEY_B}\n")
    os.kill(g.pid, signal.SIGHUP)
    time.sleep(0.3)
    assert httpx.get(f"{g.url}/v1/models", headers=_auth(KEY_B)).status_code == 200
    key_file.write_text("")
    os.kill(g.pid, signal.SIGHUP)
    time.sleep(0.3)
    assert httpx.get(f"{g.url}/v1/models", headers=_auth(KEY_B)).status_code == 200
    assert "keeping the previous keys" in g.log.read_text()


def test_sigterm_closes_the_listener_and_lets_a_stream_finish(start_gate, key_file):
    g = start_gate(api_key_file=key_file, drain_s=20)
    got: list[str] = []
    started = threading.Event()

    def stream():
        with httpx.Client(base_url=g.url, headers=_auth(KEY_A), timeout=30) as c:
            with c.stream("POST", "/v1/completions", json={"max_tokens": 20, "gap": 0.1}) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        started.set()
                        got.append(line)

    t = threading.Thread(target=stream)
    t.start()
    assert started.wait(10)
    os.kill(g.pid, signal.SIGTERM)
    deadline = time.monotonic() + 5
    while not gate.port_free("127.0.0.1", g.port) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert gate.port_free("127.0.0.1", g.port)  # no new connections while draining
    t.join(30)
    assert len(got) == 21 and got[-1] == "data: [DONE]"
    assert _reap(g.pid, 10)  # and it exits once the stream is done, well before drain_s


def _parsed(argv: list[str]) -> "gate.GateConfig":
    """``argv`` read back as the gate process reads it (:mod:`warmctl.gate.__main__`'s parser)."""
    import argparse

    ap = argparse.ArgumentParser()
    gate.GateConfig.add_arguments(ap)
    return gate.GateConfig.from_args(ap.parse_args(argv))


def test_a_gate_config_survives_its_command_line(tmp_path):
    """What ``up`` builds is what the gate process parses back: every field, the defaults too."""
    from warmctl.records.config import Settings

    keys, cert, key = tmp_path / "keys", tmp_path / "c.pem", tmp_path / "k.pem"
    full = gate.GateConfig(api_key_file=keys, tls_cert=cert, tls_key=key, allow_paths=["/v1/rerank", "/x/{name}"],
                           public_paths=["/health", "/v1/models"], deny_paths=["/v1/completions"], drain_s=2.5,
                           limits={"head_timeout_s": 1.5, "body_timeout_s": 3, "body_min_rate": 10, "keep_alive_s": 7})
    for c in (full, gate.GateConfig(), gate.GateConfig(public_paths=[]), gate.GateConfig(drain_s=0),
              gate.GateConfig.from_settings(Settings(home=tmp_path / "home"))):
        assert _parsed(c.to_argv()) == c, c
    assert _parsed([]) == gate.GateConfig()
    assert full.enforces == {"gate_api_key": True, "gate_tls": True}
    assert gate.GateConfig().enforces == {"gate_api_key": False, "gate_tls": False}
    assert gate.GateConfig(public_paths=[]).public == () and gate.GateConfig().public == ("/health",)
    with pytest.raises(HostError, match="gate_deny_paths"):
        gate.GateConfig(deny_paths=["no-slash"]).check()


def test_bad_key_or_certificate_files_are_clear_errors(tmp_path):
    with pytest.raises(HostError, match="cannot read"):
        gate.GateConfig(api_key_file=tmp_path / "missing").check()
    (tmp_path / "empty").write_text("# none yet\n")
    (tmp_path / "empty").chmod(0o600)
    with pytest.raises(HostError, match="no key"):
        gate.GateConfig(api_key_file=tmp_path / "empty").check()
    (tmp_path / "spaced").write_text("two words\n")
    (tmp_path / "spaced").chmod(0o600)
    with pytest.raises(HostError, match="line 1"):
        gate.GateConfig(api_key_file=tmp_path / "spaced").check()
    (tmp_path / "c.pem").write_text("not a certificate")
    (tmp_path / "c.pem").chmod(0o600)
    with pytest.raises(HostError, match="c.pem"):
        gate.GateConfig(tls_cert=tmp_path / "c.pem", tls_key=tmp_path / "c.pem").check()
    with pytest.raises(HostError, match="both"):
        gate.GateConfig(tls_cert=tmp_path / "c.pem").check()


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o660, 0o601])
def test_key_files_open_to_group_or_others_are_refused(tmp_path, mode):
    keys = tmp_path / "keys"
    keys.write_text(f"{KEY_A}\n")
    keys.chmod(mode)
    with pytest.raises(HostError, match=rf"API key file {keys}: mode {mode:04o} .*run: chmod 600 {keys}"):
        gate.GateConfig(api_key_file=keys).check()
    _, cert, tls_key, _ = _make_ca_and_cert(tmp_path)
    tls_key.chmod(mode)
    with pytest.raises(HostError, match=rf"TLS private key {tls_key}: mode {mode:04o} .*run: chmod 600 {tls_key}"):
        gate.GateConfig(tls_cert=cert, tls_key=tls_key).check()
    keys.chmod(0o400)
    tls_key.chmod(0o400)
    assert "--api-key-file" in gate.GateConfig(api_key_file=keys, tls_cert=cert, tls_key=tls_key).check().to_argv()
    # the gate process itself refuses too (started by hand, without a checked GateConfig)
    keys.chmod(mode)
    r = subprocess.run([sys.executable, "-m", "warmctl.gate", "--listen", f"127.0.0.1:{free_port()}",
                        "--upstream", "127.0.0.1:9", "--api-key-file", str(keys)], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 1 and f"chmod 600 {keys}" in r.stderr


def test_key_files_of_another_user_are_refused(tmp_path):
    st = os.stat_result((0o100600, 0, 0, 1, 12345, 0, 10, 0, 0, 0))  # (mode, ino, dev, nlink, uid, gid, size, ...)
    assert "uid 12345" in gate.private_file_problem(st)
    assert gate.private_file_problem(os.stat_result((0o100600, 0, 0, 1, 0, 0, 10, 0, 0, 0))) is None  # root's
    assert gate.private_file_problem(os.stat_result((0o100600, 0, 0, 1, os.geteuid(), 0, 10, 0, 0, 0))) is None
    if os.geteuid() == 0:  # a real file owned by someone else (only root can give a file away)
        keys = tmp_path / "keys"
        keys.write_text(f"{KEY_A}\n")
        keys.chmod(0o600)
        os.chown(keys, 65534, 65534)
        with pytest.raises(HostError, match=rf"API key file {keys}: it belongs to uid 65534.*run: chown 0 {keys}"):
            gate.GateConfig(api_key_file=keys).check()


def test_a_reload_that_finds_a_bad_mode_keeps_the_old_keys(start_gate, key_file):
    g = start_gate(api_key_file=key_file)
    key_file.write_text(f"{KEY_C}\n")
    key_file.chmod(0o644)  # rotated, but left open to everyone: not taken
    deadline = time.monotonic() + 10
    while "keeping the previous keys" not in g.log.read_text() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert f"keeping the previous keys: API key file {key_file}: mode 0644" in g.log.read_text()
    assert httpx.get(f"{g.url}/v1/models", headers=_auth(KEY_A)).status_code == 200
    assert httpx.get(f"{g.url}/v1/models", headers=_auth(KEY_C)).status_code == 401
    os.kill(g.pid, signal.SIGHUP)  # a SIGHUP does not take it either
    time.sleep(0.3)
    assert httpx.get(f"{g.url}/v1/models", headers=_auth(KEY_C)).status_code == 401
    key_file.chmod(0o600)  # fixed: the change of mode alone reloads it
    deadline = time.monotonic() + 10
    while httpx.get(f"{g.url}/v1/models", headers=_auth(KEY_C)).status_code != 200 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert httpx.get(f"{g.url}/v1/models", headers=_auth(KEY_C)).status_code == 200
    assert httpx.get(f"{g.url}/v1/models", headers=_auth(KEY_A)).status_code == 401


def test_drain_closes_idle_keep_alive_connections_at_once(start_gate, key_file):
    g = start_gate(api_key_file=key_file, drain_s=20)
    with httpx.Client(base_url=g.url, headers=_auth(KEY_A)) as c:
        assert c.get("/v1/models").status_code == 200  # the connection stays open, idle
        t0 = time.monotonic()
        os.kill(g.pid, signal.SIGTERM)
        assert _reap(g.pid, 10)
        assert time.monotonic() - t0 < 10  # not the 20 s drain: nothing was in flight
    assert "draining 1 connection" in g.log.read_text()


def test_a_slow_client_holds_back_the_engine_not_the_gates_memory(start_gate, key_file):
    """A large response to a client that stops reading: the gate stops reading the engine
    (it does not queue the response in its own memory), then relays every byte once the
    client reads again, and the connection serves the next request."""
    g = start_gate(api_key_file=key_file)
    gate_proc = psutil.Process(g.pid)
    rss0 = gate_proc.memory_info().rss
    s = socket.create_connection(("127.0.0.1", g.port), timeout=30)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
    s.sendall(f"GET /big?mib=64 HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY_A}\r\n\r\n".encode())
    time.sleep(2.0)  # the engine has the whole 64 MiB ready; the client reads nothing
    grown = gate_proc.memory_info().rss - rss0
    f = s.makefile("rb")
    status, headers, body = _read_response(f)
    assert status == 200 and len(body) == 64 * 2**20
    assert hashlib.sha256(body).digest() == hashlib.sha256(_big_body(64)).digest()
    assert grown < 16 * 2**20, f"the gate's memory grew by {grown / 2**20:.1f} MiB while its client did not read"
    s.sendall(f"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY_A}\r\n\r\n".encode())
    assert _read_response(f)[0] == 200
    s.close()


@pytest.mark.parametrize("split", [1, 3, 7, 1000])
def test_response_tracker_finds_where_responses_end(split):
    t = ResponseTracker()
    stream = (b"HTTP/1.1 100 Continue\r\n\r\n"
              b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello"
              b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
              b"6\r\ndata: \r\n3;x=y\r\nabc\r\n0\r\nX-Trailer: 1\r\n\r\n"
              b"HTTP/1.1 204 No Content\r\n\r\n"
              b"HTTP/1.1 200 OK\r\nContent-Length: 9\r\n\r\n")  # to a HEAD request: no body
    t.methods = [b"POST", b"GET", b"DELETE", b"HEAD"]
    for i in range(0, len(stream), split):
        t.feed(stream[i:i + split])
        if i + split < len(stream):
            assert not t.idle
    assert t.idle and t.methods == []
    t.methods = [b"GET"]
    t.feed(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc")
    assert not t.idle
    t.feed(b"defghij")
    assert t.idle
