"""The agent's FastAPI dependencies: the app's :class:`~.service.AgentState`
(:func:`get_agent`, :data:`Agent`), the bearer token check every protected route declares
(:func:`require_token`), and the refusal of undeclared query parameters (:func:`strict_query`).

The token is checked twice on purpose, by one function (:func:`warmctl.agent.guard.token_ok`,
a constant-time compare): :class:`~.guard.Guard` answers 401 before any body byte is read,
and :func:`require_token` repeats it per operation so that the OpenAPI document names the
bearer scheme on exactly the protected operations. All three are ``async``: they never wait
for a worker thread (``/healthz`` and ``/readyz`` are answered on the event loop)."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request
from fastapi.routing import APIRoute
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from .errors import ApiError
from .guard import token_ok
from .service import AgentState

bearer = HTTPBearer(auto_error=False, description="The token from the agent's token file")


async def get_agent(request: Request) -> AgentState:
    """The app's :class:`AgentState` (``app.state.agent``, set by :func:`~.app.create_app`)."""
    return request.app.state.agent


Agent = Annotated[AgentState, Depends(get_agent)]


async def require_token(request: Request, creds: HTTPAuthorizationCredentials | None = Depends(bearer)) -> None:
    """Per-operation auth: 401 (:class:`ApiError`) unless ``Authorization: Bearer <token>``
    carries the agent's token (none needed when the app has no token)."""
    if not token_ok(request.headers.get("authorization"), request.app.state.agent.token):
        raise ApiError(401, "unauthorized", "missing or wrong bearer token (Authorization: Bearer <token>)")


Protected = [Depends(require_token)]


async def strict_query(request: Request) -> None:
    """Refuse query parameters the operation does not declare (a typo must not pass silently):
    422 naming them."""
    route = request.scope.get("route")
    if not isinstance(route, APIRoute) or not request.query_params:
        return
    known: set[str] = set()
    pending = [route.dependant]
    while pending:  # the operation's own parameters and its dependencies'
        d = pending.pop()
        known |= {q.alias for q in d.query_params}
        pending += d.dependencies
    unknown = sorted(set(request.query_params) - known)
    if unknown:
        raise ApiError(422, "unprocessable", f"unknown query parameter(s): {', '.join(unknown)[:200]}")
