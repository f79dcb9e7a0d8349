"""``POST /api/generate`` and ``POST /api/chat``: prompts in, tokens streamed out as NDJSON."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse

from daemon.api.bodies import read_model
from daemon.api.errors import error_response
from daemon.api.schemas import ChatMessage, ChatRequestBody, GenerateRequestBody, InferenceRequest
from daemon.api.state import inference
from daemon.api.streaming import NDJSON, LiveStream, ndjson_line
from daemon.chat.types import Content, Message, Thinking, Tool, ToolCall, ToolCalls
from daemon.generation.calls import ChatCall, GenerateCall, options_and_bias, think_value
from daemon.generation.inference import now_rfc3339
from daemon.generation.service import ModelOnly, Run, run_chat, run_generate
from errors import CorralError

log = logging.getLogger(__name__)
router = APIRouter()


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
        yield ndjson_line(first)
        try:
            async for chunk in it:
                yield ndjson_line(chunk)
        except CorralError as exc:
            yield ndjson_line({"error": str(exc)})
        except Exception as exc:  # the stream has started; never crash the daemon
            log.exception("generation failed: %s", exc)
            yield ndjson_line({"error": f"internal error: {exc}"})
        finally:
            await it.aclose()  # type: ignore[attr-defined]

    return LiveStream(body(), media_type=NDJSON)


# -- the bodies as calls of the generation service ----------------------------------------------------------------
def _common(req: InferenceRequest) -> dict[str, Any]:
    options, bias = options_and_bias(req.options)
    return {
        "model": req.model_name,
        "format": req.format,
        "options": options,
        "think": think_value(req.think),
        "keep_alive": req.keep_alive,
        "truncate": req.truncate,
        "shift": req.shift,
        "logprobs": req.logprobs,
        "top_logprobs": req.top_logprobs,
        "logit_bias": bias,
    }


def generate_call(req: GenerateRequestBody) -> GenerateCall:
    return GenerateCall(
        **_common(req),
        prompt=req.prompt,
        suffix=req.suffix,
        system=req.system,
        template=req.template,
        context=tuple(req.context or ()),
        raw=req.raw,
        images=tuple(req.images or ()),
    )


def message_of(m: ChatMessage) -> Message:
    return Message(
        role=m.role.lower(),
        content=m.content,
        thinking=m.thinking or "",
        images=tuple(m.images or ()),
        tool_calls=tuple(
            ToolCall(name=c.function.name, arguments=c.function.arguments, index=c.function.index)
            for c in m.tool_calls or ()
        ),
        tool_name=m.tool_name or "",
        tool_call_id=m.tool_call_id or "",
    )


def chat_call(req: ChatRequestBody) -> ChatCall:
    return ChatCall(
        **_common(req),
        messages=tuple(message_of(m) for m in req.messages),
        tools=tuple(Tool.of(t) for t in req.tools or ()),
    )


def model_only(model: str, done: ModelOnly, *, chat: bool) -> dict[str, Any]:
    """Ollama's answer to a call that only loaded or unloaded the model."""
    out: dict[str, Any] = {"model": model, "created_at": now_rfc3339()}
    if chat:
        out["message"] = {"role": "assistant", "content": ""}
    else:
        out["response"] = ""
    return {**out, "done": True, "done_reason": done.done_reason}


# -- routes -------------------------------------------------------------------------------------------------------
@router.post("/api/generate")
async def generate(request: Request) -> Response:
    started = time.monotonic()
    req = await read_model(request, GenerateRequestBody)
    run = await run_generate(inference(request), generate_call(req), started)
    if isinstance(run, ModelOnly):
        return JSONResponse(model_only(req.model_name, run, chat=False))
    return await respond(ollama_chunks(run, req.model_name, chat=False), stream=req.stream, text_key="response")


@router.post("/api/chat")
async def chat(request: Request) -> Response:
    started = time.monotonic()
    req = await read_model(request, ChatRequestBody)
    run = await run_chat(inference(request), chat_call(req), started)
    if isinstance(run, ModelOnly):
        return JSONResponse(model_only(req.model_name, run, chat=True))
    return await respond(ollama_chunks(run, req.model_name, chat=True), stream=req.stream, text_key="message")


async def ollama_chunks(run: Run, model: str, *, chat: bool) -> AsyncIterator[dict[str, Any]]:
    """Events as Ollama's /api/chat or /api/generate objects: one per piece, the last with ``done`` and metrics."""
    text_key = "content" if chat else "response"

    def chunk(content: str = "", thinking: str = "", calls: tuple[ToolCall, ...] = ()) -> dict[str, Any]:
        holder: dict[str, Any] = {"role": "assistant", "content": content} if chat else {"response": content}
        if thinking:
            holder["thinking"] = thinking
        if calls:
            holder["tool_calls"] = [c.ollama() for c in calls]
        out: dict[str, Any] = {"model": model, "created_at": now_rfc3339()}
        if chat:
            out["message"] = holder
        else:
            out.update(holder)
        out["done"] = False
        return out

    try:
        async for event in run:
            if isinstance(event, Content):
                out = chunk(content=event.text)
                if event.logprobs:
                    out["logprobs"] = list(event.logprobs)
                yield out
            elif isinstance(event, Thinking):
                yield chunk(thinking=event.text)
            elif isinstance(event, ToolCalls):
                yield chunk(calls=event.calls)
            else:
                final = chunk()
                final["done"] = True
                final["done_reason"] = event.done_reason
                if not chat and event.context is not None:
                    final["context"] = list(event.context)
                final.update(event.metrics())
                final.update(event.drafts())  # draft_n, draft_n_accepted: when the request asked for speculation
                if chat:
                    final["message"][text_key] = ""
                yield final
    finally:
        await run.aclose()
