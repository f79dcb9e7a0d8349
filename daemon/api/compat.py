"""What the OpenAI (``/v1``) and Anthropic (``/v1/messages``) shims share: reading and checking their request
bodies with errors that name the parameter, their error shapes, and server-sent events.

Both shims translate a request into an Ollama chat or generate request and run it through the same cores as
``/api/chat`` and ``/api/generate`` (``daemon/api/routes/generate.py``), so every API gives the same tokens for the
same prompt and options. HTTP statuses come from :func:`daemon.api.errors.status_for`; only the body shape differs.
"""

from __future__ import annotations

import functools
import json
import logging
import re
import secrets
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar, cast

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from daemon.api.bodies import parse_model, read_body
from daemon.api.errors import error_headers, status_for
from daemon.api.schemas import KeepAliveField
from daemon.api.streaming import LiveStream
from daemon.generation.calls import KeepAlive
from daemon.logs import note
from errors import CorralError, InvalidRequest, ModelNotFound
from modelfile.errors import ParameterError
from modelfile.params import RANGES, lora_entries

log = logging.getLogger(__name__)
Handler = Callable[..., Awaitable[Response]]

T = TypeVar("T")


class BadParam(InvalidRequest):
    """A request parameter has the wrong type or value; ``param`` names it (OpenAI's ``param`` field)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


# -- bodies ---------------------------------------------------------------------------------------------------
async def read_json(request: Request) -> dict[str, Any]:
    data = await read_body(request)
    if not isinstance(data, dict):
        raise InvalidRequest(f"request body must be a JSON object, got {type(data).__name__}")
    return data


async def begin(request: Request) -> tuple[float, dict[str, Any], str]:
    """What every OpenAI-style handler starts with: the time it started, its JSON body, and the model it names
    (required; noted for the request's log line)."""
    started = time.monotonic()
    body = await read_json(request)
    model = get(body, "model", "str", required=True)
    note(model=model)
    return started, body, model


def keep_alive_of(body: dict[str, Any]) -> KeepAlive:
    """``keep_alive`` checked as Ollama's bodies check it (a duration string or a number of seconds), with the same
    error; the generation service parses it."""
    return parse_model(KeepAliveField, {"keep_alive": body.get("keep_alive")}).keep_alive


_KINDS: dict[str, tuple[type | tuple[type, ...], str]] = {
    "str": (str, "a string"),
    "int": (int, "an integer"),
    "num": ((int, float), "a number"),
    "bool": (bool, "a boolean"),
    "list": (list, "an array"),
    "dict": (dict, "an object"),
}


def get(
    body: dict[str, Any],
    name: str,
    kind: str,
    *,
    required: bool = False,
    where: str = "",
    lo: float | None = None,
    hi: float | None = None,
) -> Any:
    """``body[name]`` checked against ``kind`` and, for numbers, the range ``lo``..``hi`` (None when absent and
    not required)."""
    value = body.get(name)
    param = f"{where}{name}"
    if value is None:
        if required:
            raise BadParam(param, f"'{param}' is required")
        return None
    types, words = _KINDS[kind]
    if isinstance(value, bool) and kind in ("int", "num"):
        raise BadParam(param, f"'{param}' must be {words}, got a boolean")
    if not isinstance(value, types):
        raise BadParam(param, f"'{param}' must be {words}, got {_json_type(value)}")
    number = cast(float, value)  # an int or a float: checked just above
    if (lo is not None and number < lo) or (hi is not None and number > hi):
        bounds = (
            f"between {lo:g} and {hi:g}"
            if lo is not None and hi is not None
            else f"at least {lo:g}"
            if lo is not None
            else f"at most {hi:g}"
        )
        raise BadParam(param, f"'{param}' must be {bounds}, got {value}")
    return value


def _json_type(value: Any) -> str:
    return {
        str: "a string",
        bool: "a boolean",
        int: "an integer",
        float: "a number",
        list: "an array",
        dict: "an object",
    }.get(type(value), type(value).__name__)


def stops(value: Any, param: str) -> list[str] | None:
    if value is None:
        return None
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and all(isinstance(s, str) for s in value):
        return list(value)
    raise BadParam(param, f"'{param}' must be a string or an array of strings")


#: llama-server's per-request speculation fields (flat keys with a dot, at the top of its /v1 and /completion
#: bodies) and the Ollama-style options they set, with their JSON kind
SPECULATIVE_FIELDS = (
    ("speculative.n_max", "draft_max", "int"),
    ("speculative.n_min", "draft_min", "int"),
    ("speculative.p_min", "draft_p_min", "num"),
)


def speculative_options(body: dict[str, Any]) -> dict[str, Any]:
    """The speculative-decoding options a /v1 body sets outside ``options``: LM Studio's top-level ``draft_model``
    (a model in the store, used as the draft for this request) and llama-server's ``speculative.n_max``,
    ``speculative.n_min`` and ``speculative.p_min`` (as ``draft_max``, ``draft_min``, ``draft_p_min``). Each is
    checked here, with the option's range, so that a bad value is a 400 naming the field the client sent."""
    out: dict[str, Any] = {}
    draft = get(body, "draft_model", "str")
    if draft is not None:
        if not draft.strip():
            raise BadParam(
                "draft_model",
                "'draft_model' must name a model (`corral list` shows them); leave it out for no draft model, "
                'or send "speculative.n_max": 0 to turn speculative decoding off for this request',
            )
        out["draft_model"] = draft
    for name, option, kind in SPECULATIVE_FIELDS:
        lo, hi, _ = RANGES[option]
        value = get(body, name, kind, lo=lo, hi=hi)
        if value is not None:
            out[option] = value
    return out


def lora_option(body: dict[str, Any]) -> dict[str, Any]:
    """llama-server's per-request LoRA scales, ``"lora": [{"id": N, "scale": S}, ...]`` at the top of a /v1 body
    (ids in the model's ADAPTER order), as the option ``lora``; its shape is checked here so that a bad item is a
    400 naming it (``lora[1].scale``). Whether the model has those adapters is checked once it is looked up
    (``daemon.generation.lora``). A ``lora`` inside ``options`` (Ollama's spelling) is replaced by this one."""
    value = body.get("lora")
    if value is None:
        return {}
    try:
        entries = lora_entries(value, "lora")
    except ValueError as exc:
        raise BadParam("lora", str(exc)) from None
    return {"lora": [{"id": ident, "scale": scale} for ident, scale in entries]}


# reasoning_effort (or reasoning.effort) -> Ollama's think, as Ollama's OpenAI layer maps it: OpenAI's scale runs
# past Ollama's at both ends, so it is clamped, not refused
EFFORTS: dict[str, bool | str] = {
    "none": False,
    "minimal": "low",
    "low": "low",
    "medium": "medium",
    "high": "high",
    "max": "max",
    "xhigh": "max",
    "ultra": "max",
}


def think_of(body: dict[str, Any]) -> bool | str | None:
    """``think`` from ``reasoning_effort`` or ``reasoning.effort``; None (the model's default) when absent."""
    reasoning = get(body, "reasoning", "dict")
    where = "reasoning.effort" if reasoning is not None else "reasoning_effort"
    effort = (reasoning or {}).get("effort") if reasoning is not None else body.get("reasoning_effort")
    if effort is None or effort == "":
        return None
    if effort not in EFFORTS:
        raise BadParam(
            where, f"invalid reasoning value {effort!r}: use none, minimal, low, medium, high, xhigh, ultra or max"
        )
    return EFFORTS[effort]


# -- errors ---------------------------------------------------------------------------------------------------
def content_parts(content: Any, where: str) -> str | list[tuple[str, dict[str, Any]]]:
    """A message's content in the OpenAI-style dialects: a string as it is ("" for none), else its parts (objects),
    each with where it stands for error messages."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise BadParam(where, f"'{where}' must be a string or an array of content parts")
    parts = []
    for i, part in enumerate(content):
        here = f"{where}[{i}]"
        if not isinstance(part, dict):
            raise BadParam(here, f"'{here}' must be an object")
        parts.append((here, part))
    return parts


def data_url_image(url: Any, where: str) -> str:
    """The base64 of an image sent as a data URL (``data:image/png;base64,...``)."""
    if not isinstance(url, str) or not url.startswith("data:") or "," not in url:
        raise BadParam(
            where, "images must be base64 data URLs (data:image/png;base64,...); corral never fetches URLs or files"
        )
    return url.split(",", 1)[1]


def openai_error(exc: BaseException) -> JSONResponse:
    status = status_for(exc)
    kind = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error", 503: "server_error"}.get(
        status, "api_error"
    )
    code = "model_not_found" if status == 404 and "model" in str(exc) else None
    param = getattr(exc, "param", None)
    if param is None and isinstance(exc, ParameterError):
        param = exc.name  # an option's value (lora, lora_scale, temperature...) that does not fit
    if param is None and status == 400 and str(exc).startswith("draft model "):
        param = "draft_model"  # the draft model could not be used (not found, another vocabulary...)
    if status >= 500:
        log.error("request failed status=%d error=%s", status, exc)
    return JSONResponse(
        {"error": {"message": str(exc), "type": kind, "param": param, "code": code}},
        status_code=status,
        headers=error_headers(exc, status),
    )


_PROMPT_SIZES = re.compile(r"prompt: (\d+) (?:tokens|positions), context length: (\d+)")


def anthropic_error(exc: BaseException) -> JSONResponse:
    """Anthropic's error body, ``{"type": "error", "error": {"type", "message"}, "request_id"}``, with the error
    types its API gives each status, and its wording where clients act on it: a missing model says ``model: <name>``
    (Claude Code's "model not found"), a prompt longer than the context starts ``prompt is too long`` (Claude
    Code's compaction, which reads the sizes from ``N tokens > M maximum``), an overfull body is 413
    ``request_too_large``."""
    status = status_for(exc, shape="anthropic")
    message = str(exc)
    if isinstance(exc, ModelNotFound) and exc.name:
        message = f"model: {exc.name} (not found here: `corral list` shows the models, `corral pull <name>` gets one)"
    elif status == 400 and ("longer than the context length" in message or "exceeds the context length" in message):
        sizes = _PROMPT_SIZES.search(message)
        said = f"{sizes[1]} tokens > {sizes[2]} maximum: " if sizes else ""
        message = f"prompt is too long: {said}{message}"
    kind = {
        400: "invalid_request_error",
        401: "authentication_error",
        403: "permission_error",
        404: "not_found_error",
        413: "request_too_large",
        429: "rate_limit_error",
        503: "overloaded_error",
        529: "overloaded_error",
    }.get(status) or ("invalid_request_error" if status < 500 else "api_error")
    if status >= 500:
        log.error("request failed status=%d error=%s", status, exc)
    request_id = f"req_{secrets.token_hex(12)}"
    return JSONResponse(
        {"type": "error", "error": {"type": kind, "message": message}, "request_id": request_id},
        status_code=status,
        headers={**(error_headers(exc, status) or {}), "request-id": request_id},
    )


def shaped(shape: Callable[[BaseException], JSONResponse]) -> Callable[[Handler], Handler]:
    """Decorate a route so that a domain error becomes this API's error shape (never Ollama's)."""

    def wrap(handler: Handler) -> Handler:
        @functools.wraps(handler)
        async def route(*args: Any, **kwargs: Any) -> Response:
            try:
                return await handler(*args, **kwargs)
            except CorralError as exc:
                return shape(exc)

        return route

    return wrap


# -- server-sent events ---------------------------------------------------------------------------------------
def sse_data(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


def sse_event(event: str, obj: Any) -> bytes:
    return (
        f"event: {event}\n".encode()
        + b"data: "
        + json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()
        + b"\n\n"
    )


async def guarded(
    frames: AsyncGenerator[bytes, None],
    rest: AsyncIterator[Any],
    error_frame: Callable[[str], bytes],
    tail: bytes = b"",
) -> AsyncIterator[bytes]:
    """An SSE body around ``frames``: an error once the stream has started becomes ``error_frame(message)``
    (the status line is already sent); the runner stream ``rest`` is closed however it ends, so a client that
    leaves stops generation; ``tail`` (OpenAI's ``data: [DONE]``) ends a stream that was not left."""
    try:
        async for frame in frames:
            yield frame
    except CorralError as exc:
        yield error_frame(str(exc))
    except Exception as exc:  # never crash the daemon over one stream
        log.exception("generation failed: %s", exc)
        yield error_frame(f"internal error: {exc}")
    finally:
        await frames.aclose()
        await rest.aclose()  # type: ignore[attr-defined]
    if tail:
        yield tail


def sse_response(body: AsyncIterator[bytes]) -> StreamingResponse:
    return LiveStream(
        body, media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    )
