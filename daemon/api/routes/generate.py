"""``POST /api/generate`` and ``POST /api/chat``: prompts in, tokens streamed out as NDJSON."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse

from daemon import logs
from daemon.api.bodies import read_model
from daemon.api.errors import error_response
from daemon.api.observe import note
from daemon.api.schemas import ChatMessage, ChatRequestBody, GenerateRequestBody, InferenceRequest
from daemon.api.streaming import NDJSON, LiveStream, ndjson_line
from daemon.chat import media, pipeline
from daemon.chat.pipeline import ChatModel, EventStream
from daemon.chat.types import Content, Event, Finished, Message, Thinking, ThinkValue, Tool, ToolCall, ToolCalls
from daemon.generation.inference import Inference, ModelContext, keep_alive_value, now_rfc3339
from daemon.runners.base import Done, GenerateRequest, RunnerCrashed, SampleParams, Token, Truncated
from daemon.scheduling.scheduler import Lease
from daemon.templates import prompt as prompts
from errors import CorralError, InvalidRequest, ModelNotFound

log = logging.getLogger(__name__)
router = APIRouter()


def inference(request: Request) -> Inference:
    return request.app.state.inference


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


def _check_common(req: InferenceRequest) -> None:
    if req.top_logprobs < 0 or req.top_logprobs > 20:
        raise InvalidRequest("top_logprobs must be between 0 and 20")


def _check_images(ctx: ModelContext, images: list[str] | None) -> None:
    if images and "vision" not in ctx.capabilities:
        raise InvalidRequest(
            f'"{ctx.raw}" does not support images: it has no vision projector; remove "images" or use a vision model'
        )


def _think(ctx: ModelContext, think: Any, *, relax: bool = False) -> ThinkValue:
    """The request's ``think`` checked; unset on a model that can think means on, as in Ollama. ``relax``: asking a
    model that cannot think to think is ignored rather than refused (the OpenAI and Anthropic layers, as Ollama does
    for Claude Code, which asks every model to think)."""
    if relax and "thinking" not in ctx.capabilities and pipeline.normalise_think(think) not in (None, False):
        think = None
    pipeline.check_think(ctx.capabilities, ctx.raw, think)
    value = pipeline.normalise_think(think)
    if value is None and "thinking" in ctx.capabilities:
        return True
    return value


def _finished(done: Done, started: float, lease: Lease, *, context: tuple[int, ...] | None = None) -> Finished:
    note(
        model=lease.ref.name,
        prompt_eval_count=done.prompt_eval_count,
        prompt_cached=done.prompt_cached,
        eval_count=done.eval_count,
        eval_duration=done.eval_duration,
        ttft=lease.load_duration + done.prompt_eval_duration / 1e9,
    )
    return Finished(
        done_reason=done.done_reason,
        prompt_eval_count=done.prompt_eval_count,
        prompt_eval_duration=done.prompt_eval_duration,
        eval_count=done.eval_count,
        eval_duration=done.eval_duration,
        total_duration=int((time.monotonic() - started) * 1e9),
        load_duration=int(lease.load_duration * 1e9),
        prompt_cached=done.prompt_cached,
        stop_sequence=done.stop_sequence,
        context=context,
    )


async def _stream_tokens(lease: Lease, greq: GenerateRequest) -> AsyncIterator[Token | Done | Truncated]:
    """The runner's events, with the lease held until the last one (or until the client leaves). A runner that
    dies by a signal on its first decode, before anything was sent, is loaded again one step safer and the request
    runs again there (daemon/scheduling/fallback.py): the user sees an answer, not the crash."""
    try:
        while True:
            sent = False
            gen = lease.runner.generate(greq)
            try:
                async for event in gen:
                    sent = sent or not isinstance(event, Truncated)  # a cut is said before anything is evaluated
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


async def _events(
    lease: Lease, greq: GenerateRequest, stream: EventStream, started: float, *, with_context: bool = False
) -> AsyncIterator[Event]:
    """One generation as typed events: the runner's pieces through the output parser, then Finished. A prompt
    the runner cut to fit the context is logged here (once, even when a crashed runner's retry cuts it again)."""
    told = False
    async for item in _stream_tokens(lease, greq):
        if isinstance(item, Token):
            for event in stream.add(item.text, (item.logprobs,) if item.logprobs is not None else ()):
                yield event
        elif isinstance(item, Truncated):
            if not told:
                told = True
                log_prompt_cut(lease.ref.name, item)
        else:
            for event in stream.add("", done=True):
                yield event
            yield _finished(item, started, lease, context=tuple(item.context) if with_context else None)


class Run:
    """A started generation: its events (an async iterator; ``aclose()`` stops it) and, when asked for, the
    prompt's length in tokens (Anthropic's message_start says it before the first event): ``counting`` is the
    runner's tokenization of the prompt, asked for alongside the generation rather than before it, so that its
    round trip to the runner is not on the way to the first token; :meth:`prompt_count` waits for it."""

    def __init__(self, events: AsyncIterator[Event], counting: asyncio.Future[list[int]] | None = None) -> None:
        self.events = events
        self._counting = counting

    async def prompt_count(self) -> int | None:
        """The prompt's length in tokens (None when it was not asked for). If the runner could not count it, the
        generation is stopped and the error raised (an error answer, as when the count came first)."""
        if self._counting is None:
            return None
        try:
            return len(await self._counting)
        except BaseException:
            await self.aclose()
            raise

    def __aiter__(self) -> AsyncIterator[Event]:
        return self.events

    async def __anext__(self) -> Event:
        return await self.events.__anext__()

    async def aclose(self) -> None:
        if self._counting is not None:
            self._counting.cancel()  # nothing once it is done
        await self.events.aclose()  # type: ignore[attr-defined]


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
) -> tuple[dict[str, Any] | None, Run | None]:
    """Check ``req`` and start it: ``(final, None)`` for a load or unload (Ollama's object), else ``(None, run)``.
    Errors before the first event raise."""
    note(model=req.model_name)
    _check_common(req)
    _model_name_or_error(req.model_name, empty_is_404=True)
    ctx = await inf.lookup(req.model_name)
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
    think = _think(ctx, req.think)
    _check_images(ctx, req.images)
    opts = inf.options(ctx, req.options)
    params = _with_logprobs(inf.sample_params(opts, req.format), req)

    if req.prompt == "" and not req.suffix:
        await _load_only(inf, ctx, keep_alive, opts)
        return {**base, "created_at": now_rfc3339(), "response": "", "done": True, "done_reason": "load"}, None

    chat = ctx.chat if not req.template else ChatModel(template=req.template)
    parser, _, _ = pipeline.output_parser(chat, tools=None, last=None, think=think, raw=req.raw)
    images = {
        i: base64.b64encode(media.decode_image(img, f"images[{i}]")).decode() for i, img in enumerate(req.images or [])
    }
    if req.raw:
        text = req.prompt
        if images and not any(f"[img-{i}]" in text for i in images):
            text = "".join(f"[img-{i}]" for i in images) + text  # where a raw prompt does not say, in front
    else:
        system = req.system if req.system is not None else ctx.system
        history = [] if req.context else ctx.messages
        text = await prompts.offload(  # off the event loop, bounded in time and memory (daemon/templates/prompt.py)
            prompts.render_generate,
            chat.template,
            chat.chat_template,
            prompt=req.prompt,
            system=system,
            suffix=req.suffix or None,
            messages_history=history,
            images=list(images.values()) or None,
            think=think,
        )
    if inf.settings.log_prompts:
        note(prompt=text)
    if not req.raw:
        pipeline.rendered(parser, chat, text)
    text, ordered = media.media_prompt(text, images)
    greq = GenerateRequest(
        prompt=text,
        params=params,
        context=tuple(req.context or ()),
        shift=req.shift,
        truncate=req.truncate,
        images=ordered,
    )
    lease = await inf.acquire(ctx, inf.load_spec(ctx, opts), keep_alive)
    return None, Run(_events(lease, greq, EventStream(parser, None), started, with_context=not req.raw))


def _with_logprobs(params: SampleParams, req: InferenceRequest) -> SampleParams:
    return dataclasses.replace(params, logprobs=req.top_logprobs) if req.logprobs else params


@router.post("/api/generate")
async def generate(request: Request) -> Response:
    started = time.monotonic()
    req = await read_model(request, GenerateRequestBody)
    final, run = await run_generate(inference(request), req, started)
    if final is not None:
        return JSONResponse(final)
    assert run is not None
    return await respond(ollama_chunks(run, req.model_name, chat=False), stream=req.stream, text_key="response")


# -- chat ---------------------------------------------------------------------------------------------------------
def message_dict(m: ChatMessage) -> Message:
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


def build_messages(ctx: ModelContext, request_messages: list[Message]) -> list[Message]:
    msgs = [Message(role=m["role"], content=m["content"]) for m in ctx.messages] + request_messages
    if ctx.system and (not request_messages or request_messages[0].role != "system"):
        msgs.insert(0, Message(role="system", content=ctx.system))
    return pipeline.strip_past_thinking(ctx.chat, msgs)


TRUNCATE_SECONDS = 30.0  # the most fitting one chat into its context may take
RAISE_CONTEXT = "raise num_ctx (request options or a Modelfile PARAMETER) or CORRAL_CONTEXT_LENGTH to keep it whole"


def log_prompt_cut(model: str, cut: Truncated) -> None:
    """Say, at INFO, that the runner cut a prompt to fit the context (Ollama's "truncating input prompt")."""
    log.info(
        "truncating input prompt model=%s num_ctx=%d prompt_tokens=%d kept_tokens=%d num_keep=%d "
        "(the first num_keep tokens and the last %d were kept; %s)",
        logs.quote(model),
        cut.num_ctx,
        cut.prompt_tokens,
        cut.kept_tokens,
        cut.num_keep,
        cut.kept_tokens - cut.num_keep,
        RAISE_CONTEXT,
    )


async def render_chat(
    lease: Lease,
    ctx: ModelContext,
    msgs: list[Message],
    tools: Sequence[Tool] | None,
    num_ctx: int,
    truncate: bool,
    think: Any,
) -> str:
    """Render, dropping the oldest non-system messages until the prompt fits num_ctx (the last always stays; with
    none left to drop, the shortest prompt is used). How many to drop is found by binary search, so a long chat
    takes O(log n) renders and tokenizations rather than n, each render in a worker thread (prompts.offload); the
    prompt is the one dropping them one at a time gives, as the prompt never grows when a message is dropped.
    Messages dropped are logged at INFO (Ollama logs it only at debug level); what is still too long after that,
    the runner cuts (and that is logged too: :func:`log_prompt_cut`)."""

    async def render(kept: list[Message]) -> str:
        return await prompts.offload(pipeline.render, ctx.chat, kept, tools, pipeline.normalise_think(think))

    text = await render(msgs)
    if not truncate:
        return text
    droppable = [i for i, m in enumerate(msgs[:-1]) if m.role != "system"]
    if not droppable:
        return text
    total = len(await lease.runner.tokenize(text))
    if total <= num_ctx:
        return text
    deadline = time.monotonic() + TRUNCATE_SECONDS

    def without(k: int) -> list[Message]:
        gone = set(droppable[:k])
        return [m for i, m in enumerate(msgs) if i not in gone]

    lo, hi = 1, len(droppable)  # the fewest drops that fit lie in [lo, hi] (hi: all of them, fitting or not)
    fitting: tuple[int, str, int] | None = None
    while lo < hi:
        if time.monotonic() > deadline:
            raise InvalidRequest(
                f"fitting {len(msgs)} messages into the context (num_ctx {num_ctx}) took longer "
                f"than {TRUNCATE_SECONDS:g}s; send fewer or shorter messages"
            )
        mid = (lo + hi) // 2
        text = await render(without(mid))
        n = len(await lease.runner.tokenize(text))
        if n <= num_ctx:
            hi, fitting = mid, (mid, text, n)
        else:
            lo = mid + 1
    if fitting is not None and fitting[0] == lo:
        text, kept = fitting[1], fitting[2]
    else:  # all of them dropped (whether that fits is known only for a single droppable message)
        text = await render(without(lo))
        kept = len(await lease.runner.tokenize(text))
    model = getattr(getattr(lease, "ref", None), "name", None) or getattr(ctx, "raw", "")
    log.info(
        "truncating input messages model=%s num_ctx=%d messages=%d prompt_tokens=%d kept_messages=%d "
        "kept_tokens=%d (the %d oldest non-system messages were dropped; %s)",
        logs.quote(model),
        num_ctx,
        len(msgs),
        total,
        len(msgs) - lo,
        kept,
        lo,
        RAISE_CONTEXT,
    )
    return text


async def run_chat(
    inf: Inference,
    req: ChatRequestBody,
    started: float,
    *,
    count_prompt: bool = False,
    relax_think: bool = False,
) -> tuple[dict[str, Any] | None, Run | None]:
    """Check ``req`` and start it: ``(final, None)`` for a load or unload (Ollama's object), else ``(None, run)``.
    Errors before the first event raise. ``count_prompt``: have the runner count the prompt's tokens alongside the
    generation (``await run.prompt_count()``; for a stream that must say it before the end, as Anthropic's
    message_start does). ``relax_think``: see :func:`_think`.

    With ``format`` on a model that thinks, the answer is constrained only after the thinking (as newest Ollama
    does): the model thinks freely; at the first answer text the generation stops and starts again from the prompt
    plus the thinking, now under the format's grammar. The events of both parts are one run."""
    note(model=req.model_name)
    _check_common(req)
    _model_name_or_error(req.model_name, empty_is_404=False)
    ctx = await inf.lookup(req.model_name)
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
    think = _think(ctx, req.think, relax=relax_think)
    request_messages = [message_dict(m) for m in req.messages]
    _check_images(ctx, [img for m in request_messages for img in m.images])
    opts = inf.options(ctx, req.options)
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

    msgs, images = media.number_images(build_messages(ctx, request_messages))
    forced = bool(req.tools) and pipeline.is_call_schema(req.format)
    declared = [Tool.of(t) for t in req.tools or ()]
    parser, thinks, tools = pipeline.output_parser(
        ctx.chat, tools=declared, last=msgs[-1], think=think, forced_call=forced
    )
    lease = await inf.acquire(ctx, spec, keep_alive)
    try:
        text = await render_chat(lease, ctx, msgs, tools or None, spec.num_ctx, req.truncate, think)
    except BaseException:
        lease.release()
        raise
    pipeline.rendered(parser, ctx.chat, text)
    if inf.settings.log_prompts:
        note(prompt=text)
    prompt_text = text
    text, ordered = media.media_prompt(text, images)
    defer_format = req.format is not None and req.format != "" and thinks
    params = _with_logprobs(inf.sample_params(opts, None if defer_format else req.format), req)
    greq = GenerateRequest(prompt=text, params=params, shift=req.shift, truncate=req.truncate, images=ordered)
    first = _events(lease, greq, EventStream(parser, declared), started)
    # counted by the runner while it starts generating (the lease is held until the generation ends or is closed)
    prompt_count = asyncio.ensure_future(lease.runner.tokenize(prompt_text)) if count_prompt else None
    if prompt_count is not None:  # a count nobody waits for (the generation failed first) is not an error to log
        prompt_count.add_done_callback(lambda f: f.cancelled() or f.exception())
    if not defer_format:
        return None, Run(first, prompt_count)

    async def thinking_then_format() -> AsyncIterator[Event]:
        thought: list[str] = []
        try:
            async for event in first:
                if isinstance(event, Content) and event.text.strip() or isinstance(event, ToolCalls):
                    break  # the answer begins: stop here and answer again under the format
                if isinstance(event, Thinking):
                    thought.append(event.text)
                yield event
            else:
                return  # it only thought (or stopped): nothing to constrain
        finally:
            await first.aclose()  # type: ignore[attr-defined]
        again = [*msgs, Message(role="assistant", thinking="".join(thought))] if thought else msgs
        # the thinking is over: the parser starts in the answer (the prompt is rendered with the request's think)
        parser2, _, tools2 = pipeline.output_parser(
            ctx.chat, tools=declared, last=again[-1], think=False, forced_call=forced
        )
        lease2 = await inf.acquire(ctx, spec, keep_alive)
        try:
            text2 = await render_chat(lease2, ctx, again, tools2 or None, spec.num_ctx, req.truncate, think)
        except BaseException:
            lease2.release()
            raise
        if thought:
            text2 += pipeline.answer_after_thinking(ctx.chat)  # past the thinking, into the answer
        text2, ordered2 = media.media_prompt(text2, images)
        greq2 = GenerateRequest(
            prompt=text2,
            images=ordered2,
            params=_with_logprobs(inf.sample_params(opts, req.format), req),
            shift=req.shift,
            truncate=req.truncate,
        )
        async for event in _events(lease2, greq2, EventStream(parser2, declared), started):
            yield event

    return None, Run(thinking_then_format(), prompt_count)


@router.post("/api/chat")
async def chat(request: Request) -> Response:
    started = time.monotonic()
    req = await read_model(request, ChatRequestBody)
    final, run = await run_chat(inference(request), req, started)
    if final is not None:
        return JSONResponse(final)
    assert run is not None
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
                if chat:
                    final["message"][text_key] = ""
                yield final
    finally:
        await run.aclose()
