"""The supervisor's readiness endpoint: a pod Ready the moment its public port opens.

A readiness probe on the gate's ``/health`` (the public port) finds the port closed until the
canary passed, so the kubelet learns of the opening only at its next probe: up to one
``periodSeconds`` later (1 s, the shortest Kubernetes allows: 0.5 s on average;
``benchmarks/pod_vs_host.py --ready-probe`` measured a ``tiny`` restore pod at 1.62x the host's
``up`` probed so, 1.31x probed here). ``warmctl up NAME --foreground --ready-port PORT`` serves,
on a port of its own, one request:

``GET /ready?wait=S``
    While ``up`` works (the public port not yet open) the request is held for up to ``S``
    seconds (``0`` when not given; at most :data:`MAX_WAIT_S`) and answered as soon as the port
    opens. Once the port is open, it is answered at once with what the gate's own ``/health``
    answers on the public port (asked over loopback, over TLS when the gate has it): **200** when
    that is 200, else **503**. So readiness still means what the gate's ``/health`` means (the
    canary passed, the port is open, no drain begun, the engine healthy), learnt without the
    probe period's wait. A held request that ``up``'s failure or a stop ends gets 503.

The probe's ``timeoutSeconds`` must exceed ``S`` (deploy/kubernetes/engine-deployment.yaml:
``/ready?wait=8`` under a 10 s timeout). The body is one line of text (``serving``, or why not).
Any other method or path gets 405 or 404. The server is the standard library's
:class:`http.server.ThreadingHTTPServer` (one thread per request, held requests included).
"""

from __future__ import annotations

import math
import socket
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

#: the longest a request is held (seconds): a larger ``?wait=`` is cut to it
MAX_WAIT_S = 60.0


class ReadinessServer:
    """``GET /ready`` on ``host:port`` (module doc), served from a daemon thread from
    construction until :meth:`close`. ``check``: called once the port is open, for each request;
    returns ``(ready, why)`` (``why`` the body of a 503). ``host``: an IPv4 or IPv6 address.
    Raises :class:`OSError` when the address cannot be bound (a port in use)."""

    def __init__(self, host: str, port: int, check: Callable[[], tuple[bool, str]]) -> None:
        self.check = check
        self._opened = threading.Event()
        self._closed = False
        server = _Server6 if ":" in host else ThreadingHTTPServer
        self._http = server((host, port), _handler(self))
        self._http.daemon_threads = True
        self.port = self._http.server_address[1]
        threading.Thread(target=self._http.serve_forever, name="warmctl-ready", daemon=True).start()

    def opened(self) -> None:
        """The public port is open: release the held requests (each then runs :attr:`check`)."""
        self._opened.set()

    def close(self) -> None:
        """Stop serving; held requests are answered 503 at once."""
        self._closed = True
        self._opened.set()
        self._http.shutdown()
        self._http.server_close()

    def answer(self, wait_s: float) -> tuple[int, str]:
        """(HTTP status, body) of one ``GET /ready?wait=wait_s``."""
        if not self._opened.wait(min(max(wait_s, 0.0), MAX_WAIT_S)):
            return 503, "not ready: up has not opened the public port yet"
        if self._closed:
            return 503, "not ready: the supervisor is stopping"
        try:
            ok, why = self.check()
        except Exception as e:  # noqa: BLE001 - a failing check is a failed probe, never a dead endpoint
            ok, why = False, f"{type(e).__name__}: {e}"
        return (200, "serving") if ok else (503, f"not ready: {why}")


class _Server6(ThreadingHTTPServer):
    address_family = socket.AF_INET6


def _handler(server: ReadinessServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            u = urlsplit(self.path)
            if u.path != "/ready":
                return self._send(404, f"no such path: {u.path} (GET /ready?wait=SECONDS)")
            try:
                wait_s = float(parse_qs(u.query).get("wait", ["0"])[0])
            except ValueError:
                wait_s = math.nan
            if not math.isfinite(wait_s):  # "nan" held nothing and answered 503: a bad request, say so
                return self._send(400, "wait: a number of seconds")
            self._send(*server.answer(wait_s))

        def do_POST(self) -> None:  # noqa: N802
            self._send(405, "GET /ready only")

        do_PUT = do_DELETE = do_PATCH = do_POST  # noqa: N815

        def _send(self, status: int, text: str) -> None:
            body = (text + "\n").encode()
            self.send_response(status)
            self.send_header("Content-Type", "text/plain; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - http.server's signature
            pass  # the kubelet probes every second: nothing worth a log line

    return Handler
