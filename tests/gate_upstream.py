"""A stand-in engine for the gate's tests that reads what the gate sends with a second strict
HTTP/1.1 parser, h11 (the gate reads clients with llhttp), and records every request.

    from tests.gate_upstream import RecordingUpstream
    up = RecordingUpstream(); ...; up.seen(); up.errors; up.close()

Each request is answered 200 with ``{"ok": true}`` (keep-alive), except as its query asks:
``status=N`` (that status), ``respond_close=1`` (``Connection: close``, then close),
``close_after_head=1`` (close without reading the body or answering), ``like_uvicorn=1``
(answer after 0.3 s, and not at all if the connection was half-closed meanwhile: uvicorn's
protocol closes the connection at EOF, before its app has answered). ``GET /openapi.json``
answers a route table like vLLM 0.32's (:data:`ROUTES`) and is not recorded: the gate reads it
for its log. A byte stream h11 cannot parse is recorded in :attr:`RecordingUpstream.errors`:
the gate must never send one.
"""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.parse
from dataclasses import dataclass, field

import h11

KEY = "sk-warmctl-gate-test-0001"

#: the route table the stand-in lists (a few inference routes, several control routes)
ROUTES = ("/health", "/v1/models", "/v1/completions", "/v1/chat/completions", "/v1/responses/{response_id}",
          "/tokenize", "/sleep", "/wake_up", "/collective_rpc", "/is_scaling_elastic_ep", "/scale_elastic_ep",
          "/inference/v1/generate", "/inference/v1/abort_requests", "/server_info", "/ping")


def read_response(f) -> tuple[int, dict, bytes]:
    """One HTTP/1.1 response with a Content-Length body from the file object ``f``."""
    status = int(f.readline().split()[1])
    headers = {}
    while (line := f.readline()) not in (b"\r\n", b""):
        k, _, v = line.decode().partition(":")
        headers[k.strip().lower()] = v.strip()
    body = f.read(int(headers.get("content-length", 0)))
    return status, headers, body


@dataclass
class Seen:
    """A request as the upstream read it: ``target`` as sent, ``path`` as uvicorn would route
    it (percent-decoded path), ``headers`` (lower-cased names; the last of repeated ones)."""

    method: str
    target: str
    path: str
    headers: dict[str, str]
    body: bytes = b""
    header_list: list = field(default_factory=list)


class RecordingUpstream:
    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(512)
        self.port = self.sock.getsockname()[1]
        self._seen: list[Seen] = []
        #: every request head read, whole request or not (the gate forwards a head before its body)
        self.heads: list[Seen] = []
        self.errors: list[str] = []
        self._lock = threading.Lock()
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def seen(self) -> list[Seen]:
        with self._lock:
            return list(self._seen)

    def clear(self) -> None:
        with self._lock:
            self._seen.clear()
            self.heads.clear()
            self.errors.clear()

    def close(self) -> None:
        self._closed = True
        self.sock.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(c,), daemon=True).start()

    def _serve(self, c: socket.socket) -> None:
        conn = h11.Connection(h11.SERVER)
        req: Seen | None = None
        query: dict = {}
        try:
            while True:
                try:
                    ev = conn.next_event()
                except h11.RemoteProtocolError as e:
                    with self._lock:
                        self.errors.append(f"h11 could not parse what the gate sent: {e}")
                    return
                if ev is h11.NEED_DATA:
                    data = c.recv(65536)
                    conn.receive_data(data)
                    if not data and conn.their_state is not h11.DONE:
                        return
                    continue
                if isinstance(ev, h11.Request):
                    target = ev.target.decode("latin-1")
                    raw_path, _, q = target.partition("?")
                    query = dict(urllib.parse.parse_qsl(q))
                    headers = [(n.decode(), v.decode("latin-1")) for n, v in ev.headers]
                    req = Seen(ev.method.decode(), target, urllib.parse.unquote(raw_path), dict(headers),
                               header_list=headers)
                    if req.method == "GET" and req.path == "/openapi.json":
                        req = None
                    else:
                        with self._lock:
                            self.heads.append(req)
                        if query.get("close_after_head"):
                            with self._lock:
                                self._seen.append(req)
                            return
                elif isinstance(ev, h11.Data):
                    if req is not None:
                        req.body += bytes(ev.data)
                elif isinstance(ev, h11.EndOfMessage):
                    if query.get("delay"):  # a slow engine: answer after this many seconds
                        time.sleep(float(query["delay"]))
                    if query.get("like_uvicorn"):
                        time.sleep(0.3)
                        try:
                            if c.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b"":
                                return  # EOF: uvicorn closes without answering
                        except BlockingIOError:
                            pass
                    if req is not None:
                        with self._lock:
                            self._seen.append(req)
                        body = json.dumps({"ok": True}).encode()
                        status = int(query.get("status", 200))
                    else:
                        body = json.dumps({"openapi": "3.1.0", "paths": {r: {} for r in ROUTES}}).encode()
                        status = 200
                    headers = [("Content-Type", "application/json"), ("Content-Length", str(len(body)))]
                    if query.get("respond_close"):
                        headers.append(("Connection", "close"))
                    c.sendall(conn.send(h11.Response(status_code=status, headers=headers)))
                    if req is None or req.method != "HEAD":
                        c.sendall(conn.send(h11.Data(data=body)))
                    c.sendall(conn.send(h11.EndOfMessage()))
                    if conn.our_state is h11.MUST_CLOSE:
                        return
                    conn.start_next_cycle()
                    req, query = None, {}
                elif isinstance(ev, h11.ConnectionClosed):
                    return
        except (OSError, h11.LocalProtocolError):
            return
        finally:
            c.close()
