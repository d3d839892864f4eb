"""The agent's one error shape (:class:`~.models.ErrorBody`) and the handlers that give it.

A handler raises :class:`ApiError`; :func:`install_error_handlers` answers it, Starlette's
HTTP errors (404, 405 with the ``Allow`` header) and request validation errors (422) with an
``ErrorBody``. ``ERRORS``, ``NOT_FOUND`` and ``CONFLICT`` document them on the routes."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from .jobs import Job
from .models import ErrorBody

#: a route's documented answers besides its 2xx one (FastAPI's ``responses``)
Responses = dict[int | str, dict[str, Any]]

ERRORS: Responses = {401: {"model": ErrorBody, "description": "Missing or wrong bearer token"}}
NOT_FOUND: Responses = {404: {"model": ErrorBody, "description": "No such object"}}
CONFLICT: Responses = {409: {"model": ErrorBody,
                             "description": "Another job holds the engine or port (named in `holder`)"}}


class ApiError(Exception):
    """An error answer: HTTP ``status``, ``code`` and ``message`` (:class:`ErrorBody`), and for
    a conflict the id of the job that holds the engine or port (``holder``)."""

    def __init__(self, status: int, code: str, message: str, holder: str | None = None):
        super().__init__(message)
        self.status, self.code, self.message, self.holder = status, code, message, holder


def error_response(status: int, code: str, message: str, holder: str | None = None,
                   headers: dict | None = None) -> JSONResponse:
    """An :class:`ErrorBody` answer with ``status``."""
    return JSONResponse(ErrorBody(error=code, message=message, holder=holder).model_dump(), status_code=status,
                        headers=headers)


def accepted(job: Job) -> JSONResponse:
    """``202`` with ``job`` and ``Location: /v1/jobs/{id}``: a long operation under way."""
    return JSONResponse(job.model_dump(mode="json"), status_code=202, headers={"Location": f"/v1/jobs/{job.id}"})


async def _api_error(request: Request, e: ApiError) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if e.status == 401 else None
    return error_response(e.status, e.code, e.message, e.holder, headers)


async def _http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
    headers = dict(e.headers or {})
    if e.status_code == 405:  # Starlette lists only the first matching route's methods
        from starlette.routing import Match

        allowed: set[str] = set()
        for route in request.app.routes:
            match, _ = route.matches({**request.scope, "method": "GET"})
            if match != Match.NONE and getattr(route, "methods", None):
                allowed |= set(route.methods) - {"HEAD"}
        headers["Allow"] = ", ".join(sorted(allowed))
    code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code, "http_error")
    return error_response(e.status_code, code, str(e.detail), headers=headers)


async def _invalid(request: Request, e: RequestValidationError) -> JSONResponse:
    msgs = "; ".join(f"{'.'.join(map(str, x['loc']))}: {x['msg']}" for x in e.errors())
    return error_response(422, "unprocessable", msgs)


def install_error_handlers(app: FastAPI) -> None:
    """Answer :class:`ApiError`, Starlette's HTTP errors and validation errors as :class:`ErrorBody`."""
    app.add_exception_handler(ApiError, _api_error)  # type: ignore[arg-type]
    app.add_exception_handler(StarletteHTTPException, _http_error)  # type: ignore[arg-type]
    app.add_exception_handler(RequestValidationError, _invalid)  # type: ignore[arg-type]
