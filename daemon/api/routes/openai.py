"""The OpenAI-compatible API: ``/v1/chat/completions``, ``/v1/completions``, ``/v1/embeddings``, ``/v1/models``.

Requests become Ollama chat, generate or embed requests and run through the same cores as ``/api/*``; replies and
errors take OpenAI's shapes (server-sent events ending with ``data: [DONE]`` when streaming). As Ollama, an
absent temperature or top_p means 1.0. Beyond Ollama: an ``options`` object in the body (the SDKs send it with
``extra_body``) passes any Ollama option, such as ``num_ctx``; ``tool_choice`` "required" or naming a function
forces the call with a grammar; ``logprobs``/``top_logprobs`` work; ``echo`` works in completions.

Speculative decoding per request: LM Studio's top-level ``draft_model`` and llama-server's ``speculative.n_max``,
``speculative.n_min``, ``speculative.p_min`` (the options draft_model, draft_max, draft_min, draft_p_min; any other
draft option, such as draft_ngram, in ``options``); ``usage`` then reports ``draft_n`` and ``draft_n_accepted``.

``n`` (1 to 16) returns n choices, generated at once as n sequences that the runner decodes side by side (with a
``seed``, choice i uses seed + i); ``logit_bias`` is added to the logits before every sampling step (-100 bans a
token, +100 forces it). A field corral does not know is ignored, as SDKs add new ones; a known OpenAI field that
corral cannot honour (audio, prediction, web_search_options, functions...) is refused with a 400 naming it.
"""

from __future__ import annotations

import base64
import json
import secrets
import struct
import time
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse

from daemon.api.bodies import parse_model
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
    sse_data,
    sse_response,
    stops,
    think_of,
)
from daemon.api.schemas import EmbedRequestBody
from daemon.api.state import inference
from daemon.chat import pipeline
from daemon.chat.types import (
    Content,
    Event,
    Finished,
    JSONObject,
    JSONValue,
    Message,
    Thinking,
    Tool,
    ToolCall,
    ToolCalls,
)
from daemon.generation.calls import ChatCall, GenerateCall, LogitBias, options_and_bias
from daemon.generation.choices import chat_choices, generate_choices
from daemon.generation.embed import run_embed
from daemon.logs import note
from daemon.runners.base import parse_logit_bias
from errors import CorralError

router = APIRouter()
FINGERPRINT = "fp_corral"


def _id(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(12)}"


# -- request translation --------------------------------------------------------------------------------------
def _options(body: dict[str, Any]) -> tuple[JSONObject, LogitBias]:
    """Ollama options from an OpenAI body: defaults of 1.0, then ``options``, then the named OpenAI fields; and
    the logit_bias, parsed once: the body's own, else one in ``options`` (a corral extension)."""
    _unsupported(body)
    opts: JSONObject = {"temperature": 1.0, "top_p": 1.0}
    extra = get(body, "options", "dict")
    if extra:
        opts.update(extra)
    opts.update(speculative_options(body))  # draft_model, speculative.n_max/n_min/p_min
    opts.update(lora_option(body))  # llama-server's lora: [{"id", "scale"}] (the model's ADAPTERs by index)
    for name, kind, lo, hi in (
        ("temperature", "num", 0, 2),
        ("top_p", "num", 0, 1),
        ("seed", "int", None, None),
        ("frequency_penalty", "num", -2, 2),
        ("presence_penalty", "num", -2, 2),
    ):
        value = get(body, name, kind, lo=lo, hi=hi)
        if value is not None:
            opts[name] = value
    limit = get(body, "max_completion_tokens", "int", lo=1)
    if limit is None:
        limit = get(body, "max_tokens", "int", lo=1)
    if limit is not None:
        opts["num_predict"] = limit
    stop = stops(body.get("stop"), "stop")
    if stop:
        opts["stop"] = list[JSONValue](stop)
    bias = _logit_bias(body)
    opts, in_options = options_and_bias(opts)
    return opts, bias or in_options


MAX_CHOICES = 16  # n's bound: OpenAI allows 128, but each choice takes one of the runner's sequence slots


def _unsupported(body: dict[str, Any]) -> None:
    """Refuse, naming it, an OpenAI field that corral knows but cannot honour and that would change the answer's
    meaning if ignored. A field corral does not know at all is ignored (the SDKs add new ones all the time), and
    so are hints that do not change the answer: service_tier, store, metadata, user, safety_identifier,
    prompt_cache_key, prompt_cache_retention, verbosity, stream_options.include_obfuscation."""
    if body.get("audio") is not None:
        raise BadParam("audio", "'audio' output is not supported: corral generates text only; leave 'audio' out")
    modalities = body.get("modalities")
    if modalities is not None:
        if not isinstance(modalities, list) or not all(isinstance(m, str) for m in modalities):
            raise BadParam("modalities", "'modalities' must be an array of strings")
        if any(m != "text" for m in modalities):
            raise BadParam("modalities", "'modalities' may only be [\"text\"]: corral generates text only")
    if body.get("prediction") is not None:
        raise BadParam("prediction", "'prediction' (Predicted Outputs) is not supported; leave it out")
    if body.get("web_search_options") is not None:
        raise BadParam(
            "web_search_options",
            "'web_search_options' is not supported: corral does not search the "
            "web; leave it out, or offer the model a search function in 'tools'",
        )
    for name in ("functions", "function_call"):
        if body.get(name) is not None:
            raise BadParam(name, f"'{name}' (deprecated by OpenAI) is not supported: use 'tools' and 'tool_choice'")


def _choice_count(body: dict[str, Any]) -> int:
    """``n``: 1 to MAX_CHOICES choices, generated side by side as sequences of the runner."""
    n = get(body, "n", "int")
    if n is None:
        return 1
    if not 1 <= n <= MAX_CHOICES:
        raise BadParam(
            "n",
            f"'n' must be between 1 and {MAX_CHOICES}, got {n}: corral generates the choices side "
            "by side in the model's sequence slots and bounds n (OpenAI allows 128); send several "
            "requests for more",
        )
    return int(n)


def _logit_bias(body: dict[str, Any]) -> tuple[tuple[int, float], ...]:
    """OpenAI's ``logit_bias``, checked (the ids' upper bound, the model's vocabulary, by the runner)."""
    value = get(body, "logit_bias", "dict")
    try:
        return parse_logit_bias(value)
    except ValueError as exc:
        raise BadParam("logit_bias", f"'logit_bias' {exc}") from None


def _content_text(content: Any, where: str) -> tuple[str, list[str]]:
    """Text and images (base64) from a message's content: a string or an array of parts."""
    parts = content_parts(content, where)
    if isinstance(parts, str):
        return parts, []
    texts, images = [], []
    for here, part in parts:
        kind = part.get("type")
        if kind == "text":
            texts.append(str(part.get("text") or ""))
        elif kind == "image_url":
            url = part.get("image_url")
            images.append(data_url_image(url.get("url") if isinstance(url, dict) else url, f"{here}.image_url"))
        else:
            raise BadParam(f"{here}.type", f"unsupported content part type {kind!r}: use text or image_url")
    return "\n".join(texts), images


def _messages(body: dict[str, Any]) -> list[Message]:
    raw = get(body, "messages", "list", required=True)
    if not raw:
        raise BadParam("messages", "'messages' must contain at least one message")
    out: list[Message] = []
    names: dict[str, str] = {}  # tool call id -> function name, for tool messages that give only the id
    for i, m in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise BadParam(where, f"'{where}' must be an object")
        role = m.get("role")
        if role == "developer":
            role = "system"
        if role not in ("system", "user", "assistant", "tool"):
            raise BadParam(
                f"{where}.role", f"'{where}.role' must be system, developer, user, assistant or tool, got {role!r}"
            )
        calls = get(m, "tool_calls", "list", where=f"{where}.") if role == "assistant" else None
        if m.get("content") is None and not calls:
            raise BadParam(
                f"{where}.content",
                f"'{where}.content' is required (it may be null only in an assistant message with tool_calls)",
            )
        text, images = _content_text(m.get("content"), f"{where}.content")
        reasoning = m.get("reasoning") if m.get("reasoning") is not None else m.get("reasoning_content")
        # Ollama's thinking field (and DeepSeek's reasoning_content): past thinking
        thinking = reasoning if role == "assistant" and isinstance(reasoning, str) else ""
        tool_calls = tuple(_tool_call(c, f"{where}.tool_calls[{j}]") for j, c in enumerate(calls or ()))
        for c, t in zip(calls or (), tool_calls, strict=True):
            if isinstance(c.get("id"), str):
                names[c["id"]] = t.name
        call_id, name = "", ""
        if role == "tool":
            call_id = get(m, "tool_call_id", "str", where=f"{where}.") or ""
            name = get(m, "name", "str", where=f"{where}.") or names.get(call_id) or ""
        out.append(
            Message(
                role=role,
                content=text,
                thinking=thinking,
                images=tuple(images),
                tool_calls=tool_calls,
                tool_name=name,
                tool_call_id=call_id,
            )
        )
    return out


def _tool_call(call: Any, where: str) -> ToolCall:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise BadParam(where, f"'{where}' must have a function with a name")
    args = fn.get("arguments") or "{}"
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            raise BadParam(f"{where}.function.arguments", "tool call arguments must be a JSON object string") from None
    if not isinstance(args, dict):
        raise BadParam(f"{where}.function.arguments", "tool call arguments must be a JSON object string")
    return ToolCall(name=fn["name"], arguments=args, id=call["id"] if isinstance(call.get("id"), str) else "")


def _format(body: dict[str, Any]) -> Any:
    rf = get(body, "response_format", "dict")
    if not rf:
        return None
    kind = rf.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return "json"
    if kind == "json_schema":
        spec = rf.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise BadParam(
                "response_format.json_schema.schema",
                "'response_format.json_schema.schema' must be a JSON schema object",
            )
        return schema
    raise BadParam(
        "response_format.type", f"unsupported response_format type {kind!r}: use text, json_object or json_schema"
    )


def _tools(body: dict[str, Any]) -> tuple[list[dict[str, Any]] | None, Any]:
    """The tools to offer, and a format that forces a call when tool_choice asks for one."""
    tools = get(body, "tools", "list")
    choice = body.get("tool_choice")
    if not tools and (choice == "required" or isinstance(choice, dict)):
        raise BadParam("tool_choice", "'tool_choice' asks for a tool call, but no 'tools' are given")
    if not tools or choice == "none":
        return None, None
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or not isinstance((t.get("function") or {}).get("name"), str):
            raise BadParam(
                f"tools[{i}]",
                f'\'tools[{i}]\' must be {{"type": "function", "function": {{"name": ..., "parameters": ...}}}}',
            )
    forced: list[dict[str, Any]] = []
    if choice == "required":
        forced = tools
    elif isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name")
        forced = [t for t in tools if t["function"]["name"] == name]
        if not forced:
            raise BadParam("tool_choice", f"tool_choice names {name!r}, which is not among the tools")
    elif choice not in (None, "auto"):
        raise BadParam("tool_choice", "'tool_choice' must be none, auto, required or a function")
    return tools, (pipeline.call_schema(forced) if forced else None)


# -- response translation -------------------------------------------------------------------------------------
def _reason(final: Finished | None) -> str | None:
    return final.done_reason if final is not None else None


def _finish(done_reason: str | None, tool_calls: bool) -> str:
    if tool_calls:
        return "tool_calls"
    return "length" if done_reason == "length" else "stop"


def _openai_calls(calls: list[ToolCall], *, with_index: bool = False) -> list[dict[str, Any]]:
    out = []
    for c in calls:
        item: dict[str, Any] = {
            "id": c.id or _id("call"),
            "type": "function",
            "function": {"name": c.name, "arguments": json.dumps(c.arguments, ensure_ascii=False)},
        }
        if with_index:
            item = {"index": c.index, **item}
        out.append(item)
    return out


def _openai_logprobs(entries: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "content": [
            {
                "token": e["token"],
                "logprob": e["logprob"],
                "bytes": e.get("bytes"),
                "top_logprobs": [
                    {"token": t["token"], "logprob": t["logprob"], "bytes": t.get("bytes")}
                    for t in e.get("top_logprobs") or []
                ],
            }
            for e in entries
        ]
    }


def _usage(final: Finished | None) -> dict[str, Any]:
    """OpenAI's usage. prompt_tokens counts every prompt token (as Ollama); of them, cached_tokens were found in
    the runner's KV cache (or restored from RAM) and not evaluated again, as OpenAI reports its prompt caching.
    With speculative decoding asked for, ``draft_n`` and ``draft_n_accepted`` (llama-server's names) too."""
    final = final or Finished("stop")
    p, c = final.prompt_eval_count, final.eval_count
    return {
        "prompt_tokens": p,
        "completion_tokens": c,
        "total_tokens": p + c,
        "prompt_tokens_details": {"cached_tokens": final.prompt_cached},
        **final.drafts(),
    }


def _logprob_request(body: dict[str, Any]) -> tuple[bool, int]:
    want = bool(get(body, "logprobs", "bool"))
    top = get(body, "top_logprobs", "int", lo=0, hi=20)
    if top is not None and not want:
        raise BadParam("top_logprobs", "'top_logprobs' needs 'logprobs': true")
    return want, top or 0


def _completion_logprobs(entries: list[dict[str, Any]], offset: int) -> dict[str, Any]:
    """The legacy completions ``logprobs`` object; ``offset`` is where the first token starts in the text."""
    tokens, values, tops, offsets = [], [], [], []
    for e in entries:
        tokens.append(e["token"])
        values.append(e["logprob"])
        tops.append({t["token"]: t["logprob"] for t in e.get("top_logprobs") or []})
        offsets.append(offset)
        offset += len(e["token"])
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


def openai_stream(frames: AsyncGenerator[bytes, None], rest: AsyncIterator[Any]) -> AsyncIterator[bytes]:
    """OpenAI's SSE body: an error after the first event is an error event; ``data: [DONE]`` ends it."""
    return guarded(
        frames,
        rest,
        lambda message: sse_data({"error": {"message": message, "type": "api_error", "param": None, "code": None}}),
        b"data: [DONE]\n\n",
    )


def _usage_of(finals: list[Finished | None]) -> dict[str, Any]:
    """Usage over every choice: the prompt counted once, the completion tokens of all choices summed."""
    usage = _usage(finals[0])
    completion = sum(f.eval_count for f in finals if f is not None)
    usage["completion_tokens"] = completion
    usage["total_tokens"] = usage["prompt_tokens"] + completion
    drafts = [f.drafts() for f in finals if f is not None and f.drafts()]
    if drafts:  # drafted per choice: summed, as the completion tokens are
        usage["draft_n"] = sum(d["draft_n"] for d in drafts)
        usage["draft_n_accepted"] = sum(d["draft_n_accepted"] for d in drafts)
    return usage


def _blame_logit_bias(exc: CorralError) -> None:
    """The runner's check of logit_bias's ids against the vocabulary names the parameter (OpenAI's ``param``)."""
    if "logit_bias" in str(exc):
        exc.param = "logit_bias"  # type: ignore[attr-defined]


# -- /v1/chat/completions -------------------------------------------------------------------------------------
@router.post("/v1/chat/completions")
@shaped(openai_error)
async def chat_completions(request: Request) -> Response:
    started, body, model = await begin(request)
    messages = _messages(body)
    opts, bias = _options(body)
    tools, forced = _tools(body)
    fmt = forced if forced is not None else _format(body)
    want_logprobs, top = _logprob_request(body)
    stream = bool(get(body, "stream", "bool"))
    include_usage = bool((get(body, "stream_options", "dict") or {}).get("include_usage"))
    n = _choice_count(body)
    one_call = get(body, "parallel_tool_calls", "bool") is False  # at most one tool call per choice
    call = ChatCall(
        model=model,
        messages=tuple(messages),
        tools=tuple(Tool.of(t) for t in tools or ()),
        options=opts,
        format=fmt,
        logprobs=want_logprobs,
        top_logprobs=top,
        keep_alive=keep_alive_of(body),
        think=think_of(body),
        logit_bias=bias,
    )
    # as Ollama: an effort asked of a model that cannot think is ignored (relax_think)
    choices = await chat_choices(
        inference(request), call, n, started, relax_think=True, on_first_error=_blame_logit_bias
    )
    cid, created = _id("chatcmpl"), int(time.time())
    if not stream:
        return JSONResponse(await _chat_whole(choices, n, cid, created, model, want_logprobs, one_call))
    return sse_response(
        openai_stream(_chat_events(choices, n, cid, created, model, want_logprobs, include_usage, one_call), choices)
    )


async def _chat_whole(
    choices: AsyncGenerator[tuple[int, Event], None],
    n: int,
    cid: str,
    created: int,
    model: str,
    want_logprobs: bool,
    one_call: bool,
) -> dict[str, Any]:
    texts = [""] * n
    reasoning = [""] * n
    calls: list[list[ToolCall]] = [[] for _ in range(n)]
    lps: list[list[dict[str, Any]]] = [[] for _ in range(n)]
    last: list[Finished | None] = [None] * n
    try:
        async for i, event in choices:
            if isinstance(event, Content):
                texts[i] += event.text
                lps[i] += event.logprobs
            elif isinstance(event, Thinking):
                reasoning[i] += event.text
            elif isinstance(event, ToolCalls):
                calls[i] += event.calls
            else:
                last[i] = event
    finally:
        await choices.aclose()
    out = []
    for i in range(n):
        message: dict[str, Any] = {"role": "assistant", "content": texts[i]}
        if reasoning[i]:
            message["reasoning"] = reasoning[i]  # Ollama's field for the thinking
        kept = calls[i][:1] if one_call else calls[i]
        if kept:
            message["tool_calls"] = _openai_calls(kept)
        out.append(
            {
                "index": i,
                "message": message,
                "finish_reason": _finish(_reason(last[i]), bool(kept)),
                "logprobs": _openai_logprobs(lps[i]) if want_logprobs else None,
            }
        )
    return {
        "id": cid,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "system_fingerprint": FINGERPRINT,
        "choices": out,
        "usage": _usage_of(last),
    }


async def _chat_events(
    choices: AsyncGenerator[tuple[int, Event], None],
    n: int,
    cid: str,
    created: int,
    model: str,
    want_logprobs: bool,
    include_usage: bool,
    one_call: bool,
) -> AsyncGenerator[bytes, None]:
    def frame(
        i: int, delta: dict[str, Any], finish: str | None = None, lps: tuple[dict[str, Any], ...] = ()
    ) -> dict[str, Any]:
        choice: dict[str, Any] = {
            "index": i,
            "delta": delta,
            "finish_reason": finish,
            "logprobs": _openai_logprobs(list(lps)) if (want_logprobs and lps) else None,
        }
        return {
            "id": cid,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
            "system_fingerprint": FINGERPRINT,
            "choices": [choice],
        }

    any_calls = [False] * n
    sent_role = [False] * n
    finals: dict[int, Finished] = {}
    async for i, event in choices:
        if isinstance(event, Finished):
            finals[i] = event
            yield sse_data(frame(i, {}, _finish(event.done_reason, any_calls[i])))
            continue
        if isinstance(event, ToolCalls) and one_call and any_calls[i]:
            continue
        delta: dict[str, Any] = {} if sent_role[i] else {"role": "assistant"}
        sent_role[i] = True
        if isinstance(event, Content):
            delta["content"] = event.text
            yield sse_data(frame(i, delta, None, event.logprobs))
        elif isinstance(event, Thinking):
            delta["content"] = ""
            delta["reasoning"] = event.text  # Ollama's field for streamed thinking
            yield sse_data(frame(i, delta))
        else:
            any_calls[i] = True
            delta["content"] = ""
            delta["tool_calls"] = _openai_calls(list(event.calls[:1] if one_call else event.calls), with_index=True)
            yield sse_data(frame(i, delta))
    if include_usage and finals:
        yield sse_data(
            {
                "id": cid,
                "object": "chat.completion.chunk",
                "created": created,
                "model": model,
                "system_fingerprint": FINGERPRINT,
                "choices": [],
                "usage": _usage_of([finals.get(i) for i in sorted(finals)]),
            }
        )


# -- /v1/completions ------------------------------------------------------------------------------------------
@router.post("/v1/completions")
@shaped(openai_error)
async def completions(request: Request) -> Response:
    started, body, model = await begin(request)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise BadParam("prompt", "'prompt' must be a string (one prompt per request)")
    echo = bool(get(body, "echo", "bool"))
    stream = bool(get(body, "stream", "bool"))
    include_usage = bool((get(body, "stream_options", "dict") or {}).get("include_usage"))
    top = get(body, "logprobs", "int", lo=0, hi=20)
    n = _choice_count(body)
    best_of = get(body, "best_of", "int", lo=1)
    if best_of is not None and best_of > n:
        raise BadParam(
            "best_of",
            "'best_of' above 'n' is not supported: corral returns every choice it generates; "
            "ask for n choices (each with its logprobs if you want them) and pick yourself",
        )
    opts, bias = _options(body)
    call = GenerateCall(
        model=model,
        prompt=prompt,
        suffix=get(body, "suffix", "str") or "",
        options=opts,
        raw=bool(get(body, "raw", "bool")),
        keep_alive=keep_alive_of(body),
        logprobs=top is not None,
        top_logprobs=top or 0,
        logit_bias=bias,
    )
    choices = await generate_choices(inference(request), call, n, started, on_first_error=_blame_logit_bias)
    out = _Completion(model, prompt if echo else "", top is not None, n)
    if not stream:
        return JSONResponse(await out.whole(choices))
    return sse_response(openai_stream(out.events(choices, include_usage), choices))


class _Completion:
    """One ``text_completion`` reply of ``n`` choices, whole or as SSE chunks; ``echoed`` is the prompt when echo
    is on."""

    def __init__(self, model: str, echoed: str, logprobs: bool, n: int = 1) -> None:
        self.id, self.created, self.model = _id("cmpl"), int(time.time()), model
        self.echoed, self.logprobs, self.n = echoed, logprobs, n
        # where each choice's next token starts in its whole text (logprobs' text_offset)
        self.offsets = [len(echoed)] * n

    def obj(self, i: int, text: str, finish: str | None, lps: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        logprobs = None
        if self.logprobs:
            logprobs = _completion_logprobs(lps or [], self.offsets[i])
            self.offsets[i] += sum(len(t) for t in logprobs["tokens"])
        return {
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "system_fingerprint": FINGERPRINT,
            "choices": [{"text": text, "index": i, "logprobs": logprobs, "finish_reason": finish}],
        }

    async def whole(self, choices: AsyncGenerator[tuple[int, Event], None]) -> dict[str, Any]:
        texts = [self.echoed] * self.n
        lps: list[list[dict[str, Any]]] = [[] for _ in range(self.n)]
        last: list[Finished | None] = [None] * self.n
        try:
            async for i, event in choices:
                if isinstance(event, Content):
                    texts[i] += event.text
                    lps[i] += event.logprobs
                elif isinstance(event, Finished):
                    last[i] = event
        finally:
            await choices.aclose()
        out = [self.obj(i, texts[i], _finish(_reason(last[i]), False), lps[i])["choices"][0] for i in range(self.n)]
        return {**self.obj(0, "", None), "choices": out, "usage": _usage_of(last)}

    async def events(
        self, choices: AsyncGenerator[tuple[int, Event], None], include_usage: bool
    ) -> AsyncGenerator[bytes, None]:
        if self.echoed:
            for i in range(self.n):
                yield sse_data(self.obj(i, self.echoed, None))
        finals: dict[int, Finished] = {}
        async for i, event in choices:
            if isinstance(event, Finished):
                finals[i] = event
                yield sse_data(self.obj(i, "", _finish(event.done_reason, False)))
            elif isinstance(event, Content):
                yield sse_data(self.obj(i, event.text, None, list(event.logprobs)))
        if include_usage and finals:
            yield sse_data(
                {**self.obj(0, "", None), "choices": [], "usage": _usage_of([finals.get(i) for i in sorted(finals)])}
            )


# -- /v1/embeddings -------------------------------------------------------------------------------------------
@router.post("/v1/embeddings")
@shaped(openai_error)
async def embeddings(request: Request) -> Response:
    started, body, model = await begin(request)
    raw = body.get("input")
    if isinstance(raw, str):
        inputs = [raw]
    elif isinstance(raw, list) and raw and all(isinstance(x, str) for x in raw):
        inputs = list(raw)
    else:
        raise BadParam(
            "input", "'input' must be a non-empty string or array of strings (token arrays are not accepted; send text)"
        )
    encoding = (get(body, "encoding_format", "str") or "float").lower()
    if encoding not in ("float", "base64"):
        raise BadParam("encoding_format", "'encoding_format' must be float or base64")
    dims = get(body, "dimensions", "int", lo=1)
    req = parse_model(
        EmbedRequestBody,
        {
            "model": model,
            "input": inputs,
            "dimensions": dims,
            "options": get(body, "options", "dict"),
            "keep_alive": body.get("keep_alive"),
        },
    )
    result = await run_embed(inference(request), req.call(), started)
    data = []
    for i, vec in enumerate(result.get("embeddings") or []):
        value: Any = vec
        if encoding == "base64":
            value = base64.b64encode(struct.pack(f"<{len(vec)}f", *vec)).decode()
        data.append({"object": "embedding", "embedding": value, "index": i})
    tokens = int(result.get("prompt_eval_count") or 0)
    return JSONResponse(
        {"object": "list", "data": data, "model": model, "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
    )


# -- /v1/models -----------------------------------------------------------------------------------------------
def _model_entry(m: Any) -> dict[str, Any]:
    """OpenAI's model object for a :class:`registry.store.StoredModel`."""
    return {"id": m.name.short(), "object": "model", "created": int(m.modified_at), "owned_by": m.name.namespace}


@router.get("/v1/models")
@shaped(openai_error)
async def list_models(request: Request) -> Response:
    models = request.app.state.store.list_models()
    return JSONResponse({"object": "list", "data": [_model_entry(m) for m in models]})


@router.get("/v1/models/{model:path}")
@shaped(openai_error)
async def get_model(model: str, request: Request) -> Response:
    note(model=model)
    return JSONResponse(_model_entry(request.app.state.catalog.get(model)))  # or ModelNotFound
