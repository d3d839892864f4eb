"""A fault-injecting HTTP proxy on loopback, put between boto3 and an S3 server in tests.

It forwards every request to ``upstream`` and counts them; ``fault(method, path, n)`` (set by
the test) may return ``"503"`` (answer SlowDown), ``"403"`` (AccessDenied), ``"truncate"`` (send the real headers, half
the body, then close), ``"reset"`` (close without answering) or a float (delay seconds).
"""

from __future__ import annotations

import http.client
import socket
import threading
from collections import Counter
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlparse

_ERRORS = {
    code: (
        f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{name}</Code>'
        "<Message>injected by test proxy</Message></Error>"
    ).encode()
    for code, name in (("503", "SlowDown"), ("403", "AccessDenied"))
}


class FaultProxy:
    def __init__(self, upstream: str):
        u = urlparse(upstream)
        self.up_host, self.up_port = u.hostname, u.port
        self.counts: Counter = Counter()
        self.faults: Counter = Counter()
        self.fault: Callable[[str, str, int], object] | None = None
        self._mu = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):  # quiet
                pass

            def _forward(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                path = self.path.split("?")[0]
                with proxy._mu:
                    proxy.counts[(self.command, path)] += 1
                    n = proxy.counts[(self.command, path)]
                action = proxy.fault(self.command, path, n) if proxy.fault else None
                if isinstance(action, float):
                    threading.Event().wait(action)
                    action = None
                if action == "reset":
                    proxy.faults[action] += 1
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                if action in _ERRORS:
                    proxy.faults[action] += 1
                    body = _ERRORS[action]
                    self.send_response(int(action))
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    if self.command != "HEAD":
                        self.wfile.write(body)
                    return
                conn = http.client.HTTPConnection(proxy.up_host, proxy.up_port, timeout=30)
                headers = {k: v for k, v in self.headers.items() if k.lower() not in ("connection", "keep-alive")}
                conn.request(self.command, self.path, body=body if body else None, headers=headers)
                resp = conn.getresponse()
                data = resp.read()
                conn.close()
                self.send_response(resp.status)
                for k, v in resp.getheaders():
                    if k.lower() not in ("transfer-encoding", "connection", "content-length", "server", "date"):
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if action == "truncate" and self.command == "GET" and len(data) > 1:
                    proxy.faults[action] += 1
                    self.wfile.write(data[: len(data) // 2])
                    self.wfile.flush()
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                if self.command != "HEAD":
                    self.wfile.write(data)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _forward

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def start(self) -> "FaultProxy":
        self._thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def gets(self, part: str = "/chunks/") -> int:
        """Number of GET requests whose path contains ``part``."""
        return sum(n for (m, p), n in self.counts.items() if m == "GET" and part in p)
