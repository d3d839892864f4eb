"""Reading client requests (llhttp, through ``httptools``) and writing them for the engine.

One reading: every byte a client sends is parsed once, by llhttp in its strict mode (the
parser the engine's own uvicorn uses), into :class:`Head`, body blocks and an end of message
(:class:`RequestReader`). The gate forwards only what was parsed and authorized, written anew
in one canonical form (:meth:`Head.serialise`: the request line in origin form, the client's
end-to-end headers as parsed, one ``Content-Length`` or ``Transfer-Encoding: chunked``,
``Connection: close`` where the client asked for it), so the engine cannot read a request the
gate did not read: there is no pass-through of client bytes.

Refused here, before any policy, with the response to send (:class:`Refused`): whatever llhttp
rejects (bare LF, CL+TE, duplicate or signed Content-Length, obs-fold, bad tokens: 400), a
head longer than :data:`MAX_HEAD` (431), HTTP versions other than 1.0/1.1 and the HTTP/2
preface (505), ``CONNECT`` and methods outside :data:`METHODS` (405), any ``Upgrade`` header
(400: no WebSocket, no h2c), transfer codings other than plain ``chunked`` (501), a request
target llhttp's URL parser rejects (400), and a control character (a byte below 0x20, or
0x7f) in the path, raw or percent-decoded (400).
"""

from __future__ import annotations

import json
import time
import urllib.parse
from dataclasses import dataclass

import httptools

#: Longest request head (request line + headers) accepted, bytes; longer gets 431.
MAX_HEAD = 64 * 1024
#: Methods the public port accepts; others get 405.
METHODS = frozenset({b"GET", b"HEAD", b"POST", b"PUT", b"PATCH", b"DELETE", b"OPTIONS"})
#: Headers of one hop, not forwarded (the gate writes its own framing and Connection).
HOP_BY_HOP = frozenset({b"connection", b"keep-alive", b"proxy-connection", b"transfer-encoding",
                        b"content-length", b"te", b"trailer", b"upgrade", b"http2-settings"})


class Refused(Exception):
    """A request the gate answers itself: ``status``/``reason``, an OpenAI-style JSON error
    with ``code`` and the message; ``extra``: more header lines (bytes, CRLF-terminated)."""

    def __init__(self, status: int, reason: str, message: str, code: str, extra: bytes = b""):
        super().__init__(message)
        self.status, self.reason, self.code, self.extra = status, reason, code, extra

    def response(self) -> bytes:
        """The whole response (it closes the connection)."""
        body = json.dumps({"error": {"message": str(self), "type": "invalid_request_error" if self.status != 401
                                     else "authentication_error", "param": None, "code": self.code}}).encode()
        return (f"HTTP/1.1 {self.status} {self.reason}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n").encode() + self.extra + b"\r\n" + body


def bad(msg: str) -> Refused:
    return Refused(400, "Bad Request", msg, "bad_request")


def timeout(msg: str) -> Refused:
    return Refused(408, "Request Timeout", msg, "request_timeout")


def has_control(s: str) -> bool:
    """True if ``s`` holds a control character (below U+0020, or U+007F)."""
    return any(c < " " or c == "\x7f" for c in s)


def request_path(target: bytes) -> tuple[str, bytes]:
    """``(path, origin_form)`` of a request target as the engine's uvicorn reads it: the path of
    :func:`httptools.parse_url` (also of an absolute-form target), percent-decoded when it holds
    a ``%`` (``scope["path"]``); and the target to forward (raw path and query). Raises
    :class:`Refused` (400) for a target llhttp's URL parser rejects, a non-ASCII path, or a
    control character in the path, raw or decoded."""
    if target == b"*":
        return "*", b"*"
    try:
        url = httptools.parse_url(target)
    except httptools.HttpParserInvalidURLError:
        raise bad("malformed request target") from None
    raw = url.path or b"/"
    try:
        path = raw.decode("ascii")
    except UnicodeDecodeError:
        raise bad("non-ASCII bytes in the request path") from None
    if "%" in path:
        path = urllib.parse.unquote(path)
    if has_control(path):
        raise bad("a control character in the request path")
    return path, raw + (b"?" + url.query if url.query else b"")


@dataclass
class Head:
    """One request head as parsed: ``method``; ``version`` (``b"1.0"``/``b"1.1"``); ``path``
    (decoded, what routing sees); ``target`` (origin form to forward); ``headers`` (end-to-end
    ones, in order, as sent); ``authorization`` (its value or None); the body's framing
    (``content_length``: None without one; ``chunked``); ``keep_alive``: the connection may
    carry another request after this one."""

    method: bytes
    version: bytes
    path: str
    target: bytes
    headers: list[tuple[bytes, bytes]]
    authorization: bytes | None
    content_length: int | None
    chunked: bool
    keep_alive: bool

    def serialise(self) -> bytes:
        """The head as the engine gets it (canonical framing; see the module's docstring)."""
        out = [self.method, b" ", self.target, b" HTTP/", self.version, b"\r\n"]
        for n, v in self.headers:
            out += [n, b": ", v, b"\r\n"]
        if self.chunked:
            out.append(b"Transfer-Encoding: chunked\r\n")
        elif self.content_length is not None:
            out.append(b"Content-Length: %d\r\n" % self.content_length)
        if not self.keep_alive:
            out.append(b"Connection: close\r\n")
        elif self.version == b"1.0":
            out.append(b"Connection: keep-alive\r\n")
        out.append(b"\r\n")
        return b"".join(out)


#: the end of a request's body (an event of :meth:`RequestReader.feed`)
END = object()


class _Stop(Exception):
    """Raised in a parser callback to stop llhttp after a refusal."""


class RequestReader:
    """The requests of one client connection, from its bytes (:meth:`feed`), as events:
    :class:`Head`, ``bytes`` (a block of the body, de-chunked), :data:`END`, and
    :class:`Refused` (the last event: nothing after it is parsed). ``phase`` says where the
    byte stream is: ``"idle"`` (between requests), ``"head"`` (a head begun; since
    ``started``), ``"body"`` (since ``started``; ``body_bytes`` received)."""

    def __init__(self) -> None:
        self._parser = httptools.HttpRequestParser(self)
        self._events: list = []
        self._url = b""
        self._headers: list[tuple[bytes, bytes]] = []
        self._head_size = 0
        self.phase = "idle"
        self.started = 0.0
        self.body_bytes = 0
        self.stopped = False

    def feed(self, data: bytes) -> list:
        """Parse ``data``, the next bytes from the client; return the events it completes."""
        if self.stopped:
            return []
        carried = self.phase == "head"  # a head begun in an earlier block goes on
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserCallbackError:  # a callback raised (httptools wraps it): _Stop, else a bug
            if not self.stopped:
                self._refuse(bad("malformed request"))
        except httptools.HttpParserUpgrade:  # Upgrade/CONNECT: refused in on_headers_complete
            if not self.stopped:
                self._refuse(bad("protocol upgrades are not served"))
        except httptools.HttpParserError as e:
            if not self.stopped:
                if data.startswith(b"PRI * HTTP/2") or self._url == b"*" and self.phase == "head":
                    self._refuse(Refused(505, "HTTP Version Not Supported", "HTTP/2 is not served: use HTTP/1.1",
                                         "http_version_not_supported"))
                else:
                    self._refuse(bad(f"malformed request: {e}"))
        if carried and self.phase == "head" and not self.stopped:
            self._head_size += len(data)  # an upper bound of what llhttp holds of the unfinished head
            if self._head_size > MAX_HEAD:
                self._refuse(Refused(431, "Request Header Fields Too Large",
                                     f"request head longer than {MAX_HEAD} bytes", "header_too_large"))
        events, self._events = self._events, []
        return events

    def _refuse(self, r: Refused) -> None:
        self.stopped = True
        self._events.append(r)

    def _grow(self, n: int) -> None:
        self._head_size += n
        if self._head_size > MAX_HEAD:
            self._refuse(Refused(431, "Request Header Fields Too Large",
                                 f"request head longer than {MAX_HEAD} bytes", "header_too_large"))
            raise _Stop

    # llhttp's callbacks (httptools calls them from feed_data)
    def on_message_begin(self) -> None:
        self.phase, self.started = "head", time.monotonic()
        self._url, self._headers, self._head_size = b"", [], 0

    def on_url(self, url: bytes) -> None:
        self._url += url
        self._grow(len(url))

    def on_header(self, name: bytes, value: bytes) -> None:
        if self.phase == "head":  # after the body: trailers, dropped
            self._headers.append((name, value))
            self._grow(len(name) + len(value) + 4)

    def on_headers_complete(self) -> None:
        try:
            head = self._head()
        except Refused as r:
            self._refuse(r)
            raise _Stop from None
        self._events.append(head)
        self.phase, self.started, self.body_bytes = "body", time.monotonic(), 0

    def on_body(self, body: bytes) -> None:
        self._events.append(body)
        self.body_bytes += len(body)

    def on_message_complete(self) -> None:
        self._events.append(END)
        self.phase = "idle"

    def _head(self) -> Head:
        p = self._parser
        version = p.get_http_version().encode()
        if version not in (b"1.0", b"1.1"):
            raise Refused(505, "HTTP Version Not Supported", f"HTTP/{version.decode()} is not served: use HTTP/1.1",
                          "http_version_not_supported")
        method = p.get_method()
        if method not in METHODS:
            raise Refused(405, "Method Not Allowed", f"method {method.decode('latin-1')!r} is not allowed",
                          "method_not_allowed")
        auth = None
        length = None
        te: list[bytes] = []
        headers = []
        for name, value in self._headers:
            n = name.lower()
            if n == b"upgrade":
                raise bad("protocol upgrades (Upgrade) are not served")
            if n == b"authorization":
                if auth is not None:
                    raise bad("more than one Authorization header")
                auth = value
            elif n == b"content-length":
                length = int(value)  # llhttp accepts digits only, once
            elif n == b"transfer-encoding":
                te += [c.strip().lower() for c in value.split(b",")]
            if n not in HOP_BY_HOP:
                headers.append((name, value))
        if te and te != [b"chunked"]:
            raise Refused(501, "Not Implemented", "only 'Transfer-Encoding: chunked' is accepted", "not_implemented")
        path, target = request_path(self._url)
        return Head(method, version, path, target, headers, auth, None if te else length, bool(te),
                    bool(p.should_keep_alive()))


def chunk(data: bytes) -> bytes:
    """``data`` as one chunk of a chunked body."""
    return b"%x\r\n%s\r\n" % (len(data), data)


LAST_CHUNK = b"0\r\n\r\n"
