"""The Anthropic Messages API: ``POST /v1/messages`` and ``POST /v1/messages/count_tokens``.

A request becomes an Ollama chat request (system blocks joined into a system message, ``tool_use`` blocks into
assistant tool calls, ``tool_result`` blocks into tool messages) and runs through the same core as ``/api/chat``.
Replies use Anthropic's content blocks and stop reasons; streams use its events (message_start,
content_block_start/delta/stop, message_delta, message_stop, ping). ``tool_choice`` "any" or naming a tool forces
the call with a grammar.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from daemon.bodies import parse_model
from daemon.compat import (
    BadParam,
    anthropic_error,
    first_then,
    get,
    guarded,
    read_json,
    shaped,
    sse_event,
    sse_response,
)
from daemon.inference import Inference
from daemon.observe import note
from daemon.routes.generate import build_messages, message_dict, render_chat, run_chat
from daemon.routes.openai import call_schema
from daemon.schemas import ChatRequestBody

router = APIRouter()


def inference(request: Request) -> Inference:
    return request.app.state.inference


# -- request translation --------------------------------------------------------------------------------------
def _blocks_text(value: Any, where: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        parts = []
        for i, b in enumerate(value):
            if not isinstance(b, dict) or b.get("type") != "text" or not isinstance(b.get("text"), str):
                raise BadParam(f"{where}[{i}]", f"'{where}[{i}]' must be a text block")
            parts.append(b["text"])
        return "\n".join(parts)
    raise BadParam(where, f"'{where}' must be a string or an array of text blocks")


def _messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    system = body.get("system")
    if system is not None:
        out.append({"role": "system", "content": _blocks_text(system, "system")})
    raw = get(body, "messages", "list", required=True)
    if not raw:
        raise BadParam("messages", "'messages' must contain at least one message")
    names: dict[str, str] = {}  # tool_use id -> tool name, for the tool_result blocks that answer them
    for i, m in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
            raise BadParam(f"{where}.role", f"'{where}.role' must be user or assistant")
        role, content = m["role"], m.get("content")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise BadParam(f"{where}.content", f"'{where}.content' must be a string or an array of blocks")
        texts: list[str] = []
        images: list[str] = []
        calls: list[dict[str, Any]] = []
        for j, block in enumerate(content):
            bwhere = f"{where}.content[{j}]"
            kind = block.get("type") if isinstance(block, dict) else None
            if kind == "text":
                texts.append(str(block.get("text") or ""))
            elif kind == "image":
                src = block.get("source") or {}
                if src.get("type") != "base64" or not isinstance(src.get("data"), str):
                    raise BadParam(f"{bwhere}.source", "images must be base64 sources; corral never fetches URLs")
                images.append(src["data"])
            elif kind == "tool_use" and role == "assistant":
                if not isinstance(block.get("name"), str):
                    raise BadParam(f"{bwhere}.name", f"'{bwhere}.name' must be a string")
                call_id = str(block.get("id") or "")
                names[call_id] = block["name"]
                calls.append({"id": call_id, "function": {"name": block["name"], "arguments": _input(block, bwhere)}})
            elif kind == "tool_result" and role == "user":
                result = block.get("content")
                text = result if isinstance(result, str) else _blocks_text(result or [], f"{bwhere}.content")
                call_id = str(block.get("tool_use_id") or "")
                tool: dict[str, Any] = {"role": "tool", "content": text, "tool_call_id": call_id}
                if call_id in names:
                    tool["tool_name"] = names[call_id]
                out.append(tool)
            else:
                raise BadParam(f"{bwhere}.type", f"unsupported block type {kind!r} in a {role} message")
        if texts or images or calls:
            msg: dict[str, Any] = {"role": role, "content": "\n".join(texts)}
            if images:
                msg["images"] = images
            if calls:
                msg["tool_calls"] = calls
            out.append(msg)
    return out


def _input(block: dict[str, Any], where: str) -> dict[str, Any]:
    value = block.get("input")
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise BadParam(f"{where}.input", f"'{where}.input' must be an object")
    return value


def _options(body: dict[str, Any]) -> dict[str, Any]:
    opts: dict[str, Any] = dict(get(body, "options", "dict") or {})
    opts["num_predict"] = get(body, "max_tokens", "int", required=True, lo=1)
    for name in ("temperature", "top_p"):
        value = get(body, name, "num", lo=0, hi=1)
        if value is not None:
            opts[name] = value
    top_k = get(body, "top_k", "int", lo=0)
    if top_k is not None:
        opts["top_k"] = top_k
    seqs = get(body, "stop_sequences", "list")
    if seqs is not None:
        if not all(isinstance(s, str) for s in seqs):
            raise BadParam("stop_sequences", "'stop_sequences' must be an array of strings")
        opts["stop"] = list(seqs)
    return opts


def _tools(body: dict[str, Any]) -> tuple[list[dict[str, Any]] | None, Any]:
    tools = get(body, "tools", "list")
    choice = get(body, "tool_choice", "dict") or {"type": "auto"}
    if not tools or choice.get("type") == "none":
        return None, None
    converted: list[dict[str, Any]] = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or not isinstance(t.get("name"), str):
            raise BadParam(f"tools[{i}]", f"'tools[{i}]' must have a name and an input_schema")
        converted.append(
            {
                "type": "function",
                "function": {
                    "name": t["name"],
                    "description": t.get("description") or "",
                    "parameters": t.get("input_schema")
                    if isinstance(t.get("input_schema"), dict)
                    else {"type": "object"},
                },
            }
        )
    kind = choice.get("type")
    if kind == "any":
        return converted, call_schema(converted)
    if kind == "tool":
        chosen = [t for t in converted if t["function"]["name"] == choice.get("name")]
        if not chosen:
            raise BadParam(
                "tool_choice.name", f"tool_choice names {choice.get('name')!r}, which is not among the tools"
            )
        return converted, call_schema(chosen)
    if kind != "auto":
        raise BadParam("tool_choice.type", "'tool_choice.type' must be auto, any, tool or none")
    return converted, None


def _chat_request(body: dict[str, Any], *, stream: bool) -> ChatRequestBody:
    model = get(body, "model", "str", required=True)
    tools, forced = _tools(body)
    return parse_model(
        ChatRequestBody,
        {
            "model": model,
            "messages": _messages(body),
            "options": _options(body),
            "tools": tools,
            "format": forced,
            "stream": stream,
            "keep_alive": body.get("keep_alive"),
        },
    )


# -- response translation -------------------------------------------------------------------------------------
def _stop_reason(final: dict[str, Any], calls: bool) -> tuple[str, str | None]:
    if calls:
        return "tool_use", None
    if final.get("done_reason") == "length":
        return "max_tokens", None
    if final.get("_stop_sequence"):
        return "stop_sequence", str(final["_stop_sequence"])
    return "end_turn", None


def _tool_block(call: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "tool_use",
        "id": call.get("id") or f"toolu_{secrets.token_hex(12)}",
        "name": call["function"]["name"],
        "input": call["function"].get("arguments") or {},
    }


@router.post("/v1/messages")
@shaped(anthropic_error)
async def messages(request: Request) -> Response:
    started = time.monotonic()
    body = await read_json(request)
    note(model=body.get("model") if isinstance(body.get("model"), str) else "")
    stream = bool(get(body, "stream", "bool"))
    req = _chat_request(body, stream=stream)
    _, chunks = await run_chat(inference(request), req, started, count_prompt=stream)
    assert chunks is not None  # messages are never empty here
    first, rest = await first_then(chunks)
    mid = f"msg_{secrets.token_hex(12)}"
    if not stream:
        return JSONResponse(await _whole(first, rest, mid, req.model_name))
    return sse_response(guarded(_events(first, rest, mid, req.model_name), rest, _error_event))


async def _whole(
    first: dict[str, Any] | None, rest: AsyncIterator[dict[str, Any]], mid: str, model: str
) -> dict[str, Any]:
    calls: list[Any] = []
    text, last, chunk = "", first or {}, first
    while chunk is not None:
        msg = chunk.get("message") or {}
        text += msg.get("content") or ""
        calls += msg.get("tool_calls") or []
        last = chunk
        chunk = await anext(rest, None)
    content: list[dict[str, Any]] = [{"type": "text", "text": text}] if text or not calls else []
    content += [_tool_block(c) for c in calls]
    reason, seq = _stop_reason(last, bool(calls))
    return {
        "id": mid,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": reason,
        "stop_sequence": seq,
        "usage": {
            "input_tokens": int(last.get("prompt_eval_count") or 0),
            "output_tokens": int(last.get("eval_count") or 0),
        },
    }


def _error_event(message: str) -> bytes:
    return sse_event("error", {"type": "error", "error": {"type": "api_error", "message": message}})


async def _events(
    first: dict[str, Any] | None, rest: AsyncIterator[dict[str, Any]], mid: str, model: str
) -> AsyncGenerator[bytes, None]:
    yield sse_event(
        "message_start",
        {
            "type": "message_start",
            "message": {
                "id": mid,
                "type": "message",
                "role": "assistant",
                "model": model,
                "content": [],
                "stop_reason": None,
                "stop_sequence": None,
                # the prompt's exact length, known before the first token (Ollama sends an estimate: characters / 4)
                "usage": {"input_tokens": int((first or {}).get("_prompt_eval_count") or 0), "output_tokens": 0},
            },
        },
    )
    yield sse_event("ping", {"type": "ping"})
    index, text_open, any_calls, chunk = 0, False, False, first
    while chunk is not None:
        msg = chunk.get("message") or {}
        if chunk.get("done"):
            if text_open:
                yield sse_event("content_block_stop", {"type": "content_block_stop", "index": index})
            reason, seq = _stop_reason(chunk, any_calls)
            yield sse_event(
                "message_delta",
                {
                    "type": "message_delta",
                    "delta": {"stop_reason": reason, "stop_sequence": seq},
                    "usage": {
                        "input_tokens": int(chunk.get("prompt_eval_count") or 0),
                        "output_tokens": int(chunk.get("eval_count") or 0),
                    },
                },
            )
            yield sse_event("message_stop", {"type": "message_stop"})
            return
        text = msg.get("content") or ""
        if text:
            if not text_open:
                yield sse_event(
                    "content_block_start",
                    {"type": "content_block_start", "index": index, "content_block": {"type": "text", "text": ""}},
                )
                text_open = True
            yield sse_event(
                "content_block_delta",
                {"type": "content_block_delta", "index": index, "delta": {"type": "text_delta", "text": text}},
            )
        for call in msg.get("tool_calls") or []:
            if text_open:
                yield sse_event("content_block_stop", {"type": "content_block_stop", "index": index})
                index, text_open = index + 1, False
            any_calls = True
            block = _tool_block(call)
            yield sse_event(
                "content_block_start",
                {"type": "content_block_start", "index": index, "content_block": {**block, "input": {}}},
            )
            yield sse_event(
                "content_block_delta",
                {
                    "type": "content_block_delta",
                    "index": index,
                    "delta": {"type": "input_json_delta", "partial_json": json.dumps(block["input"])},
                },
            )
            yield sse_event("content_block_stop", {"type": "content_block_stop", "index": index})
            index += 1
        chunk = await anext(rest, None)


# -- /v1/messages/count_tokens --------------------------------------------------------------------------------
@router.post("/v1/messages/count_tokens")
@shaped(anthropic_error)
async def count_tokens(request: Request) -> Response:
    body = await read_json(request)
    note(model=body.get("model") if isinstance(body.get("model"), str) else "")
    body.setdefault("max_tokens", 1)
    req = _chat_request(body, stream=False)
    inf = inference(request)
    ctx = await run_in_threadpool(inf.model, req.model_name)
    opts = inf.options(ctx, req.options)
    spec = inf.load_spec(ctx, opts)
    msgs = [message_dict(m) for m in req.messages]
    async with await inf.acquire(ctx, spec, None) as lease:
        text = await render_chat(lease, ctx, build_messages(ctx, msgs), req.tools, spec.num_ctx, False, None)
        tokens = await lease.runner.tokenize(text)
    return JSONResponse({"input_tokens": len(tokens)})
