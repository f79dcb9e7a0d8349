"""The one place domain errors become HTTP responses (Ollama's ``{"error": "..."}`` bodies)."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from registry.errors import (
    CorralError,
    InsufficientSpace,
    InvalidRequest,
    NotFound,
    RegistryError,
    StoreError,
    StoreLocked,
)

log = logging.getLogger(__name__)


class RequestCanceled(CorralError):
    def __init__(self) -> None:
        super().__init__("request canceled")


class NotSupported(InvalidRequest):
    """A request asks for something corral does not do (yet), with what to do instead."""


# Most specific first; the first isinstance match wins.
STATUS_TABLE: list[tuple[type[BaseException], int]] = [
    (RequestCanceled, 499),
    (InvalidRequest, 400),
    (NotFound, 404),
    (RegistryError, 502),
    (StoreLocked, 503),
    (InsufficientSpace, 507),
    (StoreError, 500),
    (CorralError, 500),
]


def status_for(exc: BaseException) -> int:
    """The error's own ``status`` (its type's, or the one it was constructed with), else the table's."""
    if isinstance(exc, CorralError) and exc.status is not None:
        return exc.status
    for kind, code in STATUS_TABLE:
        if isinstance(exc, kind):
            return code
    return 500


def error_response(exc: BaseException) -> JSONResponse:
    status = status_for(exc)
    if status >= 500:
        log.error("request failed status=%d error=%s", status, exc)
    return JSONResponse({"error": str(exc)}, status_code=status, headers=error_headers(exc, status))


def error_headers(exc: BaseException, status: int) -> dict[str, str] | None:
    """Headers an error answer carries in every API's shape: ``Retry-After`` on a 503 from a full daemon."""
    retry = getattr(exc, "retry_after", None)
    return {"Retry-After": str(retry)} if isinstance(retry, int) and status == 503 else None


def install(app: FastAPI) -> None:
    @app.exception_handler(CorralError)
    async def _corral(_request: Request, exc: CorralError) -> Response:
        return error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_request: Request, exc: StarletteHTTPException) -> Response:
        if exc.status_code == 404:
            return PlainTextResponse("404 page not found", status_code=404)
        if exc.status_code == 405:
            return PlainTextResponse("405 method not allowed", status_code=405)
        return JSONResponse({"error": str(exc.detail)}, status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def _unexpected(_request: Request, exc: Exception) -> Response:
        if isinstance(exc, ClientDisconnect):  # the client left mid-body (or was cut by the body timeout)
            log.info("client disconnected before its request body was complete")
            return JSONResponse({"error": "request canceled"}, status_code=499)
        log.exception("unexpected error: %s", exc)
        return JSONResponse({"error": f"internal error: {exc}"}, status_code=500)
