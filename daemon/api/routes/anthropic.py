"""The Anthropic Messages API: ``POST /v1/messages`` and ``POST /v1/messages/count_tokens``.

A request becomes an Ollama chat request (system blocks joined into a system message, ``tool_use`` blocks into
assistant tool calls, ``tool_result`` blocks into tool messages) and runs through the same core as ``/api/chat``.
Replies use Anthropic's content blocks and stop reasons; streams use its events (message_start,
content_block_start/delta/stop, message_delta, message_stop, ping). ``tool_choice`` "any" or naming a tool forces
the call with a grammar.

What Claude Code sends to a model that is not Claude is accepted as Ollama accepts it: a ``role: "system"``
message inside ``messages`` stays where it is as a system message (the template's ``.System`` gathers every
system message, as in Ollama); ``thinking`` ``adaptive`` turns thinking on like ``enabled`` (no ``budget_tokens``
needed) and ``output_config.effort`` picks the thinking level; ``max_tokens`` is a limit, never refused for
exceeding the context; Anthropic's own tools (``web_search_20250305`` and the like, which run on Anthropic's
servers) are dropped with a debug line, as the Responses layer drops hosted tools; block kinds a local model has no
use for (documents, search results, server tool results other than web search's) are skipped as Ollama skips them;
``metadata``, ``context_management``, ``cache_control``, ``anthropic-beta`` headers and the ``?beta=true`` query
change nothing. Errors carry Anthropic's types, and its wording where clients act on it (see
:func:`daemon.api.compat.anthropic_error`).
"""

from __future__ import annotations

import json
import logging
import secrets
import time
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse

from daemon.api.compat import (
    BadParam,
    anthropic_error,
    get,
    guarded,
    keep_alive_of,
    read_json,
    shaped,
    sse_event,
    sse_response,
)
from daemon.api.state import inference
from daemon.chat.pipeline import call_schema
from daemon.chat.types import Content, Event, Finished, Message, Thinking, ThinkValue, Tool, ToolCall, ToolCalls
from daemon.generation.calls import ChatCall, options_and_bias
from daemon.generation.choices import first_then
from daemon.generation.service import Run, count_chat_tokens, run_chat
from daemon.logs import note

router = APIRouter()
log = logging.getLogger(__name__)


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


def role_error(index: int, role: Any) -> BadParam:
    """Anthropic's words for a role it does not take (``messages: Unexpected role "x". ...``), naming the roles
    corral takes: clients match on the start of them."""
    where = f"messages[{index}].role"
    if role is None:
        return BadParam(where, f'messages.{index}.role: Field required (one of "user", "assistant" or "system")')
    if not isinstance(role, str):
        return BadParam(
            where, f'messages.{index}.role: Input should be a valid string ("user", "assistant" or "system")'
        )
    hint = (
        ' A tool\'s result is a "tool_result" block in a user message, answering the "tool_use" block of the'
        " assistant message before it."
        if role.lower() == "tool"
        else ""
    )
    return BadParam(
        where,
        f'messages: Unexpected role "{role}". Allowed roles are "user", "assistant" or "system" (messages[{index}]).'
        + hint,
    )


def _messages(body: dict[str, Any]) -> list[Message]:
    out: list[Message] = []
    system = body.get("system")
    if system is not None:
        text = _blocks_text(system, "system")
        if text:
            out.append(Message(role="system", content=text))
    raw = get(body, "messages", "list", required=True)
    if not raw:
        raise BadParam("messages", "messages: at least one message is required")
    names: dict[str, str] = {}  # tool_use id -> tool name, for the tool_result blocks that answer them
    for i, m in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise BadParam(where, f"messages.{i}: Input should be an object with a role and a content")
        role = m["role"].lower() if isinstance(m.get("role"), str) else m.get("role")
        if role not in ("user", "assistant", "system"):
            raise role_error(i, m.get("role"))
        content = m.get("content")
        if role == "system":
            # as Ollama: a system message where it stands (Claude Code sends one after the first user turn when the
            # model is not Claude); the template's .System gathers every system message
            text = _blocks_text(content if content is not None else "", f"{where}.content")
            if text:
                out.append(Message(role="system", content=text))
            continue
        if isinstance(content, str):
            out.append(Message(role=role, content=content))
            continue
        if not isinstance(content, list):
            raise BadParam(f"{where}.content", f"'{where}.content' must be a string or an array of blocks")
        texts: list[str] = []
        images: list[str] = []
        calls: list[ToolCall] = []
        thinking = ""
        for j, block in enumerate(content):
            bwhere = f"{where}.content[{j}]"
            if not isinstance(block, dict) or not isinstance(block.get("type"), str):
                raise BadParam(f"{bwhere}.type", f"'{bwhere}' must be a content block with a type")
            kind = block["type"]
            if kind == "text":
                texts.append(str(block.get("text") or ""))
            elif kind == "image":
                images.append(_image(block, bwhere))
            elif kind in ("thinking", "redacted_thinking") and role == "assistant":
                thinking += str(block.get("thinking") or "")  # earlier thinking, given back as the API asks
            elif kind in ("tool_use", "server_tool_use") and role == "assistant":
                if not isinstance(block.get("name"), str):
                    raise BadParam(f"{bwhere}.name", f"'{bwhere}.name' must be a string")
                call_id = str(block.get("id") or "")
                names[call_id] = block["name"]
                calls.append(ToolCall(name=block["name"], arguments=_input(block, bwhere), id=call_id))
            elif kind in ("tool_result", "web_search_tool_result") and role == "user":
                out.append(_tool_result(block, bwhere, names))
            elif kind in ("tool_use", "server_tool_use", "thinking", "redacted_thinking", "tool_result"):
                raise BadParam(f"{bwhere}.type", f"a {kind!r} block cannot be in a {role} message")
            else:  # documents, search results, container uploads...: nothing a local chat template can show
                log.debug("anthropic: skipping a %r block in %s (corral has no use for it)", kind, bwhere)
        if texts or images or calls or thinking:
            out.append(
                Message(
                    role=role,
                    content="\n".join(texts),
                    thinking=thinking,
                    images=tuple(images),
                    tool_calls=tuple(calls),
                )
            )
    return out


def _image(block: dict[str, Any], where: str) -> str:
    src = block.get("source")
    if not isinstance(src, dict) or src.get("type") != "base64" or not isinstance(src.get("data"), str):
        raise BadParam(f"{where}.source", f"'{where}.source': images must be base64 sources; corral never fetches URLs")
    return str(src["data"])


def _tool_result(block: dict[str, Any], where: str, names: dict[str, str]) -> Message:
    """A tool message from a ``tool_result`` (its text blocks joined, its images kept, as Ollama does) or from a
    ``web_search_tool_result`` (its results as lines of title and address)."""
    result = block.get("content")
    texts: list[str] = []
    images: list[str] = []
    if isinstance(result, str):
        texts.append(result)
    elif isinstance(result, dict):  # a web search's error
        texts.append(f"{result.get('type') or 'error'}: {result.get('error_code') or ''}".rstrip(": "))
    elif isinstance(result, list):
        for k, part in enumerate(result):
            pwhere = f"{where}.content[{k}]"
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text":
                texts.append(str(part.get("text") or ""))
            elif kind == "image":
                images.append(_image(part, pwhere))
            elif kind == "web_search_result":
                texts.append(f"- {part.get('title') or ''}: {part.get('url') or ''}")
            elif kind is None:
                raise BadParam(pwhere, f"'{pwhere}' must be a content block with a type")
            else:
                log.debug("anthropic: skipping a %r block in %s (corral has no use for it)", kind, pwhere)
    elif result is not None:
        raise BadParam(f"{where}.content", f"'{where}.content' must be a string or an array of blocks")
    call_id = str(block.get("tool_use_id") or "")
    return Message(
        role="tool",
        content="\n".join(texts),
        images=tuple(images),
        tool_name=names.get(call_id, ""),
        tool_call_id=call_id,
    )


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
    """The request's own tools as Ollama function tools (newer fields such as ``cache_control``, ``strict``,
    ``input_examples`` or ``defer_loading`` change nothing), Anthropic's server tools dropped, and the grammar that
    ``tool_choice`` "any" or "tool" forces (``disable_parallel_tool_use`` changes nothing: one call is made)."""
    tools = get(body, "tools", "list")
    choice = get(body, "tool_choice", "dict") or {"type": "auto"}
    kind = choice.get("type")
    if kind not in ("auto", "any", "tool", "none"):
        raise BadParam("tool_choice.type", "'tool_choice.type' must be auto, any, tool or none")
    if not tools or kind == "none":
        return None, None
    converted: list[dict[str, Any]] = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict):
            raise BadParam(f"tools[{i}]", f"'tools[{i}]' must be an object with a name and an input_schema")
        kind_of_tool = t.get("type")
        if kind_of_tool not in (None, "custom"):
            # web_search_20250305, web_fetch_..., code_execution_..., bash_..., text_editor_...: tools that
            # Anthropic's servers run or that only its models know the shape of (the Responses layer drops hosted
            # tools the same way)
            log.debug(
                "anthropic: dropping tools[%d] of type %r (%r): corral cannot run it", i, kind_of_tool, t.get("name")
            )
            continue
        if not isinstance(t.get("name"), str) or not t["name"]:
            raise BadParam(
                f"tools[{i}].name", f"'tools[{i}].name' is required: a tool needs a name and an input_schema"
            )
        schema = t.get("input_schema")
        if schema is not None and not isinstance(schema, dict):
            raise BadParam(f"tools[{i}].input_schema", f"'tools[{i}].input_schema' must be a JSON schema object")
        converted.append(
            {
                "type": "function",
                "function": {
                    "name": t["name"],
                    "description": t.get("description") or "",
                    "parameters": schema or {"type": "object"},
                },
            }
        )
    if kind == "tool":
        chosen = [t for t in converted if t["function"]["name"] == choice.get("name")]
        if not chosen:
            raise BadParam(
                "tool_choice.name", f"tool_choice names {choice.get('name')!r}, which is not among the tools"
            )
        return converted, call_schema(chosen)
    if not converted:
        return None, None
    if kind == "any":
        return converted, call_schema(converted)
    return converted, None


def _think(body: dict[str, Any]) -> bool | str | None:
    """``thinking.type`` and ``output_config.effort`` as a ``think`` value. ``enabled`` and ``adaptive`` (what
    Claude Code sends; no ``budget_tokens`` needed) turn thinking on, at the effort's level when one is given (a
    model without levels just thinks); ``disabled`` turns it off whatever the effort; an effort alone is a level, as
    Ollama maps it. A model that cannot think is not refused (see ``relax_think``)."""
    thinking = get(body, "thinking", "dict")
    effort = str((get(body, "output_config", "dict") or {}).get("effort") or "").strip().lower()
    if effort == "xhigh":
        effort = "high"
    level = effort if effort in ("low", "medium", "high", "max") else None
    if thinking is None:
        return level
    kind = thinking.get("type")
    if kind in ("enabled", "adaptive"):
        return level or True
    if kind == "disabled":
        return False
    raise BadParam("thinking.type", f"'thinking.type' must be enabled, adaptive or disabled, got {kind!r}")


def _chat_call(body: dict[str, Any], *, think: ThinkValue = None) -> ChatCall:
    model = get(body, "model", "str", required=True)
    tools, forced = _tools(body)
    messages = _messages(body)
    options, bias = options_and_bias(_options(body))
    return ChatCall(
        model=model,
        messages=tuple(messages),
        options=options,
        tools=tuple(Tool.of(t) for t in tools or ()),
        format=forced,
        think=think,
        keep_alive=keep_alive_of(body),
        logit_bias=bias,
    )


# -- response translation -------------------------------------------------------------------------------------
def _stop_reason(final: Finished, calls: bool) -> tuple[str, str | None]:
    if calls:
        return "tool_use", None
    if final.done_reason == "length":
        return "max_tokens", None
    if final.stop_sequence:
        return "stop_sequence", final.stop_sequence
    return "end_turn", None


def _tool_block(call: ToolCall) -> dict[str, Any]:
    return {
        "type": "tool_use",
        "id": "toolu_" + (call.id.removeprefix("call_") if call.id else secrets.token_hex(12)),
        "name": call.name,
        "input": call.arguments,
    }


@router.post("/v1/messages")
@shaped(anthropic_error)
async def messages(request: Request) -> Response:
    started = time.monotonic()
    body = await read_json(request)
    note(model=body.get("model") if isinstance(body.get("model"), str) else "")
    stream = bool(get(body, "stream", "bool"))
    call = _chat_call(body, think=_think(body))
    # as Ollama: Claude Code asks every model to think; a model that cannot is not refused
    run = await run_chat(inference(request), call, started, count_prompt=stream, relax_think=True)
    assert isinstance(run, Run)  # messages are never empty here
    first, rest = await first_then(run)
    mid = f"msg_{secrets.token_hex(12)}"
    if not stream:
        return JSONResponse(await _whole(first, rest, mid, call.model))
    return sse_response(
        guarded(_events(first, rest, mid, call.model, await run.prompt_count() or 0), rest, _error_event)
    )


async def _whole(first: Event | None, rest: AsyncIterator[Event], mid: str, model: str) -> dict[str, Any]:
    calls: list[ToolCall] = []
    text, thinking, last, event = "", "", Finished("stop"), first
    try:
        while event is not None:
            if isinstance(event, Content):
                text += event.text
            elif isinstance(event, Thinking):
                thinking += event.text
            elif isinstance(event, ToolCalls):
                calls += event.calls
            else:
                last = event
            event = await anext(rest, None)
    finally:
        await rest.aclose()  # type: ignore[attr-defined]
    content: list[dict[str, Any]] = [{"type": "thinking", "thinking": thinking, "signature": ""}] if thinking else []
    if text or not calls:
        content.append({"type": "text", "text": text})
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
        "usage": {"input_tokens": last.prompt_eval_count, "output_tokens": last.eval_count},
    }


def _error_event(message: str) -> bytes:
    return sse_event("error", {"type": "error", "error": {"type": "api_error", "message": message}})


def _block_start(index: int, block: dict[str, Any]) -> bytes:
    return sse_event("content_block_start", {"type": "content_block_start", "index": index, "content_block": block})


def _block_delta(index: int, delta: dict[str, Any]) -> bytes:
    return sse_event("content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta})


def _block_stop(index: int) -> bytes:
    return sse_event("content_block_stop", {"type": "content_block_stop", "index": index})


async def _events(
    first: Event | None, rest: AsyncIterator[Event], mid: str, model: str, prompt_tokens: int
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
                "usage": {"input_tokens": prompt_tokens, "output_tokens": 0},
            },
        },
    )
    yield sse_event("ping", {"type": "ping"})
    index, open_kind, any_calls, event = 0, "", False, first
    while event is not None:
        if isinstance(event, Finished):
            if open_kind:
                yield _block_stop(index)
            reason, seq = _stop_reason(event, any_calls)
            yield sse_event(
                "message_delta",
                {
                    "type": "message_delta",
                    "delta": {"stop_reason": reason, "stop_sequence": seq},
                    "usage": {"input_tokens": event.prompt_eval_count, "output_tokens": event.eval_count},
                },
            )
            yield sse_event("message_stop", {"type": "message_stop"})
            return
        if isinstance(event, (Thinking, Content)) and event.text:
            kind = "thinking" if isinstance(event, Thinking) else "text"
            if open_kind != kind:
                if open_kind:
                    yield _block_stop(index)
                    index += 1
                start = {"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking" else None
                yield _block_start(index, start or {"type": "text", "text": ""})
                open_kind = kind
            if kind == "thinking":
                yield _block_delta(index, {"type": "thinking_delta", "thinking": event.text})
            else:
                yield _block_delta(index, {"type": "text_delta", "text": event.text})
        elif isinstance(event, ToolCalls):
            for call in event.calls:
                if open_kind:
                    yield _block_stop(index)
                    index, open_kind = index + 1, ""
                any_calls = True
                block = _tool_block(call)
                yield _block_start(index, {**block, "input": {}})
                yield _block_delta(
                    index,
                    {"type": "input_json_delta", "partial_json": json.dumps(block["input"], ensure_ascii=False)},
                )
                yield _block_stop(index)
                index += 1
        event = await anext(rest, None)


# -- /v1/messages/count_tokens --------------------------------------------------------------------------------
@router.post("/v1/messages/count_tokens")
@shaped(anthropic_error)
async def count_tokens(request: Request) -> Response:
    body = await read_json(request)
    note(model=body.get("model") if isinstance(body.get("model"), str) else "")
    body.setdefault("max_tokens", 1)
    return JSONResponse({"input_tokens": await count_chat_tokens(inference(request), _chat_call(body))})
