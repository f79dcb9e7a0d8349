"""NDJSON responses with Ollama's rules: errors before the first line are plain JSON errors with their status;
after it, a final ``{"error": ...}`` line on a 200 stream. ``stream: false`` returns only the last object."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from typing import Any

from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.types import Receive, Scope, Send

from daemon.api.errors import error_response
from errors import CorralError

log = logging.getLogger(__name__)

NDJSON = "application/x-ndjson"


def ndjson_line(obj: dict[str, Any]) -> bytes:
    return (json.dumps(obj, separators=(",", ":"), ensure_ascii=False) + "\n").encode()


class LiveStream(StreamingResponse):
    """A generation streamed as it comes: the headers and then each chunk handed to the server at once, in the
    request's own task. Starlette's StreamingResponse also starts a task group and a task listening for the
    client's disconnect for every response (under uvicorn's h11 server), which a token's first line waits behind;
    here ``daemon.api.disconnect.CancelOnDisconnect`` watches the connection and cancels the handler when the client
    leaves, for streamed and whole answers alike."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        async for chunk in self.body_iterator:
            body = chunk if isinstance(chunk, bytes | memoryview) else chunk.encode(self.charset)
            await send({"type": "http.response.body", "body": body, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


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
        yield ndjson_line(first)
        try:
            while (item := await run_in_threadpool(_next, it)) is not None:
                yield ndjson_line(item)
        except CorralError as exc:
            yield ndjson_line({"error": str(exc)})
        except Exception as exc:  # the stream has started: report, never crash the daemon
            log.exception("stream failed: %s", exc)
            yield ndjson_line({"error": f"internal error: {exc}"})

    return StreamingResponse(body(), media_type=NDJSON)
