"""NDJSON responses with Ollama's rules: errors before the first line are plain JSON errors with their status;
after it, a final ``{"error": ...}`` line on a 200 stream. ``stream: false`` returns only the last object."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from typing import Any

from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool

from daemon.errors import error_response
from registry.errors import CorralError

log = logging.getLogger(__name__)

NDJSON = "application/x-ndjson"


def _line(obj: dict[str, Any]) -> bytes:
    return (json.dumps(obj, separators=(",", ":"), ensure_ascii=False) + "\n").encode()


def _next(it: Iterator[dict[str, Any]]) -> dict[str, Any] | None:
    return next(it, None)


async def progress_response(it: Iterator[dict[str, Any]], *, stream: bool) -> Response:
    """Serve a blocking progress iterator (run in a thread) as NDJSON or as its last object."""
    if not stream:
        last: dict[str, Any] | None = None
        try:
            while (item := await run_in_threadpool(_next, it)) is not None:
                last = item
        except CorralError as exc:
            return error_response(exc)
        return JSONResponse(last or {})

    try:
        first = await run_in_threadpool(_next, it)
    except CorralError as exc:
        return error_response(exc)

    async def body() -> Any:
        if first is None:
            return
        yield _line(first)
        try:
            while (item := await run_in_threadpool(_next, it)) is not None:
                yield _line(item)
        except CorralError as exc:
            yield _line({"error": str(exc)})
        except Exception as exc:  # the stream has started: report, never crash the daemon
            log.exception("stream failed: %s", exc)
            yield _line({"error": f"internal error: {exc}"})

    return StreamingResponse(body(), media_type=NDJSON)
