"""The agent's outermost ASGI layer: authentication and a body-size cap before any body byte
is read.

FastAPI reads and parses a request's JSON body before it runs the route's dependencies, so an
auth dependency alone lets anyone make the agent read and parse a body of any size (measured
on the old agent: a 10 MB body without a token took its memory from 199 to 402 MB before the
401). :class:`Guard` is the application's first middleware (``FastAPI(middleware=[Middleware(Guard,
...)])``: only Starlette's error middleware, which reads nothing, is outside it) and answers
from the request line and headers alone:

- a path outside ``open_paths`` without the bearer token: ``401`` at once; the body is never
  read (the server stops reading the socket once its 64 KiB buffer is full, and closes the
  connection after the answer);
- ``Content-Length`` above ``max_body`` bytes (or not a number): ``413`` (``400``) at once;
- a body without ``Content-Length`` (chunked) is read up to ``max_body`` bytes and answered
  ``413`` when it goes beyond; within the cap it is handed to the application unchanged;
- a scope that is neither HTTP nor lifespan (a WebSocket: the server runs uvicorn with
  ``ws="none"``, so none should come) is closed unread, never handed to the application.

Errors have the agent's one error shape (``{"error", "message", "holder"}``).
"""

from __future__ import annotations

import hmac
import json
from typing import Any, Awaitable, Callable

#: Largest request body the agent accepts (bytes): its largest request is an ``up`` with a
#: few short fields (< 1 KiB); 1 MiB leaves room and bounds what a client can make it hold.
MAX_BODY_BYTES = 1 << 20

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


def token_ok(header: str | None, token: str | None) -> bool:
    """True if ``header`` (an ``Authorization`` value) carries ``Bearer <token>``
    (constant-time compare); always True when ``token`` is None (auth disabled)."""
    if token is None:
        return True
    scheme, _, cred = (header or "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(cred.strip().encode(), token.encode())


async def _answer(send: Send, status: int, code: str, message: str, headers: dict[str, str] | None = None) -> None:
    body = json.dumps({"error": code, "message": message, "holder": None}).encode()
    hs = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
          (b"connection", b"close")]
    hs += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": hs})
    await send({"type": "http.response.body", "body": body})


class Guard:
    """ASGI middleware: see the module doc. ``token``: the bearer token (None: no auth);
    ``open_paths``: paths answered without it; ``max_body``: the body cap in bytes."""

    def __init__(self, app, token: str | None, open_paths: set[str] | frozenset[str],
                 max_body: int = MAX_BODY_BYTES) -> None:
        self.app, self.token, self.open_paths, self.max_body = app, token, frozenset(open_paths), max_body

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            return await self.app(scope, receive, send)
        if scope["type"] != "http":  # a WebSocket (uvicorn runs with ws="none": never): refused unread
            return await send({"type": "websocket.close", "code": 1008})
        headers: dict[bytes, bytes] = {}
        for k, v in scope.get("headers", []):
            headers.setdefault(k.lower(), v)
        if scope.get("path") not in self.open_paths and not token_ok(
                headers.get(b"authorization", b"").decode("latin-1"), self.token):
            return await _answer(send, 401, "unauthorized",
                                 "missing or wrong bearer token (Authorization: Bearer <token>)",
                                 {"WWW-Authenticate": "Bearer"})
        cl = headers.get(b"content-length")
        if cl is not None:
            if not cl.isdigit() or len(cl) > 18:
                return await _answer(send, 400, "bad_request", "Content-Length is not a number of bytes")
            if int(cl) > self.max_body:
                return await _answer(send, 413, "too_large",
                                     f"request body of {int(cl)} bytes; the agent accepts at most {self.max_body}")
            return await self.app(scope, receive, send)
        if headers.get(b"transfer-encoding") is None:
            return await self.app(scope, receive, send)
        # chunked: read it here, at most max_body bytes, then replay it
        chunks, size = [], 0
        while True:
            msg = await receive()
            if msg["type"] != "http.request":
                return  # the client went away
            size += len(msg.get("body", b""))
            if size > self.max_body:
                return await _answer(send, 413, "too_large", f"request body over {self.max_body} bytes")
            chunks.append(msg.get("body", b""))
            if not msg.get("more_body"):
                break
        body = b"".join(chunks)
        sent = False

        async def replay() -> dict[str, Any]:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)
