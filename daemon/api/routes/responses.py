"""OpenAI's Responses API: ``POST /v1/responses`` (what Codex and newer OpenAI SDK code call).

A request becomes an Ollama chat request and runs through the same core as ``/api/chat`` and
``/v1/chat/completions``: ``instructions`` is a system message; ``input`` is a string (one user message) or a list
of items: messages (``{"role", "content"}``, content a string or ``input_text``/``output_text``/``input_image``
parts; role developer is system), ``function_call`` items (assistant tool calls) and ``function_call_output``
items (tool messages). Tools are flat function declarations (``{"type": "function", "name", "parameters"}``) and
``namespace`` tools, whose member functions are offered to the model by one flat name (``namespace__name``, Codex's
own) and whose calls come back as ``function_call`` items with ``name`` and ``namespace`` apart, the pair Codex looks
its tools up by. As in Ollama, tools corral cannot run are left out of what the model sees, with a debug log line:
hosted ones (``web_search``, ``file_search``, ...) and any other type; a ``web_search_call`` item in the history is
skipped. ``tool_choice`` "required" or ``{"type": "function", "name"}`` forces the call with a grammar, as in
``/v1/chat/completions``. ``text.format`` json_schema and json_object constrain the output with a grammar;
``max_output_tokens``, ``temperature`` and ``top_p`` map to Ollama's options (an ``options`` object passes any
other, such as ``seed`` or ``num_ctx``); ``draft_model`` and ``speculative.n_max``/``n_min``/``p_min`` as in
``/v1/chat/completions`` (speculative decoding; ``usage`` then has ``draft_n`` and ``draft_n_accepted``).

``reasoning.effort`` maps to ``think`` as Ollama does (none: off; minimal: low; low, medium, high, max as they
are; xhigh and ultra: max) for a model that can think; for a model that cannot, it is ignored rather than refused,
because clients such as Codex send it on every request whatever the model.

Stateless, as Ollama: corral stores no responses, so ``previous_response_id`` and ``conversation`` are refused with
a 400 that says to send the whole conversation in ``input``; ``store`` is accepted and ignored (the reply says
``"store": false``), and so are hints that do not change the answer (include, metadata, client_metadata, user,
service_tier, truncation, prompt_cache_key, stream_options, safety_identifier, text.verbosity, reasoning.summary):
checked for their type and, where OpenAI has a fixed set, their value. A field corral cannot honour (background,
prompt) is refused with a 400 naming it.

Replies are Response objects (``output`` holds message, function_call and, for a thinking model, reasoning
items; ``status`` "incomplete" with ``incomplete_details.reason`` "max_output_tokens" when cut by the request's own
``max_output_tokens``; a cut by a limit the client did not set completes, as in Ollama);
streams are OpenAI's typed events, each with ``type`` and an increasing ``sequence_number``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import secrets
import time
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from daemon.api.compat import (
    BadParam,
    begin,
    content_parts,
    data_url_image,
    get,
    guarded,
    keep_alive_of,
    lora_option,
    openai_error,
    shaped,
    speculative_options,
    sse_event,
    sse_response,
    think_of,
)
from daemon.api.state import inference
from daemon.chat.pipeline import call_schema
from daemon.chat.types import Content, Event, Finished, Message, Thinking, Tool, ToolCall, ToolCalls
from daemon.generation.calls import ChatCall, options_and_bias
from daemon.generation.choices import first_then
from daemon.generation.service import Run, run_chat

router = APIRouter()
log = logging.getLogger(__name__)

LOGPROBS_INCLUDE = "message.output_text.logprobs"


def _id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


# -- request translation --------------------------------------------------------------------------------------
def _refuse_unsupported(body: dict[str, Any]) -> None:
    for name in ("previous_response_id", "conversation"):
        if body.get(name) is not None:
            raise BadParam(
                name,
                f"'{name}' is not supported: corral does not store responses (it is stateless, as Ollama); "
                "send the whole conversation in 'input' instead",
            )
    if body.get("background"):
        raise BadParam("background", "'background' responses are not supported: corral does not store responses")
    if body.get("prompt") is not None:
        raise BadParam("prompt", "'prompt' (stored prompt templates) is not supported; send 'instructions' and 'input'")


# fields that change nothing in the answer, accepted as Codex and the SDKs send them; a wrong type or a value outside
# OpenAI's set is still refused, so a typo does not pass for a setting
_HINTS: dict[str, str] = {
    "store": "bool",
    "prompt_cache_key": "str",
    "prompt_cache_retention": "str",
    "client_metadata": "dict",
    "metadata": "dict",
    "stream_options": "dict",
    "user": "str",
    "safety_identifier": "str",
    "service_tier": "str",
    "truncation": "str",
    "max_tool_calls": "int",
}
_CHOICES: dict[str, tuple[str, ...]] = {
    "service_tier": ("auto", "default", "flex", "scale", "priority"),
    "truncation": ("auto", "disabled"),
    "text.verbosity": ("low", "medium", "high"),
    "reasoning.summary": ("auto", "concise", "detailed", "none"),
    "reasoning.generate_summary": ("auto", "concise", "detailed", "none"),
}


def _check_hints(body: dict[str, Any]) -> None:
    for name, kind in _HINTS.items():
        get(body, name, kind)
    include = get(body, "include", "list") or []
    for i, entry in enumerate(include):
        if not isinstance(entry, str):
            raise BadParam(f"include[{i}]", f"'include[{i}]' must be a string")
    get(body, "parallel_tool_calls", "bool")
    text = get(body, "text", "dict") or {}
    reasoning = get(body, "reasoning", "dict") or {}
    values = {
        "service_tier": body.get("service_tier"),
        "truncation": body.get("truncation"),
        "text.verbosity": text.get("verbosity"),
        "reasoning.summary": reasoning.get("summary"),
        "reasoning.generate_summary": reasoning.get("generate_summary"),
    }
    for param, value in values.items():
        if value is not None and value not in _CHOICES[param]:
            allowed = ", ".join(_CHOICES[param])
            raise BadParam(param, f"invalid '{param}' value {value!r}: use one of {allowed}")


def _parts(content: Any, where: str) -> tuple[str, list[str]]:
    """Text and images (base64) of a message's content: a string or an array of content parts."""
    parts = content_parts(content, where)
    if isinstance(parts, str):
        return parts, []
    texts: list[str] = []
    images: list[str] = []
    for here, part in parts:
        kind = part.get("type")
        if kind in ("input_text", "output_text", "text"):
            texts.append(str(part.get("text") or ""))
        elif kind == "refusal":
            texts.append(str(part.get("refusal") or ""))
        elif kind == "input_image":
            images.append(data_url_image(part.get("image_url"), f"{here}.image_url"))
        elif kind == "input_file":
            raise BadParam(f"{here}.type", "file inputs are not supported: send the text as input_text")
        else:
            raise BadParam(
                f"{here}.type", f"unsupported content part type {kind!r}: use input_text, output_text or input_image"
            )
    return "".join(texts), images


def _arguments(value: Any, where: str) -> dict[str, Any]:
    if value is None or value == "":
        return {}
    if isinstance(value, dict):
        return value
    try:
        parsed = json.loads(value) if isinstance(value, str) else None
    except ValueError:
        parsed = None
    if not isinstance(parsed, dict):
        raise BadParam(where, f"'{where}' must be a JSON object string")
    return parsed


def _messages(body: dict[str, Any]) -> list[Message]:
    out: list[Message] = []
    instructions = get(body, "instructions", "str")
    if instructions:
        out.append(Message(role="system", content=instructions))
    raw = body.get("input")
    if isinstance(raw, str):
        out.append(Message(role="user", content=raw))
        return out
    if not isinstance(raw, list):
        raise BadParam("input", "'input' must be a string or an array of input items")
    names: dict[str, str] = {}  # call_id -> function name, for the outputs that answer them
    thinking = ""  # a reasoning item's summary, for the assistant turn after it
    for i, item in enumerate(raw):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise BadParam(where, f"'{where}' must be an object")
        kind = item.get("type") or ("message" if "role" in item else None)
        last = out[-1] if out else None
        if kind == "message":
            role = item.get("role")
            if role == "developer":
                role = "system"
            if role not in ("system", "user", "assistant"):
                raise BadParam(f"{where}.role", f"'{where}.role' must be user, assistant, system or developer")
            text, images = _parts(item.get("content"), f"{where}.content")
            nxt = raw[i + 1] if i + 1 < len(raw) else None
            answered = isinstance(nxt, dict) and nxt.get("type") == "function_call_output"
            if role == "assistant" and answered and last and last.role == "assistant" and last.tool_calls:
                # an assistant message replayed between a call and its output stays in the calling turn
                out[-1] = dataclasses.replace(last, content="\n".join(t for t in (last.content, text) if t))
                continue
            msg = Message(role=role, content=text, images=tuple(images))
            if role == "assistant" and thinking:
                msg, thinking = dataclasses.replace(msg, thinking=thinking), ""
            out.append(msg)
        elif kind == "function_call":
            name = item.get("name")
            if not isinstance(name, str):
                raise BadParam(f"{where}.name", f"'{where}.name' must be a string")
            ns = item.get("namespace")
            if ns is not None and not isinstance(ns, str):
                raise BadParam(f"{where}.namespace", f"'{where}.namespace' must be a string")
            if ns:  # a namespaced function, as Codex replays one: the flat name the model was offered
                name = flat_name(ns, name)
            call_id = str(item.get("call_id") or item.get("id") or "")
            names[call_id] = name
            call = ToolCall(name=name, arguments=_arguments(item.get("arguments"), where), id=call_id)
            if last and last.role == "assistant":
                out[-1] = dataclasses.replace(last, tool_calls=(*last.tool_calls, call))
            else:
                out.append(Message(role="assistant", tool_calls=(call,)))
            if thinking:
                out[-1], thinking = dataclasses.replace(out[-1], thinking=thinking), ""
        elif kind == "function_call_output":
            call_id = str(item.get("call_id") or "")
            text, images = _parts(item.get("output"), f"{where}.output")
            out.append(
                Message(
                    role="tool",
                    content=text,
                    images=tuple(images),
                    tool_name=names.get(call_id, ""),
                    tool_call_id=call_id,
                )
            )
        elif kind == "reasoning":
            summary = item.get("summary") or []
            thinking = "".join(s.get("text") or "" for s in summary if isinstance(s, dict))
        elif kind == "web_search_call":
            pass  # as Ollama: a hosted search in the history is metadata; the message after it has what it found
        elif kind == "item_reference":
            raise BadParam(
                f"{where}.type", "item references are not supported: corral does not store responses; send the item"
            )
        else:
            raise BadParam(f"{where}.type", f"unsupported input item type {kind!r}")
    if not any(m.role != "system" for m in out):
        raise BadParam("input", "'input' must contain at least one message")
    return out


def _options(body: dict[str, Any]) -> dict[str, Any]:
    opts: dict[str, Any] = {"temperature": 1.0, "top_p": 1.0}  # OpenAI's defaults, as /v1/chat/completions
    opts.update(get(body, "options", "dict") or {})
    opts.update(speculative_options(body))  # draft_model, speculative.n_max/n_min/p_min, as /v1/chat/completions
    opts.update(lora_option(body))  # llama-server's lora: [{"id", "scale"}] (the model's ADAPTERs by index)
    for name, hi in (("temperature", 2), ("top_p", 1)):
        value = get(body, name, "num", lo=0, hi=hi)
        if value is not None:
            opts[name] = value
    limit = get(body, "max_output_tokens", "int", lo=1)
    if limit is not None:
        opts["num_predict"] = limit
    return opts


def flat_name(namespace: str, name: str) -> str:
    """The one name a ``namespace`` tool's member has for the model: Codex's own flat form (``namespace__name``,
    stray underscores at the join trimmed), so an MCP server's ``mcp__server__`` and ``tool`` read as
    ``mcp__server__tool``, as Codex names them wherever a boundary cannot keep the two apart."""
    return f"{namespace.rstrip('_')}__{name.lstrip('_')}" if namespace else name


def _function(t: dict[str, Any], where: str) -> dict[str, Any]:
    """Ollama's tool for one flat Responses function declaration (or the chat completions shape, tolerated)."""
    nested = t.get("function")
    fn: dict[str, Any] = nested if isinstance(nested, dict) else t
    if not isinstance(fn.get("name"), str) or not fn["name"]:
        raise BadParam(f"{where}.name", f"'{where}.name' must be a non-empty string")
    params = fn.get("parameters")
    if params is not None and not isinstance(params, dict):
        raise BadParam(f"{where}.parameters", f"'{where}.parameters' must be a JSON schema object")
    return {
        "type": "function",
        "function": {
            "name": fn["name"],
            "description": fn.get("description") or "",
            "parameters": params if params is not None else {"type": "object", "properties": {}},
        },
    }


class Tools:
    """What a request's ``tools`` offer the model: Ollama's function tools, the namespaced functions among them
    (flat name -> (namespace, name), so a call is answered in Codex's shape), and a format forcing a call when
    ``tool_choice`` asks for one."""

    def __init__(self, body: dict[str, Any]) -> None:
        self.offered: list[dict[str, Any]] = []
        self.namespaced: dict[str, tuple[str, str]] = {}
        dropped: list[str] = []
        for i, t in enumerate(get(body, "tools", "list") or []):
            where = f"tools[{i}]"
            if not isinstance(t, dict):
                raise BadParam(where, f"'{where}' must be an object")
            kind = t.get("type")
            if not isinstance(kind, str) or not kind:
                raise BadParam(f"{where}.type", f"'{where}.type' is required: function, namespace or a hosted tool")
            if kind == "function":
                self._offer(_function(t, where), None, dropped, where)
            elif kind == "namespace":
                self._namespace(t, where, dropped)
            else:
                # as Ollama: a tool corral cannot run (hosted ones such as web_search, file_search, code_interpreter
                # or image_generation; local_shell, custom, mcp) is left out of what the model is offered
                dropped.append(f"{where} ({kind})")
        if dropped:
            log.debug("responses: tools corral cannot run were left out: %s", ", ".join(dropped))
        self.forced = self._choice(body.get("tool_choice"), "tools" in body and bool(body["tools"]))

    def _namespace(self, t: dict[str, Any], where: str, dropped: list[str]) -> None:
        ns = t.get("name")
        if not isinstance(ns, str) or not ns:
            raise BadParam(f"{where}.name", f"'{where}.name' (the namespace) must be a non-empty string")
        members = t.get("tools")
        if not isinstance(members, list):
            raise BadParam(f"{where}.tools", f"'{where}.tools' must be an array of the namespace's functions")
        for j, member in enumerate(members):
            mwhere = f"{where}.tools[{j}]"
            if not isinstance(member, dict):
                raise BadParam(mwhere, f"'{mwhere}' must be an object")
            if member.get("type", "function") != "function":
                dropped.append(f"{mwhere} ({member.get('type')})")
                continue
            self._offer(_function(member, mwhere), ns, dropped, mwhere)

    def _offer(self, tool: dict[str, Any], ns: str | None, dropped: list[str], where: str) -> None:
        fn = tool["function"]
        name = fn["name"]
        flat = flat_name(ns, name) if ns else name
        if any(t["function"]["name"] == flat for t in self.offered):
            dropped.append(f"{where} (a second tool named {flat!r})")
            return
        fn["name"] = flat
        self.offered.append(tool)
        if ns:
            self.namespaced[flat] = (ns, name)

    def _choice(self, choice: Any, given: bool) -> Any:
        if not self.offered:
            if choice == "required" or isinstance(choice, dict):
                why = "none of the 'tools' is a function corral can offer" if given else "no 'tools' are given"
                raise BadParam("tool_choice", f"'tool_choice' asks for a tool call, but {why}")
            return None
        if choice == "none":
            self.offered = []
            return None
        forced: list[dict[str, Any]] = []
        if choice == "required":
            forced = self.offered
        elif isinstance(choice, dict):
            if choice.get("type") != "function":
                raise BadParam(
                    "tool_choice.type",
                    '\'tool_choice\' objects must be {"type": "function", "name": ...}: corral runs no hosted tools',
                )
            name = choice.get("name")
            ns = choice.get("namespace")
            if isinstance(name, str) and isinstance(ns, str) and ns:
                name = flat_name(ns, name)
            forced = [t for t in self.offered if t["function"]["name"] == name]
            if not forced:
                raise BadParam("tool_choice.name", f"tool_choice names {name!r}, which is not among the tools")
        elif choice not in (None, "auto"):
            raise BadParam("tool_choice", "'tool_choice' must be none, auto, required or a function")
        return call_schema(forced) if forced else None


def _format(body: dict[str, Any]) -> Any:
    text = get(body, "text", "dict") or {}
    fmt = text.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise BadParam("text.format", "'text.format' must be an object")
    kind = fmt.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return "json"
    if kind == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise BadParam("text.format.schema", "'text.format.schema' must be a JSON schema object")
        return fmt["schema"]
    raise BadParam("text.format.type", f"unsupported text.format type {kind!r}: use text, json_object or json_schema")


def _logprob_request(body: dict[str, Any]) -> tuple[bool, int]:
    include = get(body, "include", "list") or []
    top = get(body, "top_logprobs", "int", lo=0, hi=20)
    return (LOGPROBS_INCLUDE in include or bool(top)), top or 0


# -- response translation -------------------------------------------------------------------------------------
def _logprobs(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    def one(e: dict[str, Any]) -> dict[str, Any]:
        return {"token": e["token"], "logprob": e["logprob"], "bytes": e.get("bytes") or list(e["token"].encode())}

    return [{**one(e), "top_logprobs": [one(t) for t in e.get("top_logprobs") or []]} for e in entries]


def _usage(final: Finished) -> dict[str, Any]:
    p, c = final.prompt_eval_count, final.eval_count
    return {
        "input_tokens": p,
        "input_tokens_details": {"cached_tokens": final.prompt_cached},
        "output_tokens": c,
        "output_tokens_details": {"reasoning_tokens": 0},  # thinking tokens are not counted apart
        "total_tokens": p + c,
        **final.drafts(),  # draft_n, draft_n_accepted: when the request asked for speculative decoding
    }


class _Reply:
    """One response: its fixed fields, the output items so far, and the typed stream events that build them."""

    def __init__(
        self,
        body: dict[str, Any],
        model: str,
        want_logprobs: bool,
        one_call: bool,
        namespaced: dict[str, tuple[str, str]] | None = None,
    ) -> None:
        self.body, self.model = body, model
        self.namespaced = namespaced or {}
        self.want_logprobs, self.one_call = want_logprobs, one_call
        self.id, self.created = _id("resp"), int(time.time())
        self.output: list[dict[str, Any]] = []
        self.seq = 0
        # the item being streamed: a message's text (and logprobs) or a reasoning summary
        self.text, self.thinking = "", ""
        self.lps: list[dict[str, Any]] = []
        self.status = "in_progress"
        self.message: dict[str, Any] | None = None
        self.reasoning: dict[str, Any] | None = None

    def obj(self, status: str, final: Finished | None = None) -> dict[str, Any]:
        text = get(self.body, "text", "dict") or {}
        reasoning = get(self.body, "reasoning", "dict") or {}
        incomplete = status == "incomplete"
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "background": False,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "instructions": self.body.get("instructions"),
            "max_output_tokens": self.body.get("max_output_tokens"),
            "model": self.model,
            "output": list(self.output),
            "parallel_tool_calls": not self.one_call,
            "previous_response_id": None,
            "reasoning": {"effort": reasoning.get("effort"), "summary": reasoning.get("summary")},
            "store": False,  # corral never stores responses
            "temperature": self.body.get("temperature", 1.0),
            "text": {"format": text.get("format") or {"type": "text"}, "verbosity": text.get("verbosity") or "medium"},
            "tool_choice": self.body.get("tool_choice") or "auto",
            "tools": self.body.get("tools") or [],
            "top_p": self.body.get("top_p", 1.0),
            "truncation": self.body.get("truncation") or "disabled",
            "usage": _usage(final) if final is not None else None,
            "metadata": self.body.get("metadata") or {},
        }

    def event(self, kind: str, **fields: Any) -> bytes:
        data = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return sse_event(kind, data)

    def error_event(self, message: str) -> bytes:
        return self.event("error", code="server_error", message=message, param=None)

    def _in_message(self, kind: str, **fields: Any) -> bytes:
        """An event about the open message's text (its item, at the next output index, content part 0)."""
        assert self.message is not None
        return self.event(kind, item_id=self.message["id"], output_index=len(self.output), content_index=0, **fields)

    def _in_reasoning(self, kind: str, **fields: Any) -> bytes:
        """An event about the open reasoning item's summary (at the next output index, summary part 0)."""
        assert self.reasoning is not None
        return self.event(kind, item_id=self.reasoning["id"], output_index=len(self.output), summary_index=0, **fields)

    # -- items ---------------------------------------------------------------------------------------------------
    def _part(self) -> dict[str, Any]:
        part: dict[str, Any] = {"type": "output_text", "text": self.text, "annotations": []}
        if self.want_logprobs:
            part["logprobs"] = _logprobs(self.lps)
        return part

    def open_message(self) -> list[bytes]:
        if self.message is not None:
            return []
        out = self.close_reasoning()
        self.message = {"id": _id("msg"), "type": "message", "status": "in_progress", "role": "assistant"}
        index = len(self.output)
        out.append(self.event("response.output_item.added", output_index=index, item={**self.message, "content": []}))
        part = {"type": "output_text", "text": "", "annotations": []}
        out.append(self._in_message("response.content_part.added", part=part))
        return out

    def add_text(self, text: str, lps: list[dict[str, Any]]) -> list[bytes]:
        out = self.open_message()
        assert self.message is not None
        self.text += text
        self.lps += lps
        out.append(
            self._in_message(
                "response.output_text.delta", delta=text, logprobs=_logprobs(lps) if self.want_logprobs else []
            )
        )
        return out

    def close_message(self, status: str) -> list[bytes]:
        if self.message is None:
            return []
        part = self._part()
        item = {**self.message, "status": status, "content": [part]}
        out = [
            self._in_message("response.output_text.done", text=self.text, logprobs=part.get("logprobs", [])),
            self._in_message("response.content_part.done", part=part),
            self.event("response.output_item.done", output_index=len(self.output), item=item),
        ]
        self.output.append(item)
        self.message, self.text, self.lps = None, "", []
        return out

    def add_thinking(self, text: str) -> list[bytes]:
        out: list[bytes] = []
        index = len(self.output)
        if self.reasoning is None:
            self.reasoning = {"id": _id("rs"), "type": "reasoning", "summary": []}
            out.append(self.event("response.output_item.added", output_index=index, item=dict(self.reasoning)))
            out.append(
                self._in_reasoning("response.reasoning_summary_part.added", part={"type": "summary_text", "text": ""})
            )
        self.thinking += text
        out.append(self._in_reasoning("response.reasoning_summary_text.delta", delta=text))
        return out

    def close_reasoning(self) -> list[bytes]:
        if self.reasoning is None:
            return []
        part = {"type": "summary_text", "text": self.thinking}
        item = {**self.reasoning, "summary": [part]}
        out = [
            self._in_reasoning("response.reasoning_summary_text.done", text=self.thinking),
            self._in_reasoning("response.reasoning_summary_part.done", part=part),
            self.event("response.output_item.done", output_index=len(self.output), item=item),
        ]
        self.output.append(item)
        self.reasoning, self.thinking = None, ""
        return out

    def add_calls(self, calls: tuple[ToolCall, ...]) -> list[bytes]:
        out = self.close_reasoning() + self.close_message("completed")
        for call in calls:
            if self.one_call and any(o["type"] == "function_call" for o in self.output):
                break
            args = json.dumps(call.arguments, ensure_ascii=False)
            item: dict[str, Any] = {
                "id": _id("fc"),
                "type": "function_call",
                "status": "in_progress",
                "arguments": "",
                "call_id": call.id or _id("call"),
                "name": call.name,
            }
            if call.name in self.namespaced:  # Codex finds the tool by the pair (namespace, name)
                item["namespace"], item["name"] = self.namespaced[call.name]
            index = len(self.output)
            out.append(self.event("response.output_item.added", output_index=index, item=dict(item)))
            out.append(
                self.event("response.function_call_arguments.delta", item_id=item["id"], output_index=index, delta=args)
            )
            out.append(
                self.event(
                    "response.function_call_arguments.done",
                    item_id=item["id"],
                    output_index=index,
                    name=item["name"],
                    arguments=args,
                )
            )
            item.update(status="completed", arguments=args)
            out.append(self.event("response.output_item.done", output_index=index, item=item))
            self.output.append(item)
        return out

    def feed(self, event: Event) -> list[bytes]:
        """The stream events for one chat event (Finished closes what is open and ends the response)."""
        if isinstance(event, Thinking):
            return self.add_thinking(event.text)
        if isinstance(event, Content):
            return self.add_text(event.text, list(event.logprobs)) if event.text or event.logprobs else []
        if isinstance(event, ToolCalls):
            return self.add_calls(event.calls)
        # "incomplete" answers a request's own max_output_tokens, as OpenAI does; a cut by a limit the client did
        # not set (a Modelfile's num_predict, the context) completes, as in Ollama: Codex fails a whole turn on
        # response.incomplete, and it never sets max_output_tokens.
        cut = event.done_reason == "length" and self.body.get("max_output_tokens") is not None
        status = self.status = "incomplete" if cut else "completed"
        out = self.close_reasoning()
        if not self.output or self.message is not None:  # no output at all is an empty message
            out += self.open_message() + self.close_message(status)
        kind = "response.incomplete" if status == "incomplete" else "response.completed"
        out.append(self.event(kind, response=self.obj(status, event)))
        return out


# -- /v1/responses --------------------------------------------------------------------------------------------
@router.get("/v1/responses")
async def responses_upgrade(request: Request) -> Response:
    """Codex asks for the Responses API over a WebSocket first (a GET with ``Upgrade: websocket``) and falls back to
    POST + SSE at once only on 426 Upgrade Required; any other answer (405, 404, a closed socket) it retries for
    several seconds first. corral serves Responses over HTTP only, so the upgrade is told so; a plain GET is 405."""
    if "websocket" not in request.headers.get("upgrade", "").lower():
        raise StarletteHTTPException(status_code=405)
    return JSONResponse(
        {
            "error": {
                "message": "corral serves the Responses API over HTTP: POST /v1/responses (with stream: true for "
                "server-sent events); WebSocket transport is not offered",
                "type": "invalid_request_error",
                "param": None,
                "code": "upgrade_required",
            }
        },
        status_code=426,
        headers={"Upgrade": "HTTP/1.1"},
    )


@router.post("/v1/responses")
@shaped(openai_error)
async def responses(request: Request) -> Response:
    started, body, model = await begin(request)
    _refuse_unsupported(body)
    _check_hints(body)
    messages = _messages(body)
    tools = Tools(body)
    want_logprobs, top = _logprob_request(body)
    stream = bool(get(body, "stream", "bool"))
    options, bias = options_and_bias(_options(body))
    call = ChatCall(
        model=model,
        messages=tuple(messages),
        options=options,
        tools=tuple(Tool.of(t) for t in tools.offered),
        format=tools.forced if tools.forced is not None else _format(body),
        think=think_of(body),  # reasoning.effort, mapped as in /v1/chat/completions
        logprobs=want_logprobs,
        top_logprobs=top,
        keep_alive=keep_alive_of(body),
        logit_bias=bias,
    )
    run = await run_chat(inference(request), call, started, relax_think=True)
    assert isinstance(run, Run)  # messages are never empty here
    first, rest = await first_then(run)  # an error before any output is still a plain error answer
    one_call = get(body, "parallel_tool_calls", "bool") is False
    reply = _Reply(body, model, want_logprobs, one_call, tools.namespaced)
    if not stream:
        try:
            event = first
            while event is not None:
                reply.feed(event)
                if isinstance(event, Finished):
                    return JSONResponse(reply.obj(reply.status, event))
                event = await anext(rest, None)
        finally:
            await rest.aclose()  # type: ignore[attr-defined]
        return JSONResponse(reply.obj("incomplete"))
    return sse_response(guarded(_events(reply, first, rest), rest, reply.error_event))


async def _events(reply: _Reply, first: Event | None, rest: AsyncIterator[Event]) -> AsyncGenerator[bytes, None]:
    yield reply.event("response.created", response=reply.obj("in_progress"))
    yield reply.event("response.in_progress", response=reply.obj("in_progress"))
    event = first
    while event is not None:
        for frame in reply.feed(event):
            yield frame
        event = await anext(rest, None)
