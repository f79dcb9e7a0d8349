"""Reading JSON request bodies with Ollama's errors, and messages that name the offending field."""

from __future__ import annotations

import json
from typing import Any, TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError

from errors import InvalidRequest

M = TypeVar("M", bound=BaseModel)

MAX_JSON_BODY = 64 * 1024 * 1024


class BodyTooLarge(InvalidRequest):
    """A request body over MAX_JSON_BODY (a 400, as Ollama's routes answer; the Anthropic shape makes it a 413)."""


async def read_body(request: Request, *, allow_empty: bool = False) -> Any:
    """The request's JSON (None for an empty body when allowed), read with a size cap."""
    raw = b""
    async for chunk in request.stream():
        raw += chunk
        if len(raw) > MAX_JSON_BODY:
            raise BodyTooLarge(f"request body is larger than {MAX_JSON_BODY} bytes")
    if not raw.strip():
        if allow_empty:
            return None
        raise InvalidRequest("missing request body")
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidRequest(f"invalid JSON in request body: {exc}") from None


async def read_model(request: Request, model: type[M], *, allow_empty: bool = False) -> M:
    data = await read_body(request, allow_empty=allow_empty)
    if data is None:
        return model()
    return parse_model(model, data)


def parse_model(model: type[M], data: object) -> M:
    if not isinstance(data, dict):
        raise InvalidRequest(f"request body must be a JSON object, got {type(data).__name__}")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise InvalidRequest(describe(exc)) from None


def describe(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors()[:3]:
        loc = ".".join(str(p) for p in err["loc"] if not str(p).startswith("function-")) or "body"
        msg = err["msg"]
        given = err.get("input")
        kind = type(given).__name__ if given is not None else "null"
        parts.append(f'invalid value for field "{loc}": {msg} (got {kind})')
    return "; ".join(parts)
