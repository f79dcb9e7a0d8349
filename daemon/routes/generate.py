"""``POST /api/generate`` and ``POST /api/chat``: prompts in, tokens streamed out as NDJSON."""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import secrets
import string
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool

from daemon import prompt as prompts
from daemon.bodies import read_model
from daemon.errors import error_response
from daemon.inference import Inference, ModelContext, keep_alive_value, now_rfc3339
from daemon.observe import note
from daemon.runners.base import Done, GenerateRequest, RunnerCrashed, SampleParams, Token
from daemon.scheduler import Lease
from daemon.schemas import ChatMessage, ChatRequestBody, GenerateRequestBody, InferenceRequest
from registry.errors import CorralError, InvalidRequest, ModelNotFound

log = logging.getLogger(__name__)
router = APIRouter()
NDJSON = "application/x-ndjson"


def inference(request: Request) -> Inference:
    return request.app.state.inference


def _line(obj: dict[str, Any]) -> bytes:
    return (json.dumps(obj, separators=(",", ":"), ensure_ascii=False) + "\n").encode()


async def respond(chunks: AsyncIterator[dict[str, Any]], *, stream: bool, text_key: str) -> Response:
    """Stream NDJSON (errors before the first line are plain JSON errors) or aggregate into one object."""
    if not stream:
        parts: list[str] = []
        thinking: list[str] = []
        tool_calls: list[Any] = []
        logprobs: list[Any] = []
        last: dict[str, Any] = {}
        try:
            async for chunk in chunks:
                last = chunk
                logprobs += chunk.get("logprobs") or []
                holder = chunk.get("message", chunk) if text_key == "message" else chunk
                parts.append(holder.get("content" if text_key == "message" else "response", ""))
                if holder.get("thinking"):
                    thinking.append(holder["thinking"])
                tool_calls += holder.get("tool_calls") or []
        except CorralError as exc:
            return error_response(exc)
        final = dict(last)
        if logprobs:
            final["logprobs"] = logprobs
        if text_key == "message":
            msg: dict[str, Any] = {"role": "assistant", "content": "".join(parts)}
            if thinking:
                msg["thinking"] = "".join(thinking)
            if tool_calls:
                msg["tool_calls"] = tool_calls
            final["message"] = msg
        else:
            final["response"] = "".join(parts)
            if thinking:
                final["thinking"] = "".join(thinking)
        return JSONResponse(final)

    it = chunks.__aiter__()
    try:
        first = await it.__anext__()
    except StopAsyncIteration:
        return JSONResponse({})
    except CorralError as exc:
        return error_response(exc)

    async def body() -> AsyncIterator[bytes]:
        yield _line(first)
        try:
            async for chunk in it:
                yield _line(chunk)
        except CorralError as exc:
            yield _line({"error": str(exc)})
        except Exception as exc:  # the stream has started; never crash the daemon
            log.exception("generation failed: %s", exc)
            yield _line({"error": f"internal error: {exc}"})
        finally:
            await it.aclose()  # type: ignore[attr-defined]

    return StreamingResponse(body(), media_type=NDJSON)


def _check_common(req: InferenceRequest) -> None:
    if req.top_logprobs < 0 or req.top_logprobs > 20:
        raise InvalidRequest("top_logprobs must be between 0 and 20")


def _check_think(ctx: ModelContext, think: Any) -> None:
    if think in (None, False, "false"):
        return
    if isinstance(think, str) and think not in ("true", "low", "medium", "high", "max"):
        raise InvalidRequest(f'invalid think value: "{think}" (must be true, false, "low", "medium", "high" or "max")')
    if "thinking" not in ctx.capabilities:
        raise InvalidRequest(f'"{ctx.raw}" does not support thinking')


def _check_images(ctx: ModelContext, images: list[str] | None) -> None:
    if images and "vision" not in ctx.capabilities:
        raise InvalidRequest(
            f'"{ctx.raw}" does not support images: it has no vision projector; remove "images" or use a vision model'
        )


def _metrics(done: Done, started: float, lease: Lease) -> dict[str, Any]:
    note(
        model=lease.ref.name,
        prompt_eval_count=done.prompt_eval_count,
        prompt_cached=done.prompt_cached,
        eval_count=done.eval_count,
        eval_duration=done.eval_duration,
        ttft=lease.load_duration + done.prompt_eval_duration / 1e9,
    )
    return {
        "total_duration": int((time.monotonic() - started) * 1e9),
        "load_duration": int(lease.load_duration * 1e9),
        "prompt_eval_count": done.prompt_eval_count,
        "prompt_eval_duration": done.prompt_eval_duration,
        "eval_count": done.eval_count,
        "eval_duration": done.eval_duration,
        "_prompt_cached": done.prompt_cached,  # for /v1's usage; removed before Ollama's wire
    }


async def _stream_tokens(lease: Lease, greq: GenerateRequest) -> AsyncIterator[Token | Done]:
    """The runner's events, with the lease held until the last one (or until the client leaves). A runner that
    dies by a signal on its first decode, before anything was sent, is loaded again one step safer and the request
    runs again there (daemon/fallback.py): the user sees an answer, not the crash."""
    try:
        while True:
            sent = False
            gen = lease.runner.generate(greq)
            try:
                async for event in gen:
                    sent = True
                    yield event
                return
            except RunnerCrashed as exc:
                if sent or not lease.may_retry(exc):
                    raise
                crash = exc
            finally:
                await gen.aclose()  # type: ignore[attr-defined]
            await lease.retry_after_crash(crash)
    finally:
        lease.release()


async def _load_only(
    inf: Inference,
    ctx: ModelContext,
    keep_alive: float | None,
    opts: dict[str, Any],
) -> None:
    lease = await inf.acquire(ctx, inf.load_spec(ctx, opts), keep_alive)
    lease.release()


def _model_name_or_error(raw: str, *, empty_is_404: bool) -> None:
    if not raw:
        if empty_is_404:
            raise ModelNotFound("")
        raise InvalidRequest("model is required")


async def run_generate(
    inf: Inference,
    req: GenerateRequestBody,
    started: float,
) -> tuple[dict[str, Any] | None, AsyncIterator[dict[str, Any]] | None]:
    """Check ``req`` and start it: ``(final, None)`` for a load or unload, else ``(None, chunks)`` (Ollama's
    generate objects, the last with the metrics). Errors before the first chunk raise."""
    note(model=req.model_name)
    _check_common(req)
    _model_name_or_error(req.model_name, empty_is_404=True)
    ctx = await run_in_threadpool(inf.model, req.model_name)
    keep_alive = keep_alive_value(req.keep_alive)
    base = {"model": req.model_name}

    if req.prompt == "" and not req.suffix and keep_alive == 0 and req.keep_alive is not None:
        await inf.scheduler.stop(ctx.ref.key)
        return {**base, "created_at": now_rfc3339(), "response": "", "done": True, "done_reason": "unload"}, None
    if req.raw and (req.template or req.system or req.context):
        raise InvalidRequest("raw mode does not support template, system, or context")
    if "completion" not in ctx.capabilities:
        raise InvalidRequest(f'"{req.model_name}" does not support generate')
    if req.suffix and "insert" not in ctx.capabilities:
        raise InvalidRequest(f"{ctx.name} does not support insert")
    _check_think(ctx, req.think)
    _check_images(ctx, req.images)
    opts = inf.options(ctx, req.options)
    params = _with_logprobs(inf.sample_params(opts, req.format), req)

    if req.prompt == "" and not req.suffix:
        await _load_only(inf, ctx, keep_alive, opts)
        return {**base, "created_at": now_rfc3339(), "response": "", "done": True, "done_reason": "load"}, None

    if req.raw:
        text = req.prompt
    else:
        system = req.system if req.system is not None else ctx.system
        history = [] if req.context else ctx.messages
        text = await prompts.offload(  # off the event loop, bounded in time and memory (daemon/prompt.py)
            prompts.render_generate,
            req.template if req.template else ctx.template,
            None if req.template else ctx.chat_template,
            prompt=req.prompt,
            system=system,
            suffix=req.suffix or None,
            messages_history=history,
        )
    if inf.settings.log_prompts:
        note(prompt=text)
    greq = GenerateRequest(
        prompt=text, params=params, context=tuple(req.context or ()), shift=req.shift, truncate=req.truncate
    )
    lease = await inf.acquire(ctx, inf.load_spec(ctx, opts), keep_alive)

    async def chunks() -> AsyncIterator[dict[str, Any]]:
        async for event in _stream_tokens(lease, greq):
            if isinstance(event, Token):
                chunk = {**base, "created_at": now_rfc3339(), "response": event.text, "done": False}
                if event.logprobs is not None:
                    chunk["logprobs"] = [event.logprobs]
                yield chunk
            else:
                final = {
                    **base,
                    "created_at": now_rfc3339(),
                    "response": "",
                    "done": True,
                    "done_reason": event.done_reason,
                }
                if not req.raw:
                    final["context"] = list(event.context)
                final.update(_metrics(event, started, lease))
                yield final

    return None, chunks()


def _with_logprobs(params: SampleParams, req: InferenceRequest) -> SampleParams:
    return dataclasses.replace(params, logprobs=req.top_logprobs) if req.logprobs else params


@router.post("/api/generate")
async def generate(request: Request) -> Response:
    started = time.monotonic()
    req = await read_model(request, GenerateRequestBody)
    final, chunks = await run_generate(inference(request), req, started)
    if final is not None:
        return JSONResponse(final)
    assert chunks is not None
    return await respond(_ollama_wire(chunks), stream=req.stream, text_key="response")


# -- chat ---------------------------------------------------------------------------------------------------------
def message_dict(m: ChatMessage) -> dict[str, Any]:
    out: dict[str, Any] = {"role": m.role.lower(), "content": m.content}
    if m.thinking:
        out["thinking"] = m.thinking
    if m.images:
        out["images"] = m.images
    if m.tool_calls:
        out["tool_calls"] = [
            {
                "function": {
                    "name": c.function.name,
                    "arguments": c.function.arguments,
                    **({"index": c.function.index} if c.function.index is not None else {}),
                }
            }
            for c in m.tool_calls
        ]
    if m.tool_name:
        out["tool_name"] = m.tool_name
    if m.tool_call_id:
        out["tool_call_id"] = m.tool_call_id
    return out


def build_messages(ctx: ModelContext, request_messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    msgs: list[dict[str, Any]] = [dict(m) for m in ctx.messages] + request_messages
    if ctx.system and (not request_messages or request_messages[0]["role"] != "system"):
        msgs.insert(0, {"role": "system", "content": ctx.system})
    return msgs


TRUNCATE_SECONDS = 30.0  # the most fitting one chat into its context may take


async def render_chat(
    lease: Lease,
    ctx: ModelContext,
    msgs: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    num_ctx: int,
    truncate: bool,
    think: Any,
) -> str:
    """Render, dropping the oldest non-system messages until the prompt fits num_ctx (the last always stays; with
    none left to drop, the shortest prompt is used). How many to drop is found by binary search, so a long chat
    takes O(log n) renders and tokenizations rather than n, each render in a worker thread (prompts.offload); the
    prompt is the one dropping them one at a time gives, as the prompt never grows when a message is dropped."""
    flag = think if isinstance(think, bool) else None

    async def render(kept: list[dict[str, Any]]) -> str:
        return await prompts.offload(
            prompts.render_messages, ctx.template, ctx.chat_template, kept, tools=tools, think=flag
        )

    text = await render(msgs)
    if not truncate:
        return text
    droppable = [i for i, m in enumerate(msgs[:-1]) if m["role"] != "system"]
    if not droppable or len(await lease.runner.tokenize(text)) <= num_ctx:
        return text
    deadline = time.monotonic() + TRUNCATE_SECONDS

    def without(k: int) -> list[dict[str, Any]]:
        gone = set(droppable[:k])
        return [m for i, m in enumerate(msgs) if i not in gone]

    lo, hi = 1, len(droppable)  # the fewest drops that fit lie in [lo, hi] (hi: all of them, fitting or not)
    fitting: tuple[int, str] | None = None
    while lo < hi:
        if time.monotonic() > deadline:
            raise InvalidRequest(
                f"fitting {len(msgs)} messages into the context (num_ctx {num_ctx}) took longer "
                f"than {TRUNCATE_SECONDS:g}s; send fewer or shorter messages"
            )
        mid = (lo + hi) // 2
        text = await render(without(mid))
        if len(await lease.runner.tokenize(text)) <= num_ctx:
            hi, fitting = mid, (mid, text)
        else:
            lo = mid + 1
    return fitting[1] if fitting is not None and fitting[0] == lo else await render(without(lo))


_TOOL_TAG = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


def parse_tool_calls(text: str) -> tuple[str, list[dict[str, Any]]]:
    """Find tool calls in model output: <tool_call>{json}</tool_call> blocks, or output that is only JSON."""
    candidates = [m.group(1) for m in _TOOL_TAG.finditer(text)]
    remainder = _TOOL_TAG.sub("", text).strip() if candidates else text
    if not candidates:
        stripped = text.strip()
        for prefix in ("[TOOL_CALLS]", "<|python_tag|>", "```json", "```"):
            if stripped.startswith(prefix):
                stripped = stripped[len(prefix) :].strip().removesuffix("```").strip()
        if stripped.startswith(("{", "[")):
            candidates, remainder = [stripped], ""
    calls: list[dict[str, Any]] = []
    for cand in candidates:
        try:
            value = json.loads(cand)
        except ValueError:
            return text, []
        for item in value if isinstance(value, list) else [value]:
            if not isinstance(item, dict):
                return text, []
            fn: dict[str, Any] = item["function"] if isinstance(item.get("function"), dict) else item
            name = fn.get("name")
            args = fn.get("arguments", fn.get("parameters", {}))
            if isinstance(args, str):
                try:
                    args = json.loads(args)
                except ValueError:
                    return text, []
            if not isinstance(name, str) or not isinstance(args, dict):
                return text, []
            calls.append(
                {
                    "id": "call_" + "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8)),
                    "function": {"index": len(calls), "name": name, "arguments": args},
                }
            )
    return remainder, calls


async def run_chat(
    inf: Inference,
    req: ChatRequestBody,
    started: float,
    *,
    count_prompt: bool = False,
) -> tuple[dict[str, Any] | None, AsyncIterator[dict[str, Any]] | None]:
    """Check ``req`` and start it: ``(final, None)`` for a load or unload, else ``(None, chunks)`` (Ollama's
    chat objects, the last with the metrics). Errors before the first chunk raise. ``count_prompt``: tokenize the
    prompt first and put its length on the first chunk as ``_prompt_eval_count`` (for a stream that must say it
    before the end, as Anthropic's message_start does)."""
    note(model=req.model_name)
    _check_common(req)
    _model_name_or_error(req.model_name, empty_is_404=False)
    ctx = await run_in_threadpool(inf.model, req.model_name)
    keep_alive = keep_alive_value(req.keep_alive)
    base = {"model": req.model_name}
    empty_message = {"role": "assistant", "content": ""}

    if not req.messages and keep_alive == 0 and req.keep_alive is not None:
        await inf.scheduler.stop(ctx.ref.key)
        return {
            **base,
            "created_at": now_rfc3339(),
            "message": empty_message,
            "done": True,
            "done_reason": "unload",
        }, None
    if "completion" not in ctx.capabilities:
        raise InvalidRequest(f'"{req.model_name}" does not support chat')
    if req.tools and "tools" not in ctx.capabilities:
        raise InvalidRequest(f"{ctx.name} does not support tools")
    _check_think(ctx, req.think)
    request_messages = [message_dict(m) for m in req.messages]
    _check_images(ctx, [img for m in request_messages for img in m.get("images", [])])
    opts = inf.options(ctx, req.options)
    params = _with_logprobs(inf.sample_params(opts, req.format), req)
    spec = inf.load_spec(ctx, opts)

    if not req.messages:
        await _load_only(inf, ctx, keep_alive, opts)
        return {
            **base,
            "created_at": now_rfc3339(),
            "message": empty_message,
            "done": True,
            "done_reason": "load",
        }, None

    lease = await inf.acquire(ctx, spec, keep_alive)
    try:
        text = await render_chat(
            lease, ctx, build_messages(ctx, request_messages), req.tools, spec.num_ctx, req.truncate, req.think
        )
        prompt_count = len(await lease.runner.tokenize(text)) if count_prompt else None
    except BaseException:
        lease.release()
        raise
    if inf.settings.log_prompts:
        note(prompt=text)
    greq = GenerateRequest(prompt=text, params=params, shift=req.shift, truncate=req.truncate)
    buffer_for_tools = bool(req.tools)

    untold = [prompt_count] if prompt_count is not None else []

    def tell(chunk: dict[str, Any]) -> dict[str, Any]:
        if untold:  # the first chunk says the prompt's length: for /v1/messages; removed before Ollama's wire
            chunk["_prompt_eval_count"] = untold.pop()
        return chunk

    async def chunks() -> AsyncIterator[dict[str, Any]]:
        held: list[str] = []
        held_logprobs: list[dict[str, Any]] = []
        async for event in _stream_tokens(lease, greq):
            if isinstance(event, Token):
                if buffer_for_tools:
                    held.append(event.text)
                    if event.logprobs is not None:
                        held_logprobs.append(event.logprobs)
                    continue
                chunk = {
                    **base,
                    "created_at": now_rfc3339(),
                    "message": {"role": "assistant", "content": event.text},
                    "done": False,
                }
                if event.logprobs is not None:
                    chunk["logprobs"] = [event.logprobs]
                yield tell(chunk)
                continue
            if buffer_for_tools:
                content, calls = parse_tool_calls("".join(held))
                message: dict[str, Any] = {"role": "assistant", "content": content}
                if calls:
                    message["tool_calls"] = calls
                chunk = {**base, "created_at": now_rfc3339(), "message": message, "done": False}
                if held_logprobs:
                    chunk["logprobs"] = held_logprobs
                yield tell(chunk)
            final = {
                **base,
                "created_at": now_rfc3339(),
                "message": dict(empty_message),
                "done": True,
                "done_reason": event.done_reason,
            }
            final.update(_metrics(event, started, lease))
            if event.stop_sequence is not None:
                final["_stop_sequence"] = event.stop_sequence  # for /v1/messages; removed before Ollama's wire
            yield tell(final)

    return None, chunks()


@router.post("/api/chat")
async def chat(request: Request) -> Response:
    started = time.monotonic()
    req = await read_model(request, ChatRequestBody)
    final, chunks = await run_chat(inference(request), req, started)
    if final is not None:
        return JSONResponse(final)
    assert chunks is not None
    return await respond(_ollama_wire(chunks), stream=req.stream, text_key="message")


async def _ollama_wire(chunks: AsyncIterator[dict[str, Any]]) -> AsyncIterator[dict[str, Any]]:
    try:
        async for chunk in chunks:
            for key in [k for k in chunk if k.startswith("_")]:  # what only the /v1 routes read
                del chunk[key]
            yield chunk
    finally:
        await chunks.aclose()  # type: ignore[attr-defined]
