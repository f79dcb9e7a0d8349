"""The generation service with a fake runner (no model, no process): a chat run's events from scripted tokens,
context fitting by binary search (counted in renders and tokenizations), the retry after a crash before the first
token, thinking then format, and the n-choice fan-out's merging and cancelling."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from types import SimpleNamespace
from typing import Any, cast

import pytest

from daemon.chat.pipeline import ChatModel
from daemon.chat.types import Content, Event, Finished, Message, Thinking
from daemon.generation import choices
from daemon.generation.calls import ChatCall, GenerateCall, options_and_bias, think_value
from daemon.generation.inference import Inference
from daemon.generation.service import ModelOnly, Run, run_chat, run_generate
from daemon.runners.base import Done, GenerateRequest, LoadSpec, RunnerCrashed, Token
from errors import CorralError, InvalidRequest

PLAIN = "{{ range .Messages }}<{{ .Role }}>{{ .Content }} {{ end }}<assistant>"
THINK = """{{- range .Messages }}<|im_start|>{{ .Role }}
{{ if .Thinking }}<think>{{ .Thinking }}</think>{{ end }}{{ .Content }}<|im_end|>
{{ end }}<|im_start|>assistant
{{ if .Think }}<think>{{ end }}"""

Script = list[Token | Done | BaseException]


class FakeRunner:
    """Generates what each script says, in order (one script per generate call); an exception in a script is
    raised there. Tokenizes by words, counting every call."""

    def __init__(self, scripts: list[Script]) -> None:
        self.scripts = list(scripts)
        self.requests: list[GenerateRequest] = []
        self.tokenized: list[str] = []
        self.closed_generations = 0

    async def generate(self, req: GenerateRequest) -> AsyncIterator[Token | Done]:
        self.requests.append(req)
        script = self.scripts.pop(0)
        try:
            for item in script:
                await asyncio.sleep(0)
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            self.closed_generations += 1

    async def tokenize(self, text: str, *, add_special: bool = True) -> list[int]:
        self.tokenized.append(text)
        return [0] * len(text.split())


class FakeLease:
    def __init__(self, runner: FakeRunner) -> None:
        self.runner = runner
        self.ref = SimpleNamespace(name="fake", key="fake")
        self.load_duration = 0.0
        self.released = 0
        self.retried = 0

    def release(self) -> None:
        self.released += 1

    def may_retry(self, exc: BaseException) -> bool:
        return isinstance(exc, RunnerCrashed) and exc.early and self.retried == 0

    async def retry_after_crash(self, exc: RunnerCrashed) -> None:
        self.retried += 1

    async def __aenter__(self) -> FakeLease:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.release()


class FakeInference(Inference):
    """The real options merge and sampling parameters; the model, load spec and lease faked."""

    def __init__(self, runner: FakeRunner, *, template: str = PLAIN, capabilities: tuple[str, ...] = ()) -> None:
        self.settings = cast(Any, SimpleNamespace(log_prompts=False))
        self.default_num_ctx = 4096
        self.runner = runner
        self.leases: list[FakeLease] = []
        self.stopped: list[str] = []
        self.scheduler = cast(Any, SimpleNamespace(stop=self._stop))
        self.ctx = SimpleNamespace(
            raw="fake",
            name="fake",
            capabilities=["completion", *capabilities],
            chat=ChatModel(template=template),
            messages=[],
            system=None,
            params={},
            ref=SimpleNamespace(key="fake", name="fake"),
            adapters=(),  # no LoRA adapters (issue 29)
        )

    async def _stop(self, key: str) -> None:
        self.stopped.append(key)

    async def lookup(self, raw: str) -> Any:
        if raw != "fake":
            raise CorralError(f"no model {raw}")
        return self.ctx

    def load_spec(self, ctx: Any, opts: dict[str, Any], *, embedding: bool = False) -> LoadSpec:
        return LoadSpec(model_path="fake.gguf", num_ctx=int(opts["num_ctx"]))

    async def acquire(self, ctx: Any, spec: LoadSpec, keep_alive: float | None, adapters: Any = ()) -> Any:
        lease = FakeLease(self.runner)
        self.leases.append(lease)
        return lease


def done(eval_count: int = 2) -> Done:
    return Done("stop", 5, 10, eval_count, 20)


async def collect(run: Run | ModelOnly) -> list[Event]:
    assert isinstance(run, Run)
    return [e async for e in run]


def chat(*texts: str, **fields: Any) -> ChatCall:
    """A chat of ``texts``, the last from the user and the others alternating with the assistant before it."""
    roles = ["user" if (len(texts) - 1 - i) % 2 == 0 else "assistant" for i in range(len(texts))]
    messages = tuple(Message(role=r, content=t) for r, t in zip(roles, texts, strict=True))
    return ChatCall(model="fake", messages=messages, **fields)


# -- a chat run -------------------------------------------------------------------------------------------------
@pytest.mark.anyio
async def test_a_chat_runs_scripted_tokens_into_events_and_releases_its_lease() -> None:
    runner = FakeRunner([[Token("Hello"), Token(" world"), done()]])
    inf = FakeInference(runner)
    events = await collect(await run_chat(inf, chat("Hi"), 0.0))
    assert [e for e in events if isinstance(e, Content)] == [Content("Hello"), Content(" world")]
    final = events[-1]
    assert isinstance(final, Finished) and final.done_reason == "stop" and final.eval_count == 2
    assert final.prompt_eval_count == 5 and final.context is None
    assert runner.requests[0].prompt == "<user>Hi <assistant>"
    assert [lease.released for lease in inf.leases] == [1]


@pytest.mark.anyio
async def test_the_call_is_typed_once_options_bias_and_think() -> None:
    assert options_and_bias({"temperature": 0, "logit_bias": {"3": 1}}) == ({"temperature": 0}, ((3, 1.0),))
    with pytest.raises(InvalidRequest, match='option "logit_bias"'):
        options_and_bias({"logit_bias": {"x": 1}})
    assert think_value("true") is True and think_value("false") is False and think_value("low") == "low"
    runner = FakeRunner([[Token("x"), done()]])
    call = chat("Hi", options={"temperature": 0.5, "seed": 3}, logit_bias=((7, -100.0),), logprobs=True, top_logprobs=2)
    await collect(await run_chat(FakeInference(runner), call, 0.0))
    params = runner.requests[0].params
    assert params.logit_bias == ((7, -100.0),) and params.temperature == 0.5 and params.seed == 3
    assert params.logprobs == 2


@pytest.mark.anyio
async def test_no_messages_loads_and_keep_alive_zero_unloads() -> None:
    inf = FakeInference(FakeRunner([]))
    assert await run_chat(inf, ChatCall(model="fake"), 0.0) == ModelOnly("load")
    assert [lease.released for lease in inf.leases] == [1]
    assert await run_chat(inf, ChatCall(model="fake", keep_alive=0), 0.0) == ModelOnly("unload")
    assert inf.stopped == ["fake"]
    assert await run_generate(inf, GenerateCall(model="fake"), 0.0) == ModelOnly("load")
    with pytest.raises(InvalidRequest, match="top_logprobs"):
        await run_chat(inf, chat("x", top_logprobs=21), 0.0)
    with pytest.raises(InvalidRequest, match="does not support thinking"):
        await run_chat(inf, chat("x", think=True), 0.0)
    # relaxed (the OpenAI and Anthropic layers): asking a model that cannot think is ignored
    inf.runner.scripts.append([done()])
    await collect(await run_chat(inf, chat("x", think="high"), 0.0, relax_think=True))


@pytest.mark.anyio
async def test_a_generate_run_gives_its_context() -> None:
    runner = FakeRunner([[Token("4"), Done("stop", 3, 1, 1, 1, context=(1, 2, 3))]])
    events = await collect(await run_generate(FakeInference(runner), GenerateCall(model="fake", prompt="2+2="), 0.0))
    assert events[0] == Content("4")
    assert isinstance(events[-1], Finished) and events[-1].context == (1, 2, 3)


# -- context fitting --------------------------------------------------------------------------------------------
@pytest.mark.anyio
@pytest.mark.parametrize("n", [3, 7, 64])
async def test_fitting_drops_the_oldest_messages_in_a_few_tokenizations(n: int) -> None:
    runner = FakeRunner([[done()]])
    inf = FakeInference(runner)
    texts = [f"m{i} " + "w " * 9 for i in range(n)]  # 10 words each
    call = chat(*texts, options={"num_ctx": 25})
    await collect(await run_chat(inf, call, 0.0))
    prompt = runner.requests[0].prompt
    assert f"m{n - 1} " in prompt and "m0 " not in prompt  # the last stays, the oldest go
    assert len(prompt.split()) <= 25 or prompt.count(" w w ") == 1
    # one tokenization of the whole chat, then a binary search: O(log n), not n
    assert len(runner.tokenized) <= (n - 1).bit_length() + 2, runner.tokenized
    # without truncate: no tokenizing at all, the whole chat is sent (the runner refuses it if too long)
    runner.scripts.append([done()])
    runner.tokenized.clear()
    await collect(await run_chat(inf, chat(*texts, options={"num_ctx": 25}, truncate=False), 0.0))
    assert not runner.tokenized and all(f"m{i} " in runner.requests[-1].prompt for i in range(n))


@pytest.mark.anyio
async def test_a_chat_that_surely_fits_is_not_counted_before_it_runs() -> None:
    """A chat whose text has fewer bytes than num_ctx has fewer tokens: no tokenize round trip to the runner before
    the generation (every multi-turn chat paid one before its first token)."""
    runner = FakeRunner([[done()]])
    inf = FakeInference(runner)
    await collect(await run_chat(inf, chat("hello", "hi there", "how are you?", options={"num_ctx": 4096}), 0.0))
    assert not runner.tokenized and "how are you?" in runner.requests[0].prompt


# -- the crash retry --------------------------------------------------------------------------------------------
@pytest.mark.anyio
async def test_a_crash_before_the_first_token_runs_again_on_a_safer_load() -> None:
    runner = FakeRunner([[RunnerCrashed("died", signal=11, early=True)], [Token("ok"), done()]])
    inf = FakeInference(runner)
    events = await collect(await run_chat(inf, chat("Hi"), 0.0))
    assert events[0] == Content("ok") and isinstance(events[-1], Finished)
    assert inf.leases[0].retried == 1 and len(runner.requests) == 2 and inf.leases[0].released == 1


@pytest.mark.anyio
async def test_a_crash_after_a_token_is_the_clients_error() -> None:
    runner = FakeRunner([[Token("half"), RunnerCrashed("died", signal=11, early=True)], [Token("never"), done()]])
    inf = FakeInference(runner)
    run = await run_chat(inf, chat("Hi"), 0.0)
    assert isinstance(run, Run)
    assert await anext(run) == Content("half")
    with pytest.raises(RunnerCrashed):
        await anext(run)
    assert inf.leases[0].retried == 0 and inf.leases[0].released == 1 and len(runner.requests) == 1


# -- thinking, then format --------------------------------------------------------------------------------------
@pytest.mark.anyio
async def test_thinking_then_format_answers_again_under_the_grammar() -> None:
    first: Script = [Token("<think>"), Token("ponder"), Token("</think>"), Token("free text"), Token("more"), done()]
    runner = FakeRunner([first, [Token('{"a": 1}'), done()]])
    inf = FakeInference(runner, template=THINK, capabilities=("thinking",))
    events = await collect(await run_chat(inf, chat("Hi", format="json"), 0.0))
    assert Thinking("ponder") in events
    assert [e.text for e in events if isinstance(e, Content)] == ['{"a": 1}']  # the free answer never shows
    assert runner.requests[0].params.grammar is None  # thinking is free
    assert runner.requests[1].params.grammar is not None  # the answer is constrained
    assert "<think>ponder</think>" in runner.requests[1].prompt  # continued after the thinking
    assert runner.closed_generations == 2 and [lease.released for lease in inf.leases] == [1, 1]


# -- n choices --------------------------------------------------------------------------------------------------
class Choice:
    """A choice's events, yielding to the loop between them; records whether it was closed."""

    def __init__(self, i: int, count: int, fail_at: int | None = None) -> None:
        self.i, self.count, self.fail_at = i, count, fail_at
        self.closed = False
        self.events = self._events()

    async def _events(self) -> AsyncIterator[Event]:
        try:
            for k in range(self.count):
                await asyncio.sleep(0)
                if k == self.fail_at:
                    raise CorralError(f"choice {self.i} failed at {k}")
                yield Content(f"{self.i}.{k}")
            yield Finished("stop")
        finally:
            self.closed = True


def starter(made: list[Choice], make: Callable[[int], Choice]) -> Callable[[int], Any]:
    async def run(i: int) -> AsyncIterator[Event]:
        made.append(make(i))
        return made[-1].events

    return run


@pytest.mark.anyio
async def test_choices_merge_in_the_order_they_come_and_all_finish() -> None:
    made: list[Choice] = []
    merged = choices.merged(await choices.start_choices(3, starter(made, lambda i: Choice(i, 1 + i))))
    got = [(i, e) async for i, e in merged]
    for i in range(3):  # each choice's own events in order, all of them
        assert [e for j, e in got if j == i] == [*(Content(f"{i}.{k}") for k in range(1 + i)), Finished("stop")]
    order = [i for i, _ in got]
    assert order != sorted(order)  # side by side, not one after another
    assert all(c.closed for c in made)


@pytest.mark.anyio
async def test_closing_the_merged_stream_stops_every_choice() -> None:
    made: list[Choice] = []
    merged = choices.merged(await choices.start_choices(4, starter(made, lambda i: Choice(i, 100))))
    assert (await anext(merged))[1] == Content("0.0")
    await merged.aclose()
    assert len(made) == 4 and all(c.closed for c in made)


@pytest.mark.anyio
async def test_a_choice_failing_before_output_closes_the_others_and_is_blamed() -> None:
    made: list[Choice] = []
    blamed: list[str] = []
    with pytest.raises(CorralError, match="choice 2 failed at 0"):
        await choices.start_choices(
            3,
            starter(made, lambda i: Choice(i, 5, fail_at=0 if i == 2 else None)),
            on_first_error=lambda exc: blamed.append(str(exc)),
        )
    assert blamed == ["choice 2 failed at 0"] and all(c.closed for c in made)


@pytest.mark.anyio
async def test_a_choice_failing_later_ends_the_merged_stream_with_its_error() -> None:
    made: list[Choice] = []
    merged = choices.merged(
        await choices.start_choices(2, starter(made, lambda i: Choice(i, 5, fail_at=3 if i == 1 else None)))
    )
    with pytest.raises(CorralError, match="choice 1 failed at 3"):
        async for _ in merged:
            pass
    assert all(c.closed for c in made)


@pytest.mark.anyio
async def test_chat_choices_seed_each_choice_apart() -> None:
    runner = FakeRunner([[Token(str(i)), done()] for i in range(3)])
    inf = FakeInference(runner)
    merged = await choices.chat_choices(inf, chat("Hi", options={"seed": 40}), 3, 0.0)
    got = [(i, e) async for i, e in merged]
    assert sorted(r.params.seed for r in runner.requests) == [40, 41, 42]
    assert sum(isinstance(e, Finished) for _, e in got) == 3
    assert [lease.released for lease in inf.leases] == [1, 1, 1]
    assert choices.for_choice(chat("x", options={"seed": -1}), 2).options == {"seed": -1}  # random stays random
