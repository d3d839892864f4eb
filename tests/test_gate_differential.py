"""The gate, differentially: generated client byte streams on one side, on the other a stand-in
engine that reads what the gate sends with a second, independent strict parser (h11; the gate
reads with llhttp) and records every request head and every whole request.

Property, for every connection: each request the engine side sees was allowed (its path, read as
uvicorn reads it, is in the allow list and holds no control character) and authorized (a public
path, or ``Bearer KEY``); the whole requests it sees are, in order, requests the client sent,
with the same method, path and body; every request that breaks no rule (``Sent.clean``), up to
the first that does, reaches it as sent (a gate refusing everything fails); and h11 never fails
to parse the gate's output.

The streams mix valid requests with probes: header case and whitespace,
percent-encodings (``%0A`` and other control characters, ``%2F``, dot segments, case),
absolute-form targets, Content-Length / chunked framing with extensions and trailers, CL+TE,
odd transfer codings, ``Upgrade`` and ``Connection`` variants, bare LF, pipelining, and splits
across TCP writes. Hypothesis runs a bounded, derandomized number of examples
(``WARMCTL_GATE_FUZZ_EXAMPLES``, default 60).
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from urllib.parse import unquote

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import read_to_close
from tests.gate_upstream import KEY, RecordingUpstream
from tests.ports import free_port
from warmctl import gate
from warmctl.gate.routes import CONTROL_PATHS, DEFAULT_ALLOW_PATHS

EXAMPLES = int(os.environ.get("WARMCTL_GATE_FUZZ_EXAMPLES", "60"))

# the oracle's own reading of the allow list (not the gate's code): exact paths, and templates
# whose {name} is one segment without "/"
_EXACT = {p for p in DEFAULT_ALLOW_PATHS if "{" not in p}
_TEMPLATES = [re.compile(re.sub(r"\\\{[a-z_]+\\\}", "[^/]+", re.escape(p))) for p in DEFAULT_ALLOW_PATHS if "{" in p]
PUBLIC = {"/health"}


def oracle_allowed(path: str) -> bool:
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in path):
        return False
    return path in _EXACT or any(t.fullmatch(path) for t in _TEMPLATES)


def oracle_authorized(path: str, headers: list[tuple[str, str]]) -> bool:
    if path in PUBLIC:
        return True
    auth = [v for n, v in headers if n == "authorization"]
    if len(auth) != 1:
        return False
    scheme, _, token = auth[0].strip().partition(" ")
    return scheme.lower() == "bearer" and token.strip() == KEY


@dataclass
class Sent:
    """A request as generated: what it means (method, decoded path, body) and its bytes."""

    method: str
    path: str
    body: bytes
    raw: bytes
    #: breaks no rule (an allowed path, written literally, authorized; plain HTTP/1.1 framing and
    #: headers): the gate must pass it to the engine as sent
    clean: bool = False


SAFE = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-._~/"
BASE_PATHS = [p for p in DEFAULT_ALLOW_PATHS if "{" not in p] + [
    "/v1/responses/resp_1", "/v1/responses/resp_1/cancel", *CONTROL_PATHS[:12], "/inference/v1/generate",
    "/metrics", "/ping", "/docs", "/", "*"]


def pick(draw, valid: list, hostile: list, bad: bool = True):
    """One of ``valid``, or (one time in six, when ``bad``) one of ``hostile``: most requests
    then break one rule at most, and a fair share break none and reach the engine."""
    return draw(st.sampled_from(hostile)) if bad and draw(st.integers(0, 5)) == 0 else draw(st.sampled_from(valid))


def odds(draw, n: int, bad: bool = True) -> bool:
    """True one time in ``n + 1`` when ``bad`` (a hostile variant), else never."""
    return bad and draw(st.integers(0, n)) == 0


ALLOWED_BASES = [p for p in DEFAULT_ALLOW_PATHS if "{" not in p] + ["/v1/responses/resp_1", "/v1/responses/resp_1/cancel"]


@st.composite
def paths(draw, bad: bool = True) -> str:
    """A decoded path: a base path, maybe (``bad``) changed the way attackers change them."""
    p = pick(draw, ALLOWED_BASES, BASE_PATHS, bad)
    if p == "*":
        return p
    tweak = pick(draw, ["none"], ["suffix", "prefix", "case", "dots", "segment"], bad)
    if tweak == "suffix":
        p += draw(st.sampled_from(["\n", "\r", "\r\n", "\x00", "\t", "\x7f", "/", "//", "/.", " ", ";x", "\x0b", "é"]))
    elif tweak == "prefix":
        p = draw(st.sampled_from(["/", "/./", "/v1/../", "/x/.."])) + p.lstrip("/")
    elif tweak == "case":
        p = p.upper()
    elif tweak == "dots":
        p = p.replace("/", "/./", 1)
    elif tweak == "segment":
        p = p.rsplit("/", 1)[0] + "/" + draw(st.sampled_from(["..", ".", "%", "%2F", "a/b", "\n"]))
    return p


@st.composite
def targets(draw, path: str, bad: bool = True) -> bytes:
    """The request target for ``path``: each character literal where it may be, else (or at
    random) percent-encoded (``/`` only when ``bad``); maybe (``bad``) absolute-form, maybe a
    query (a plain one unless ``bad``)."""
    if path == "*":
        return b"*"
    out = []
    for ch in path:
        if ch in SAFE and (not draw(st.integers(0, 9)) == 0 or (ch == "/" and not bad)):
            out.append(ch)
        elif ch in SAFE:
            out.append(f"%{ord(ch):02X}" if draw(st.booleans()) else f"%{ord(ch):02x}")
        else:
            out.append("".join(f"%{b:02X}" for b in ch.encode()))
    t = "".join(out)
    if odds(draw, 5, bad):
        t = draw(st.sampled_from(["http://127.0.0.1", "http://h:80", "HTTP://x", "https://[::1]:1"])) + t
    if draw(st.integers(0, 4)) == 0:
        t += "?" + draw(st.sampled_from(["a=1", "x=%0A", "", "q=/sleep"] if bad else ["a=1", ""]))
    return t.encode()


AUTHS = [None, f"Bearer {KEY}", f"bearer {KEY}", f"Bearer  {KEY} ", "Bearer nope", f"Basic {KEY}", KEY, f"Bearer {KEY}x"]
EXTRA = [b"X-A: 1", b"x-request-id: abc", b"User-Agent: fuzz/1", b"Accept: */*", b"Connection: keep-alive",
         b"Upgrade: x", b"upgrade: h2c", b"Connection: Upgrade", b"Expect: 100-continue", b"X-Empty:",
         b"Connection: close, te", b"TE: trailers", b"Keep-Alive: timeout=5", b"X-Tab:\tv", b"Proxy-Connection: x"]


VALID_METHODS = ["GET", "POST", "POST", "POST", "DELETE", "HEAD", "OPTIONS", "PUT", "PATCH"]


@st.composite
def requests(draw, bad: bool = True) -> Sent:
    """A request; without ``bad``, one that breaks no rule (``Sent.clean``)."""
    method = pick(draw, VALID_METHODS, ["CONNECT", "TRACE", "get", "PRI"], bad)
    path = draw(paths(bad))
    target = draw(targets(path, bad))
    # (HTTP/1.0 is valid, but its connection ends after it: no request behind it is read)
    version = pick(draw, [b"HTTP/1.1"] * 6 + [b"HTTP/1.0"] * bad, [b"HTTP/2.0", b"HTTP/1.2", b"HTTP/0.9"], bad)
    lines = [method.encode() + b" " + target + b" " + version, b"Host: x"]
    auth = pick(draw, AUTHS[1:4], AUTHS, bad)
    twice = odd = False
    if auth is not None:
        name = draw(st.sampled_from([b"Authorization", b"authorization", b"AUTHORIZATION"]))
        lines.append(name + b":" + draw(st.sampled_from([b" ", b"", b"  ", b"\t"])) + auth.encode())
        if twice := odds(draw, 9, bad):
            lines.append(b"Authorization: " + auth.encode())  # twice
    lines += draw(st.lists(st.sampled_from(EXTRA[:5]), max_size=2))
    if odd := odds(draw, 5, bad):
        lines.append(draw(st.sampled_from(EXTRA[5:])))
    headers = [(ln.split(b":", 1)[0].decode().lower(), ln.split(b":", 1)[1].decode()) for ln in lines[1:]]
    clean = (method in VALID_METHODS and version == b"HTTP/1.1" and not twice and not odd
             and unquote(target.partition(b"?")[0].decode()) == path and b"%2F" not in target.upper()
             and target.partition(b"?")[2] in (b"", b"a=1")
             and oracle_allowed(path) and oracle_authorized(path, headers))
    body = draw(st.sampled_from([b"", b"", b'{"prompt": "hi"}', b"x" * 300, b"GET /sleep HTTP/1.1\r\n\r\n"]))
    framing = pick(draw, ["cl", "cl", "chunked", "none"], ["cl+te", "te-odd", "cl-twice", "cl-short"], bad)
    payload = b""
    if framing == "none":
        body = b""
    elif framing in ("cl", "cl+te", "cl-twice", "cl-short"):
        n = len(body) - (1 if framing == "cl-short" and body else 0)
        lines.append(draw(st.sampled_from([b"Content-Length", b"content-length"])) + b": " + str(n).encode())
        if framing == "cl+te":
            lines.append(b"Transfer-Encoding: chunked")
        if framing == "cl-twice":
            lines.append(b"Content-Length: " + str(n + 1).encode())
        payload, body = body, body[:n]  # cl-short: the last byte is the next request's first
    else:
        te = b"chunked" if framing == "chunked" else draw(st.sampled_from([b"gzip, chunked", b"chunked, chunked",
                                                                          b"Chunked", b"identity"]))
        lines.append(b"Transfer-Encoding: " + te)
        cuts = sorted(draw(st.lists(st.integers(0, len(body)), max_size=3)))
        pieces = [body[a:b] for a, b in zip([0, *cuts], [*cuts, len(body)]) if b > a]
        for piece in pieces:
            ext = draw(st.sampled_from([b"", b"", b";x=1", b";a"]))
            payload += b"%x%s\r\n%s\r\n" % (len(piece), ext, piece)
        payload += b"0\r\n" + draw(st.sampled_from([b"", b"", b"X-Trailer: 1\r\n"])) + b"\r\n"
    eol = b"\n" if odds(draw, 14, bad) else b"\r\n"
    raw = eol.join(lines) + eol + eol + payload
    return Sent(method, path, body, raw, clean and framing in ("cl", "chunked", "none") and eol == b"\r\n")


@st.composite
def connections(draw, bad: bool = True) -> tuple[list[Sent], list[bytes]]:
    """1-4 requests (without ``bad``: clean ones) and a sentinel (``/health``,
    ``Connection: close``), in writes cut at random."""
    reqs = draw(st.lists(requests(bad), min_size=1, max_size=4))
    stream = b"".join(r.raw for r in reqs) + b"GET /health?sentinel=1 HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    cuts = sorted(set(draw(st.lists(st.integers(1, len(stream) - 1), max_size=4))))
    writes = [stream[a:b] for a, b in zip([0, *cuts], [*cuts, len(stream)])]
    return reqs + [Sent("GET", "/health", b"", b"", clean=True)], writes


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    up = RecordingUpstream()
    d = tmp_path_factory.mktemp("gate")
    keys = d / "keys"
    keys.write_text(KEY + "\n")
    keys.chmod(0o600)
    engine = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(900)"])
    port = free_port()
    # limits far above what a stream here takes (none waits on one): a loaded host that holds
    # this process back between two writes of a head must not turn a clean request into a 408
    pid = gate.start("127.0.0.1", port, up.port, engine.pid, d / "gate.log", config=gate.GateConfig(
        api_key_file=keys, limits={"head_timeout_s": 10, "body_timeout_s": 10, "keep_alive_s": 10}).check())
    yield up, port, d / "gate.log"
    subprocess.run(["kill", str(pid)], check=False)
    engine.kill()
    engine.wait()
    up.close()


def _run(port: int, writes: list[bytes]) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            for w in writes:
                s.sendall(w)
                time.sleep(0.002)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the gate refused and closed: what it answered is still read below
        return read_to_close(s)


def _check(up: RecordingUpstream, sent: list[Sent]) -> None:
    assert up.errors == [], up.errors
    for h in up.heads:
        assert oracle_allowed(h.path), f"a head for {h.path!r} reached the engine"
        assert oracle_authorized(h.path, h.header_list), f"an unauthorized head for {h.path!r} reached the engine"
        assert "upgrade" not in h.headers and h.target.startswith("/"), h
    i = 0
    for seen in up.seen():
        while i < len(sent) and (sent[i].method, sent[i].path, sent[i].body) != (seen.method, seen.path, seen.body):
            i += 1
        assert i < len(sent), f"the engine saw {seen.method} {seen.path!r} {seen.body!r}, which the client never sent"
        i += 1
    # and the other way: every clean request before the first that breaks a rule (after which
    # the gate may close the connection) reached the engine, in order, as sent
    must = []
    for r in sent:
        if not r.clean:
            break
        must.append((r.method, r.path, r.body))
    got = [(x.method, x.path, x.body) for x in up.seen()][:len(must)]
    assert got == must, f"allowed, authorized requests did not reach the engine as sent: {must[len(got):] or must}"


@settings(max_examples=EXAMPLES, derandomize=True, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large])
@given(conn=connections())
def test_only_allowed_authorized_requests_reach_the_engine_as_sent(setup, conn):
    up, port, log = setup
    sent, writes = conn
    up.clear()
    _run(port, writes)
    _check(up, sent)


@settings(max_examples=EXAMPLES, derandomize=True, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large])
@given(conn=connections(bad=False))
def test_every_allowed_authorized_request_reaches_the_engine_as_sent(setup, conn):
    """The converse: requests that break no rule (allowed paths, some with harmless
    percent-encodings, authorized; every valid method; Content-Length, chunked with extensions
    and trailers, or no body; pipelined, split across writes) all reach the engine, in order,
    with the method, path and body sent. A gate refusing everything fails here."""
    up, port, log = setup
    sent, writes = conn
    assert all(r.clean for r in sent)
    up.clear()
    _run(port, writes)
    _check(up, sent)
    assert [(x.method, x.path, x.body) for x in up.seen()] == [(r.method, r.path, r.body) for r in sent]


def test_the_known_smuggling_probes_as_one_stream_each(setup):
    """The probes first found to reach the engine past the gate (a request smuggled after an
    ``Upgrade``, a control route with an encoded newline, vLLM's own generate route, an
    unparsable absolute URL, ``Content-Length`` beside ``Transfer-Encoding``) through the same
    property check (no hypothesis: always these)."""
    up, port, log = setup
    auth = f"Authorization: Bearer {KEY}\r\n".encode()
    probes = [
        b"GET /health HTTP/1.1\r\nHost: x\r\nUpgrade: x\r\n\r\nPOST /is_scaling_elastic_ep HTTP/1.1\r\nHost: x\r\n"
        b"Content-Length: 0\r\n\r\n",
        b"POST /is_scaling_elastic_ep%0A HTTP/1.1\r\nHost: x\r\n" + auth + b"Content-Length: 0\r\n\r\n",
        b"POST /inference/v1/generate HTTP/1.1\r\nHost: x\r\n" + auth + b"Content-Length: 2\r\n\r\n{}",
        b"GET http://[::1/v1/models HTTP/1.1\r\nHost: x\r\n" + auth + b"\r\n",
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n" + auth + b"Content-Length: 5\r\nTransfer-Encoding: chunked\r\n"
        b"\r\n0\r\n\r\n",
    ]
    for p in probes:
        up.clear()
        raw = _run(port, [p])
        assert raw.startswith(b"HTTP/1.1 4") or raw.startswith(b"HTTP/1.1 5"), raw
        _check(up, [])  # nothing at all reached the engine
    up.clear()
    _run(port, [b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"])
    assert [(s.method, s.path) for s in up.seen()] == [("GET", "/health")]  # the check sees what arrives
    assert "Traceback" not in log.read_text()
