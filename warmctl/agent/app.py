"""The agent's REST API (FastAPI): :func:`create_app`.

Everything under ``/v1`` and ``/metrics`` needs ``Authorization: Bearer <token>`` (401
otherwise, answered before any body byte is read: :mod:`warmctl.agent.guard`); ``/healthz``,
``/readyz`` and ``/openapi.json`` do not (see docs/operations.md); request bodies are capped at
1 MiB (413). ``/docs`` and ``/redoc`` are not served (they load scripts from a public CDN).
Errors have one shape, :class:`ErrorBody`
(``{"error": code, "message": text, "holder": job id or null}``); request validation errors
are FastAPI's 422. Long operations answer ``202`` with the :class:`Job` (and a ``Location``
header); follow it with ``GET /v1/jobs/{id}`` or ``GET /v1/jobs/{id}/events`` (SSE).

Engine phases (``EngineView.phase``), the state machine a scheduler watches::

    down --up--> pending --> restoring --> health --> canary --> serving
                        \\--> starting (cold path) -----------/
    serving --down--> stopping --> down       any --error--> failed --> down
    serving --(engine or gate died)--> dead --down--> down
"""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager
from typing import Any

from fastapi import Depends, FastAPI
from starlette.middleware import Middleware

import warmctl
from warmctl.records.config import Settings
from warmctl.records.contract import UpResult

from .deps import strict_query
from .errors import install_error_handlers
from .guard import Guard
from .routes import ROUTERS
from .service import AgentState

#: answered without a token: the probes (a kubelet/systemd/load balancer has no token) and
#: the API description (public: docs/openapi.json in the repository)
OPEN_PATHS = frozenset({"/healthz", "/readyz", "/openapi.json"})


@asynccontextmanager
async def _lifespan(app: FastAPI):
    """Start-up (with ``app.state.run_startup``): load jobs, recover engines, start the
    restart supervisor; shut-down: stop the supervisor."""
    agent: AgentState = app.state.agent
    if app.state.run_startup:
        await asyncio.to_thread(agent.start)
        agent.supervisor.start()
    yield
    agent.supervisor.stop()


def create_app(settings: Settings, token: str | None, *, tls: bool = False, run_startup: bool = True) -> FastAPI:
    """The agent's ASGI app over ``settings``; its :class:`~.service.AgentState` is ``app.state.agent``.

    ``token``: the bearer token every ``/v1`` request must carry; ``None`` disables auth
    (only for generating the OpenAPI document). With ``run_startup`` the app's lifespan loads
    jobs and recovers engines (:meth:`AgentState.start`) and starts the restart supervisor
    before it serves.
    """
    app = FastAPI(
        dependencies=[Depends(strict_query)],
        # first of the app's own middleware: nothing of a request is read before its checks
        middleware=[Middleware(Guard, token=token, open_paths=OPEN_PATHS)],
        title="warmctl agent",
        version=warmctl.__version__,
        description=(__doc__ or "").split("\n\n", 1)[1] if __doc__ else "",
        lifespan=_lifespan,
        docs_url=None,  # /docs and /redoc load scripts from a public CDN fleet nodes cannot reach
        redoc_url=None,
    )
    app.state.agent = AgentState(settings, token, tls)
    app.state.run_startup = run_startup
    install_error_handlers(app)
    for router in ROUTERS:
        app.include_router(router)
    _document_up_result(app)
    return app


def _document_up_result(app: FastAPI) -> None:
    """Add ``UpResult`` (an ``up`` job's ``result``, :class:`warmctl.records.contract.UpResult` as
    :meth:`~warmctl.records.contract.UpResult.to_json` writes it) and the models it refers to to the
    OpenAPI document's schemas: a job's ``result`` is typed by its kind, so no route names it.
    (FastAPI's way of extending the document: replace ``app.openapi``, cache in ``openapi_schema``.)"""
    from pydantic.json_schema import models_json_schema

    generate = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            doc = generate()
            _, defs = models_json_schema([(UpResult, "serialization")], ref_template="#/components/schemas/{model}")
            schemas = doc.setdefault("components", {}).setdefault("schemas", {})
            for k, v in defs.get("$defs", {}).items():
                schemas.setdefault(k, v)
        return app.openapi_schema  # type: ignore[return-value]

    app.openapi = openapi  # type: ignore[method-assign]
