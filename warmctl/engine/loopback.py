"""Plain HTTP/1.1 requests to an engine on this host (the health poll and the canary of every
``warmctl up`` and ``snapshot``), with the standard library's :mod:`http.client`.

Why not httpx, which the rest of warmctl uses (agent client, benchmarks, vLLM's sleep API):
``import httpx`` also imports httpx's own command-line client (click, pygments, rich's
progress, table and syntax modules), 45-120 ms of every ``up`` on the 2-core development host
(``python -X importtime``). A GET and a JSON POST to ``http://127.0.0.1:PORT`` need
none of it.
"""

from __future__ import annotations

import http.client
import json
from typing import Any
from urllib.parse import urlsplit


class LoopbackError(Exception):
    """The request failed: no connection, a broken or timed-out exchange, an HTTP status of
    400 or more, or a body that is not JSON. The message names the method, URL and cause."""


def healthy(port: int, timeout_s: float = 5.0, host: str = "127.0.0.1", tls: bool = False) -> bool:
    """True if the engine (or the gate) on ``host:port`` answers ``GET /health`` with 200
    (``timeout_s`` bounds connecting and the read): the one ``/health`` probe of an engine
    already up (``up``'s already-up check, ``status``, the foreground supervisor and its
    readiness endpoint). ``tls``: over HTTPS, the certificate not verified (a liveness check of
    this host's own port, as the kubelet's HTTPS probes do). False on any failure."""
    addr = f"[{host}]" if ":" in host else host  # an IPv6 address
    with Connection(f"{'https' if tls else 'http'}://{addr}:{port}", timeout_s) as c:
        try:
            return c.status("/health") == 200
        except LoopbackError:
            return False


class Connection:
    """One keep-alive HTTP/1.1 connection to ``base_url`` (``http://HOST:PORT``, no path; or
    ``https://HOST:PORT``, the certificate not verified: for :func:`healthy` alone);
    ``timeout_s`` bounds connecting and each read. After a failed request the connection is
    closed, and the next request opens a new one. Use as a context manager (closes it)."""

    def __init__(self, base_url: str, timeout_s: float) -> None:
        u = urlsplit(base_url)
        if u.scheme not in ("http", "https") or not u.hostname or u.path.strip("/"):
            raise ValueError(f"{base_url!r}: expected http://HOST:PORT")
        self.base_url = base_url.rstrip("/")
        self._conn: http.client.HTTPConnection
        if u.scheme == "https":
            import ssl

            ctx = ssl.create_default_context()
            ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
            self._conn = http.client.HTTPSConnection(u.hostname, u.port or 443, timeout=timeout_s, context=ctx)
        else:
            self._conn = http.client.HTTPConnection(u.hostname, u.port or 80, timeout=timeout_s)

    def __enter__(self) -> Connection:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._conn.close()

    def request(self, method: str, path: str, body: Any = None) -> tuple[int, bytes]:
        """Send ``method path`` (``body``, when given, as JSON); (status, response body).
        Raises :class:`LoopbackError` when no response came back whole."""
        headers = {"Accept": "application/json"}
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        try:
            self._conn.request(method, path, body=data, headers=headers)
            r = self._conn.getresponse()
            return r.status, r.read()
        except (OSError, http.client.HTTPException) as e:  # refused, reset, timeout, bad status line
            self._conn.close()
            raise LoopbackError(f"{method} {self.base_url}{path}: {type(e).__name__}: {e}") from None

    def status(self, path: str) -> int:
        """``GET path``: the HTTP status. Raises :class:`LoopbackError` on a transport failure."""
        return self.request("GET", path)[0]

    def post_json(self, path: str, body: Any) -> Any:
        """``POST path`` with ``body`` as JSON; the parsed JSON answer. Raises
        :class:`LoopbackError` on a transport failure, a status of 400 or more (with the start
        of the answer), or an answer that is not JSON."""
        status, data = self.request("POST", path, body)
        if status >= 400:
            raise LoopbackError(f"POST {self.base_url}{path}: HTTP {status}: {data[:500].decode(errors='replace')}")
        try:
            return json.loads(data)
        except ValueError as e:
            raise LoopbackError(f"POST {self.base_url}{path}: answer is not JSON ({e})") from None
