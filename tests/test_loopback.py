"""warmctl.engine.loopback (the health poll's and the canary's HTTP client) against a real HTTP
server on loopback (the standard library's ThreadingHTTPServer, port 0): statuses, JSON both
ways, errors that name the URL and the cause, and a new connection after the server closed one."""

from __future__ import annotations

import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from warmctl.engine import canary
from warmctl.engine.loopback import Connection, LoopbackError, healthy
from warmctl.base.errors import EngineError
from warmctl.records.profile import CanarySpec


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as vLLM's uvicorn

    def log_message(self, *a):
        pass

    def _send(self, status: int, body: bytes, close: bool = False) -> None:
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        if close:
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(body)
        if close:
            self.close_connection = True

    def do_GET(self):
        self.server.peers.append(self.client_address)
        if self.path == "/health":
            self._send(200, b"")
        elif self.path == "/close":
            self._send(200, b"", close=True)
        else:
            self._send(404, b"not here")

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path == "/v1/completions":
            if body["prompt"] == "boom":
                return self._send(500, b"engine fell over")
            ids = [7, 8, 9][: body["max_tokens"]]
            self._send(200, json.dumps({"choices": [{"text": "x", "token_ids": ids, "logprobs": None}]}).encode())
        else:
            self._send(200, b"not json")


@pytest.fixture
def server():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    srv.peers = []
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield srv, f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


def test_status_json_and_keep_alive(server):
    srv, url = server
    with Connection(url, 5) as c:
        assert c.status("/health") == 200
        assert c.status("/health") == 200
        assert c.status("/nope") == 404
        assert c.post_json("/v1/completions", {"prompt": "a", "max_tokens": 2})["choices"][0]["token_ids"] == [7, 8]
        assert len({p for p in srv.peers}) == 1  # one connection for all of them
        assert c.status("/close") == 200  # the server closes this one ...
        assert c.status("/health") == 200  # ... and the next request opens another
        assert len({p for p in srv.peers}) == 2


def test_errors_name_the_url_and_the_cause(server):
    _, url = server
    with Connection(url, 5) as c:
        with pytest.raises(LoopbackError, match=r"POST http://127\.0\.0\.1:\d+/v1/completions: HTTP 500: engine fell over"):
            c.post_json("/v1/completions", {"prompt": "boom", "max_tokens": 1})
        with pytest.raises(LoopbackError, match="answer is not JSON"):
            c.post_json("/other", {})
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    free = s.getsockname()[1]
    s.close()  # nothing listens there now
    with Connection(f"http://127.0.0.1:{free}", 5) as c, pytest.raises(LoopbackError, match="ConnectionRefusedError"):
        c.status("/health")
    with pytest.raises(ValueError, match="expected http://HOST:PORT"):
        Connection("https://127.0.0.1:1/v1", 5)


def test_canary_run_over_loopback(server):
    _, url = server
    spec = CanarySpec(prompts=["a", "b"], max_tokens=3, logprobs=0)
    rec = canary.run(url, spec, "m")
    assert [c.token_ids for c in rec.completions] == [[7, 8, 9], [7, 8, 9]]
    with pytest.raises(EngineError, match="canary request to .* failed: .*HTTP 500"):
        canary.run(url, CanarySpec(prompts=["boom"], max_tokens=1, logprobs=0), "m")


def test_the_one_health_probe(server):
    """``healthy``: 200 on ``/health`` within the timeout, else False (no listener, a stalled one)."""
    srv, _ = server
    assert healthy(srv.server_address[1]) is True
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    assert healthy(closed) is False
    with socket.socket() as mute:  # accepts (backlog) and never answers: the timeout ends it
        mute.bind(("127.0.0.1", 0))
        mute.listen(1)
        assert healthy(mute.getsockname()[1], timeout_s=0.3) is False
