"""The one place domain errors become HTTP responses (Ollama's ``{"error": "..."}`` bodies), and where every 4xx
answer is logged with its reason (:class:`RefusalLog`), whichever API's shape it has and whoever made it."""

from __future__ import annotations

import http
import json
import logging
import time
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from daemon import logs
from daemon.api.bodies import BodyTooLarge
from daemon.api.observe import endpoint_of
from errors import (
    CorralError,
    InsufficientSpace,
    InvalidRequest,
    NotFound,
    RegistryError,
    RequestCanceled,
    StoreError,
    StoreLocked,
)

log = logging.getLogger(__name__)

# Most specific first; the first isinstance match wins. A type whose class body sets ``status`` (the runners' and
# the scheduler's errors, see errors/__init__.py) has it from there and does not reach the table.
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

#: Where an API's own error shape answers a type with another status than Ollama's routes do, before anything else
#: decides: Anthropic's API refuses an overfull body with 413 ``request_too_large`` (Ollama's and OpenAI's: 400).
SHAPE_STATUS: dict[str, list[tuple[type[BaseException], int]]] = {
    "anthropic": [(BodyTooLarge, 413)],
}


def status_of(kind: type[BaseException], *, shape: str = "ollama") -> int:
    """The HTTP status of an error type in an API's ``shape``: the shape's own, else the type's ``status``, else
    the table's."""
    for cls, code in SHAPE_STATUS.get(shape, ()):
        if issubclass(kind, cls):
            return code
    own = getattr(kind, "status", None) if issubclass(kind, CorralError) else None
    if isinstance(own, int):
        return own
    for cls, code in STATUS_TABLE:
        if issubclass(kind, cls):
            return code
    return 500


def status_for(exc: BaseException, *, shape: str = "ollama") -> int:
    """The HTTP status of an error: the one it was constructed with (an error that came over the wire with its
    status), else its type's (:func:`status_of`). A shape's own status for the type wins over both."""
    if isinstance(exc, CorralError) and exc.status is not None and not _shaped(type(exc), shape):
        return exc.status
    return status_of(type(exc), shape=shape)


def _shaped(kind: type[BaseException], shape: str) -> bool:
    return any(issubclass(kind, cls) for cls, _ in SHAPE_STATUS.get(shape, ()))


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
            return PlainTextResponse(UNKNOWN_URL, status_code=404)
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


# -- 4xx answers in the log -----------------------------------------------------------------------------------
REFUSAL_INTERVAL = 60.0  # seconds: the same refusal (route, status, reason) is logged at most once per interval
REASON_CHARS = 300  # of a reason logged, unless CORRAL_LOG_PROMPTS is set (then the log's own bound, 8 KiB)
MAX_BODY = 8 * 1024  # bytes of an error body read for its reason
MAX_WINDOWS = 1024  # refusals tracked at once; past that, one more is logged untracked
UNKNOWN_URL = "404 page not found"  # Ollama's answer to a URL it has no route for (any such URL: one refusal)


class RefusalLog:
    """ASGI middleware: every 4xx answer is logged once at INFO with its method, path, status and reason, so that
    a user whose app gets 400s sees why without capturing traffic. The reason is read from the answer's body in
    whichever shape it has (Ollama's ``{"error": "..."}``, OpenAI's and Anthropic's ``{"error": {"message"}}``,
    plain text), so refusals made anywhere (routes, validation, the API key gate, the Host/Origin guard, unknown
    URLs) are logged alike. 499 (the client left) is logged where it happens, not here.

    Rate-limited: the same refusal (method, route, status, reason) is logged at most once per ``interval``; the
    number held back is said when the window ends (on the next refusal). Unknown URLs count as one route. Reasons
    are corral's own words, never the prompt; they are cut to ``REASON_CHARS`` unless CORRAL_LOG_PROMPTS is set."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        log_prompts: bool = False,
        interval: float = REFUSAL_INTERVAL,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.app = app
        self.log_prompts = log_prompts
        self.interval = interval
        self.clock = clock
        # (method, route, status, reason) -> [window start, refusals held back, a path held back]
        self._windows: dict[tuple[str, str, int, str], list[Any]] = {}
        self._swept = clock()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 0
        body = bytearray()
        said = False

        async def watch(message: Message) -> None:
            nonlocal status, said
            if message["type"] == "http.response.start":
                status = int(message["status"])
            elif message["type"] == "http.response.body" and _refusal(status) and not said:
                body.extend(message.get("body", b"")[: MAX_BODY - len(body)])
                if not message.get("more_body", False):
                    said = True
                    self.refused(scope, status, bytes(body))
            await send(message)

        try:
            await self.app(scope, receive, watch)
        finally:
            if _refusal(status) and not said:  # the answer did not end (the client left, or an error)
                self.refused(scope, status, bytes(body))

    def refused(self, scope: Scope, status: int, body: bytes) -> None:
        method, path = str(scope.get("method", "")), str(scope.get("path", ""))
        if method == "HEAD" and status == 404:
            return  # a probe ("is this blob here?", before every `corral create` upload), answered, not refused
        if status == 426:
            return  # a transport negotiation (Codex asks for a WebSocket first), answered, not refused
        reason = reason_of(status, body, scope)
        if not self.log_prompts and len(reason) > REASON_CHARS:
            reason = reason[:REASON_CHARS] + f"... ({len(reason) - REASON_CHARS} more characters)"
        now = self.clock()
        if now - self._swept >= 1.0:
            self._sweep(now)
        route = "(unknown URL)" if reason == UNKNOWN_URL else endpoint_of(path)
        key = (method, route, status, reason)
        window = self._windows.get(key)
        if window is not None:
            if now - window[0] < self.interval:
                window[1] += 1
                window[2] = path
                return
            del self._windows[key]
            if window[1]:
                self._held(key, window, now)
        self._say(method, path, status, reason)
        if len(self._windows) < MAX_WINDOWS:
            self._windows[key] = [now, 0, path]

    def _sweep(self, now: float) -> None:
        """Say how many refusals were held back in the windows that have ended."""
        self._swept = now
        for key, window in list(self._windows.items()):
            if now - window[0] >= self.interval:
                del self._windows[key]
                if window[1]:
                    self._held(key, window, now)

    @staticmethod
    def _held(key: tuple[str, str, int, str], window: list[Any], now: float) -> None:
        method, _, status, reason = key
        log.info(
            "request refused method=%s path=%s status=%d reason=%s: %d more times in the last %ds",
            logs.quote(method),
            logs.quote(window[2]),
            status,
            logs.quote(reason),
            window[1],
            round(now - window[0]),
        )

    @staticmethod
    def _say(method: str, path: str, status: int, reason: str) -> None:
        log.info(
            "request refused method=%s path=%s status=%d reason=%s",
            logs.quote(method),
            logs.quote(path),
            status,
            logs.quote(reason),
        )


def _refusal(status: int) -> bool:
    return 400 <= status < 500 and status != 499


def reason_of(status: int, body: bytes, scope: Scope) -> str:
    """Why a 4xx answer was given, from its body in any API's shape."""
    text = body.decode("utf-8", "replace").strip()
    try:
        data = json.loads(text) if text[:1] == "{" else None
    except ValueError:
        data = None
    if isinstance(data, dict):
        error = data.get("error", data.get("detail"))
        if isinstance(error, dict):
            error = error.get("message", error)
        if error is not None:
            text = error if isinstance(error, str) else json.dumps(error)
    if text:
        return text
    if status == 403:  # the Host/Origin guard answers with no body (as Ollama does)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        return (
            f"Host {headers.get('host', '')!r} or Origin {headers.get('origin', '(none)')!r} is not allowed "
            "(a daemon on a loopback address answers only local Host names; CORRAL_ORIGINS allows more origins)"
        )
    try:
        return http.HTTPStatus(status).phrase
    except ValueError:
        return f"status {status}"
