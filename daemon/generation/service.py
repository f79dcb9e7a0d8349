"""The generation service: what every dialect's chat and generate calls run through, between the routes (which
parse and shape the wire) and :mod:`daemon.generation.inference` (model lookup, options, load specs, leases).

A call (:mod:`daemon.generation.calls`) is checked against the model (capabilities, think, images), its prompt
rendered (a chat fitted into num_ctx: :mod:`daemon.generation.fitting`), and a scheduler lease held while the runner
generates; a runner that crashes before its first token is loaded again one step safer and the call runs again
there. The runner's pieces become typed chat events (:mod:`daemon.chat.types`) through the model's output parser.
With ``format`` on a model that thinks, the answer is constrained only after the thinking (thinking, then format).
The routes shape the events into their dialect; n choices of one call: :mod:`daemon.generation.choices`."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from daemon.chat import media, pipeline
from daemon.chat.pipeline import ChatModel, EventStream
from daemon.chat.types import Content, Event, Finished, Message, Thinking, ThinkValue, Tool, ToolCalls
from daemon.generation.calls import Call, ChatCall, GenerateCall
from daemon.generation.fitting import log_prompt_cut, render_chat
from daemon.generation.inference import Inference, ModelContext, keep_alive_value
from daemon.logs import note, note_sum
from daemon.runners.base import Done, GenerateRequest, LoadSpec, RunnerCrashed, SampleParams, Token, Truncated
from daemon.scheduling.scheduler import Lease
from daemon.templates import prompt as prompts
from daemon.templates.offload import offload
from errors import InvalidRequest, ModelNotFound
from modelfile.params import SPECULATIVE_DEFAULTS

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelOnly:
    """A call that only loaded the model (no prompt, no messages) or unloaded it (that, with keep_alive 0): nothing
    is generated; each dialect says so in its own shape (Ollama: ``done_reason`` "load" or "unload")."""

    done_reason: Literal["load", "unload"]


# -- checks ---------------------------------------------------------------------------------------------------
def _check_common(call: Call) -> None:
    if call.top_logprobs < 0 or call.top_logprobs > 20:
        raise InvalidRequest("top_logprobs must be between 0 and 20")


def _check_images(ctx: ModelContext, images: Sequence[str]) -> None:
    if images and "vision" not in ctx.capabilities:
        raise InvalidRequest(
            f'"{ctx.raw}" does not support images: it has no vision projector; remove "images" or use a vision model'
        )


def _think(ctx: ModelContext, think: ThinkValue, *, relax: bool = False) -> ThinkValue:
    """The call's ``think`` (normalised already) checked; unset on a model that can think means on, as in Ollama.
    ``relax``: asking a model that cannot think to think is ignored rather than refused (the OpenAI and Anthropic
    layers, as Ollama does for Claude Code, which asks every model to think)."""
    if relax and "thinking" not in ctx.capabilities and think not in (None, False):
        think = None
    pipeline.check_think(ctx.capabilities, ctx.raw, think)
    if think is None and "thinking" in ctx.capabilities:
        return True
    return think


def _model_name_or_error(raw: str, *, empty_is_404: bool) -> None:
    if not raw:
        if empty_is_404:
            raise ModelNotFound("")
        raise InvalidRequest("model is required")


def _with_logprobs(params: SampleParams, call: Call) -> SampleParams:
    return dataclasses.replace(params, logprobs=call.top_logprobs) if call.logprobs else params


def _params(inf: Inference, opts: dict[str, Any], call: Call, fmt: object) -> SampleParams:
    """The runner's sampling parameters for ``call`` under ``fmt`` (None: unconstrained)."""
    return _with_logprobs(inf.sample_params(opts, fmt, logit_bias=call.logit_bias), call)


def speculating(opts: dict[str, Any]) -> bool:
    """Whether merged options ask for speculative decoding: a draft model or prompt lookup (``draft_ngram``), with
    ``draft_max`` above 0 (0 turns it off). Such a request reports ``draft_n``/``draft_n_accepted`` even when
    nothing was drafted, so that "on, but nothing drafted" reads apart from "off"."""
    if int(opts.get("draft_max", SPECULATIVE_DEFAULTS["draft_max"]) or 0) <= 0:
        return False
    return bool(opts.get("draft_model")) or int(opts.get("draft_ngram") or 0) > 0


async def _load_only(inf: Inference, ctx: ModelContext, keep_alive: float | None, opts: dict[str, Any]) -> None:
    lease = await inf.acquire(ctx, inf.load_spec(ctx, opts), keep_alive)
    lease.release()


# -- one generation -------------------------------------------------------------------------------------------
def _finished(
    done: Done, started: float, lease: Lease, *, context: tuple[int, ...] | None = None, speculative: bool = False
) -> Finished:
    """The runner's Done as the chat core's Finished, noted for the request's log line and metrics. The draft
    counts are reported when the request asked for speculation (:func:`speculating`) or the runner drafted
    anyway; otherwise they stay None and no dialect shows them."""
    drafted = speculative or done.draft_n > 0
    draft_n = done.draft_n if drafted else None
    draft_n_accepted = done.draft_n_accepted if drafted else None
    note(
        model=lease.ref.name,
        prompt_eval_count=done.prompt_eval_count,
        prompt_cached=done.prompt_cached,
        ttft=lease.load_duration + done.prompt_eval_duration / 1e9,
    )
    # summed over the request's generations (n choices share one prompt: its counts are noted once, not summed)
    note_sum(eval_count=done.eval_count, eval_duration=done.eval_duration)
    if drafted:
        note_sum(draft_n=done.draft_n, draft_n_accepted=done.draft_n_accepted)
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
        draft_n=draft_n,
        draft_n_accepted=draft_n_accepted,
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
    lease: Lease,
    greq: GenerateRequest,
    stream: EventStream,
    started: float,
    *,
    with_context: bool = False,
    speculative: bool = False,
) -> AsyncIterator[Event]:
    """One generation as typed events: the runner's pieces through the output parser, then Finished. A prompt
    the runner cut to fit the context is logged here (once, even when a crashed runner's retry cuts it again).
    ``speculative``: the request asked for speculative decoding (its Finished reports the draft counts)."""
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
            context = tuple(item.context) if with_context else None
            yield _finished(item, started, lease, context=context, speculative=speculative)


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


# -- generate -------------------------------------------------------------------------------------------------
async def run_generate(inf: Inference, call: GenerateCall, started: float) -> Run | ModelOnly:
    """Check ``call`` and start it: a :class:`Run`, or :class:`ModelOnly` for a load or unload. Errors before the
    first event raise."""
    note(model=call.model)
    _check_common(call)
    _model_name_or_error(call.model, empty_is_404=True)
    ctx = await inf.lookup(call.model)
    keep_alive = keep_alive_value(call.keep_alive)

    if call.prompt == "" and not call.suffix and keep_alive == 0 and call.keep_alive is not None:
        await inf.scheduler.stop(ctx.ref.key)
        return ModelOnly("unload")
    if call.raw and (call.template or call.system or call.context):
        raise InvalidRequest("raw mode does not support template, system, or context")
    if "completion" not in ctx.capabilities:
        raise InvalidRequest(f'"{call.model}" does not support generate')
    if call.suffix and "insert" not in ctx.capabilities:
        raise InvalidRequest(f"{ctx.name} does not support insert")
    think = _think(ctx, call.think)
    _check_images(ctx, call.images)
    opts = inf.options(ctx, call.options)
    params = _params(inf, opts, call, call.format)

    if call.prompt == "" and not call.suffix:
        await _load_only(inf, ctx, keep_alive, opts)
        return ModelOnly("load")

    chat = ctx.chat if not call.template else ChatModel(template=call.template)
    parser, _, _ = pipeline.output_parser(chat, tools=None, last=None, think=think, raw=call.raw)
    images = {
        i: base64.b64encode(media.decode_image(img, f"images[{i}]")).decode() for i, img in enumerate(call.images)
    }
    if call.raw:
        text = call.prompt
        if images and not any(f"[img-{i}]" in text for i in images):
            text = "".join(f"[img-{i}]" for i in images) + text  # where a raw prompt does not say, in front
    else:
        system = call.system if call.system is not None else ctx.system
        history = [] if call.context else [Message(role=m["role"], content=m["content"]) for m in ctx.messages]
        text = await offload(  # off the event loop, bounded in time and memory (daemon/templates/)
            prompts.render_generate,
            chat.template,
            chat.chat_template,
            prompt=call.prompt,
            system=system,
            suffix=call.suffix or None,
            messages_history=history,
            images=list(images.values()) or None,
            think=think,
        )
    if inf.settings.log_prompts:
        note(prompt=text)
    if not call.raw:
        pipeline.rendered(parser, chat, text)
    text, ordered = media.media_prompt(text, images)
    adapters = inf.adapters_for(ctx, opts)  # LoRA adapters, applied by the base's runner to this sequence
    greq = GenerateRequest(
        prompt=text,
        params=params,
        context=call.context,
        shift=call.shift,
        truncate=call.truncate,
        images=ordered,
        adapters=adapters,
    )
    lease = await inf.acquire(ctx, inf.load_spec(ctx, opts), keep_alive, adapters=adapters)
    events = _events(
        lease, greq, EventStream(parser, None), started, with_context=not call.raw, speculative=speculating(opts)
    )
    return Run(events)


# -- chat -----------------------------------------------------------------------------------------------------
def build_messages(ctx: ModelContext, request_messages: Sequence[Message]) -> list[Message]:
    """The model's MESSAGE history, then the call's messages, with the model's SYSTEM in front when the call brings
    no system message of its own; past thinking stripped from earlier turns."""
    msgs = [Message(role=m["role"], content=m["content"]) for m in ctx.messages] + list(request_messages)
    if ctx.system and (not request_messages or request_messages[0].role != "system"):
        msgs.insert(0, Message(role="system", content=ctx.system))
    return pipeline.strip_past_thinking(ctx.chat, msgs)


async def run_chat(
    inf: Inference,
    call: ChatCall,
    started: float,
    *,
    count_prompt: bool = False,
    relax_think: bool = False,
) -> Run | ModelOnly:
    """Check ``call`` and start it: a :class:`Run`, or :class:`ModelOnly` for a load or unload. Errors before the
    first event raise. ``count_prompt``: have the runner count the prompt's tokens alongside the generation
    (``await run.prompt_count()``; for a stream that must say it before the end, as Anthropic's message_start
    does). ``relax_think``: see :func:`_think`.

    With ``format`` on a model that thinks, the answer is constrained only after the thinking (as newest Ollama
    does): the model thinks freely; at the first answer text the generation stops and starts again from the prompt
    plus the thinking, now under the format's grammar (:func:`_thinking_then_format`). The events of both parts
    are one run."""
    note(model=call.model)
    _check_common(call)
    _model_name_or_error(call.model, empty_is_404=False)
    ctx = await inf.lookup(call.model)
    keep_alive = keep_alive_value(call.keep_alive)

    if not call.messages and keep_alive == 0 and call.keep_alive is not None:
        await inf.scheduler.stop(ctx.ref.key)
        return ModelOnly("unload")
    if "completion" not in ctx.capabilities:
        raise InvalidRequest(f'"{call.model}" does not support chat')
    if call.tools and "tools" not in ctx.capabilities:
        raise InvalidRequest(f"{ctx.name} does not support tools")
    think = _think(ctx, call.think, relax=relax_think)
    _check_images(ctx, [img for m in call.messages for img in m.images])
    opts = inf.options(ctx, call.options)
    spec = inf.load_spec(ctx, opts)

    if not call.messages:
        await _load_only(inf, ctx, keep_alive, opts)
        return ModelOnly("load")
    return await _Chat(inf, call, ctx, think, opts, spec, keep_alive, started).start(count_prompt)


class _Chat:
    """One chat call checked against its model, ready to run (once, or twice for thinking then format)."""

    def __init__(
        self,
        inf: Inference,
        call: ChatCall,
        ctx: ModelContext,
        think: ThinkValue,
        opts: dict[str, Any],
        spec: LoadSpec,
        keep_alive: float | None,
        started: float,
    ) -> None:
        self.inf, self.call, self.ctx, self.think = inf, call, ctx, think
        self.opts, self.spec, self.keep_alive, self.started = opts, spec, keep_alive, started
        self.msgs, self.images = media.number_images(build_messages(ctx, call.messages))
        self.forced = bool(call.tools) and pipeline.is_call_schema(call.format)
        self.adapters = inf.adapters_for(ctx, opts)  # LoRA adapters, applied by the base's runner to this sequence

    async def prompt(self, msgs: list[Message], tools: list[Tool] | None) -> tuple[Lease, str]:
        """A lease on the runner and the prompt rendered (fitted into num_ctx by the runner's tokenizer)."""
        lease = await self.inf.acquire(self.ctx, self.spec, self.keep_alive, adapters=self.adapters)
        try:
            text = await render_chat(
                lease, self.ctx, msgs, tools or None, self.spec.num_ctx, self.call.truncate, self.think
            )
        except BaseException:
            lease.release()
            raise
        return lease, text

    def request(self, text: str, fmt: object) -> GenerateRequest:
        text, ordered = media.media_prompt(text, self.images)
        params = _params(self.inf, self.opts, self.call, fmt)
        return GenerateRequest(
            prompt=text,
            params=params,
            shift=self.call.shift,
            truncate=self.call.truncate,
            images=ordered,
            adapters=self.adapters,
        )

    async def start(self, count_prompt: bool) -> Run:
        call = self.call
        parser, thinks, tools = pipeline.output_parser(
            self.ctx.chat, tools=call.tools, last=self.msgs[-1], think=self.think, forced_call=self.forced
        )
        lease, text = await self.prompt(self.msgs, tools)
        pipeline.rendered(parser, self.ctx.chat, text)
        if self.inf.settings.log_prompts:
            note(prompt=text)
        defer_format = call.format is not None and call.format != "" and thinks
        greq = self.request(text, None if defer_format else call.format)
        first = _events(lease, greq, EventStream(parser, call.tools), self.started, speculative=speculating(self.opts))
        # counted by the runner while it starts generating (the lease is held until the generation ends or is closed)
        prompt_count = asyncio.ensure_future(lease.runner.tokenize(text)) if count_prompt else None
        if prompt_count is not None:  # a count nobody waits for (the generation failed first) is not an error to log
            prompt_count.add_done_callback(lambda f: f.cancelled() or f.exception())
        if not defer_format:
            return Run(first, prompt_count)
        return Run(_thinking_then_format(self, first), prompt_count)


async def _thinking_then_format(chat: _Chat, first: AsyncIterator[Event]) -> AsyncIterator[Event]:
    """The thinking of ``first`` (a generation without the format's grammar), stopped where the answer begins; then
    the answer generated again from the prompt plus that thinking, under the format."""
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
    again = [*chat.msgs, Message(role="assistant", thinking="".join(thought))] if thought else chat.msgs
    # the thinking is over: the parser starts in the answer (the prompt is rendered with the call's think)
    parser, _, tools = pipeline.output_parser(
        chat.ctx.chat, tools=chat.call.tools, last=again[-1], think=False, forced_call=chat.forced
    )
    lease, text = await chat.prompt(again, tools)
    if thought:
        text += pipeline.answer_after_thinking(chat.ctx.chat)  # past the thinking, into the answer
    greq = chat.request(text, chat.call.format)
    events = _events(
        lease, greq, EventStream(parser, chat.call.tools), chat.started, speculative=speculating(chat.opts)
    )
    async for event in events:
        yield event


async def count_chat_tokens(inf: Inference, call: ChatCall) -> int:
    """The length in tokens of the prompt ``call`` renders to, whole (never cut to fit), without generating:
    Anthropic's count_tokens."""
    ctx = await inf.lookup(call.model)
    opts = inf.options(ctx, call.options)
    spec = inf.load_spec(ctx, opts)
    async with await inf.acquire(ctx, spec, None) as lease:
        text = await render_chat(lease, ctx, build_messages(ctx, call.messages), call.tools, spec.num_ctx, False, None)
        tokens = await lease.runner.tokenize(text)
    return len(tokens)
