"""``n`` choices and ``logit_bias`` on /v1, and the field policy (unknown fields ignored, known-but-unsupported
ones refused by name), through the official ``openai`` SDK against a real daemon with SmolLM2."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from tests.compat.conftest import SMOL
from tests.conftest import Daemon

pytestmark = pytest.mark.real_model
GREEDY: dict[str, Any] = {"temperature": 0, "seed": 3}
ASK = [{"role": "user", "content": "Write a short poem about the sea."}]
SPECIAL = {str(i): -100 for i in range(17)}  # SmolLM2's special tokens (end of text among them): never stop early


@pytest.fixture
def client(v1_daemon: Daemon) -> openai.OpenAI:
    return openai.OpenAI(base_url=v1_daemon.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def vocab() -> Iterator[Any]:
    """SmolLM2's tokenizer alone (no weights), to name token ids."""
    from llama_cpp import Llama

    if SMOL is None:
        pytest.skip("SmolLM2 is not cached")
    llm = Llama(str(SMOL), vocab_only=True, verbose=False)
    yield llm
    llm.close()


def token_id(vocab: Any, data: bytes) -> int:
    ids = vocab.tokenize(data, add_bos=False, special=False)
    assert len(ids) == 1, (data, ids)
    return int(ids[0])


def busy_slots(d: Daemon) -> int:
    ps = httpx.get(d.url + "/api/ps", timeout=30).json()["models"]
    return max((sum(s["busy"] for s in m.get("slots") or []) for m in ps), default=0)


# -- n --------------------------------------------------------------------------------------------------------
def test_n_greedy_choices_equal_the_single_answer_and_run_side_by_side(
    client: openai.OpenAI, v1_daemon: Daemon
) -> None:
    kw: dict[str, Any] = {"model": "smol", "messages": ASK, "max_tokens": 48, "logit_bias": SPECIAL, **GREEDY}
    one = client.chat.completions.create(**kw)  # also loads the model: the watcher below sees only the n=3 request
    # decoded together in one batch, not one after the other: while the whole (non-streamed) reply is being made,
    # the runner holds the three choices in three busy slots at once (a wall-clock ratio was flaky on shared CPUs)
    done = threading.Event()
    most = [0]

    def watch() -> None:
        while not done.is_set():
            most[0] = max(most[0], busy_slots(v1_daemon))
            time.sleep(0.005)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        three = client.chat.completions.create(n=3, **kw)
    finally:
        done.set()
        watcher.join(timeout=30)
    assert [c.index for c in three.choices] == [0, 1, 2]
    assert [c.message.content for c in three.choices] == [one.choices[0].message.content] * 3
    assert all(c.finish_reason == "length" for c in three.choices)
    assert one.usage and three.usage
    assert three.usage.prompt_tokens == one.usage.prompt_tokens  # the prompt counted once
    assert three.usage.completion_tokens == 3 * one.usage.completion_tokens == 3 * 48
    assert most[0] >= 3, most[0]


def test_n_streamed_is_batched_and_ends_with_usage(client: openai.OpenAI, v1_daemon: Daemon) -> None:
    stream = client.chat.completions.create(
        model="smol",
        messages=ASK,
        max_tokens=40,
        n=3,
        stream=True,
        stream_options={"include_usage": True},
        logit_bias=SPECIAL,
        **GREEDY,
    )
    texts = ["", "", ""]
    finishes: dict[int, str] = {}
    seen: set[int] = set()
    busy_while_running = 0
    usage = None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            if c.finish_reason:
                finishes[c.index] = c.finish_reason
            seen.add(c.index)
        if len(seen) == 3 and not busy_while_running and not finishes:
            busy_while_running = busy_slots(v1_daemon)  # all three are generating: each holds a slot
    assert busy_while_running >= 3
    assert finishes == {0: "length", 1: "length", 2: "length"}
    assert texts[0] and texts[0] == texts[1] == texts[2]
    assert usage is not None and usage.completion_tokens == 3 * 40 and usage.prompt_tokens > 0


def test_n_with_a_seed_differs_at_temperature_one_and_is_reproducible(client: openai.OpenAI) -> None:
    kw: dict[str, Any] = {"model": "smol", "messages": ASK, "max_tokens": 16, "n": 3, "temperature": 1.0, "seed": 11}
    a = client.chat.completions.create(**kw)
    b = client.chat.completions.create(**kw)
    texts = [c.message.content for c in a.choices]
    assert len(texts) == 3 and len(set(texts)) > 1
    assert [c.message.content for c in b.choices] == texts  # seed + i per choice: the same three again
    # choice 0 is what n=1 with the same seed gives
    single = client.chat.completions.create(**{**kw, "n": 1})
    assert single.choices[0].message.content == texts[0]


def test_n_on_completions_whole_and_streamed(client: openai.OpenAI) -> None:
    kw: dict[str, Any] = {"model": "smol", "prompt": "The capital of France is", "max_tokens": 8, **GREEDY}
    one = client.completions.create(**kw)
    many = client.completions.create(n=2, echo=True, logprobs=1, **kw)
    assert [c.index for c in many.choices] == [0, 1]
    assert all(c.text == kw["prompt"] + one.choices[0].text for c in many.choices)
    assert all(
        c.logprobs and len(c.logprobs.tokens or []) == one.usage.completion_tokens  # type: ignore[union-attr]
        for c in many.choices
    )
    chunks = list(client.completions.create(n=2, stream=True, stream_options={"include_usage": True}, **kw))
    by_index = {0: "", 1: ""}
    for c in chunks:
        for choice in c.choices:
            by_index[choice.index] += choice.text
    assert by_index == {0: one.choices[0].text, 1: one.choices[0].text}
    assert one.usage is not None and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 2 * one.usage.completion_tokens


# -- logit_bias -----------------------------------------------------------------------------------------------
def test_logit_bias_banning_the_greedy_first_token_changes_it(client: openai.OpenAI, vocab: Any) -> None:
    kw: dict[str, Any] = {"model": "smol", "messages": ASK, "max_tokens": 6, "logprobs": True, **GREEDY}
    plain = client.chat.completions.create(**kw)
    first = plain.choices[0].logprobs.content[0]  # type: ignore[union-attr,index]
    banned = token_id(vocab, bytes(first.bytes or []))
    biased = client.chat.completions.create(logit_bias={str(banned): -100}, **kw)
    new_first = biased.choices[0].logprobs.content[0]  # type: ignore[union-attr,index]
    assert new_first.token != first.token
    assert all(token_id(vocab, bytes(t.bytes or [])) != banned for t in biased.choices[0].logprobs.content or [])  # type: ignore[union-attr]


def test_logit_bias_forcing_a_token_makes_every_token_that_token(client: openai.OpenAI, vocab: Any) -> None:
    forced = token_id(vocab, b" yes")
    for extra in ({"temperature": 0}, {"temperature": 1.0, "seed": 5}):
        r = client.chat.completions.create(
            model="smol", messages=ASK, max_tokens=5, logprobs=True, logit_bias={str(forced): 100}, **extra
        )  # type: ignore[arg-type]
        tokens = [t.token for t in r.choices[0].logprobs.content or []]  # type: ignore[union-attr]
        assert tokens == [" yes"] * 5 and r.choices[0].message.content == " yes" * 5
        assert r.choices[0].finish_reason == "length"
    # the legacy completions endpoint too, and a biased request beside an unbiased one leaves the other alone
    c = client.completions.create(model="smol", prompt="Hello", max_tokens=3, logit_bias={str(forced): 100}, **GREEDY)
    assert c.choices[0].text == " yes" * 3


@pytest.mark.parametrize(
    "bias, words",
    [
        ({"abc": 5}, "token ids"),
        ({"49152": 5}, "out of range"),  # SmolLM2 has ids 0 to 49151: checked by the runner, for this request only
        ({"5": 1000}, "between -100 and 100"),
        ({"-5": 1}, "negative"),
    ],
)
def test_bad_logit_bias_is_a_400_naming_it(client: openai.OpenAI, bias: dict[str, Any], words: str) -> None:
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model="smol", messages=ASK, max_tokens=2, logit_bias=bias)
    assert "logit_bias" in bad.value.message and words in bad.value.message
    assert bad.value.body["param"] == "logit_bias"  # type: ignore[index]
    # and the runner still serves
    ok = client.chat.completions.create(model="smol", messages=ASK, max_tokens=2)
    assert ok.choices[0].message.content is not None


def test_logit_bias_in_ollama_options_too(v1_daemon: Daemon, vocab: Any) -> None:
    forced = token_id(vocab, b" yes")
    r = httpx.post(
        v1_daemon.url + "/api/generate",
        json={
            "model": "smol",
            "prompt": "Hi",
            "stream": False,
            "options": {"temperature": 0, "num_predict": 2, "logit_bias": {str(forced): 100}},
        },
        timeout=120,
    )
    assert r.status_code == 200 and r.json()["response"] == " yes yes"
    bad = httpx.post(
        v1_daemon.url + "/api/generate",
        json={"model": "smol", "prompt": "Hi", "stream": False, "options": {"logit_bias": {"x": 1}}},
        timeout=120,
    )
    assert bad.status_code == 400 and "logit_bias" in bad.json()["error"]


# -- the field policy -----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "extra, param",
    [
        ({"audio": {"voice": "alloy", "format": "wav"}, "modalities": ["text", "audio"]}, "audio"),
        ({"modalities": ["text", "audio"]}, "modalities"),
        ({"prediction": {"type": "content", "content": "x"}}, "prediction"),
        ({"web_search_options": {}}, "web_search_options"),
        ({"functions": [{"name": "f", "parameters": {"type": "object"}}]}, "functions"),
        ({"n": 17}, "n"),
        ({"n": 0}, "n"),
    ],
)
def test_known_but_unsupported_fields_are_named(client: openai.OpenAI, extra: dict[str, Any], param: str) -> None:
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model="smol", messages=ASK, max_tokens=2, extra_body=extra)
    assert bad.value.body["param"] == param and f"'{param}'" in bad.value.message  # type: ignore[index]


def test_best_of_above_n_is_refused(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model="smol", prompt="Hi", max_tokens=2, best_of=3)
    assert bad.value.body["param"] == "best_of"  # type: ignore[index]
    # best_of equal to n is accepted: n choices, each generated (two sampled tokens may decode to no text yet, a
    # multi-byte character's first bytes, so count the tokens rather than the text)
    out = client.completions.create(model="smol", prompt="Hi", max_tokens=2, best_of=2, n=2)
    assert [c.index for c in out.choices] == [0, 1]
    assert all(c.finish_reason in ("length", "stop") for c in out.choices)
    assert out.usage is not None and out.usage.completion_tokens >= 2


def test_unknown_fields_and_hints_are_ignored(client: openai.OpenAI) -> None:
    base: dict[str, Any] = {"model": "smol", "messages": ASK, "max_tokens": 6, **GREEDY}
    plain = client.chat.completions.create(**base)
    r = client.chat.completions.create(
        **base,
        modalities=["text"],
        service_tier="auto",
        store=False,
        metadata={"k": "v"},
        user="u1",
        parallel_tool_calls=True,
        extra_body={"a_field_from_the_future": {"x": 1}, "verbosity": "low"},
    )
    assert r.choices[0].message.content == plain.choices[0].message.content


def test_parallel_tool_calls_false_keeps_one_call(client: openai.OpenAI) -> None:
    tools = [
        {
            "type": "function",
            "function": {
                "name": "weather",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
            },
        }
    ]
    r = client.chat.completions.create(
        model="smol-tools",
        max_tokens=60,
        tools=tools,  # type: ignore[arg-type]
        tool_choice="required",
        parallel_tool_calls=False,
        n=2,
        **GREEDY,
        messages=[{"role": "user", "content": "Weather in Paris?"}],
    )
    assert len(r.choices) == 2
    for c in r.choices:
        assert c.finish_reason == "tool_calls" and len(c.message.tool_calls or []) == 1


def test_n_choices_stop_when_the_client_leaves(client: openai.OpenAI, v1_daemon: Daemon) -> None:
    stream = client.chat.completions.create(
        model="smol", messages=ASK, max_tokens=400, n=3, stream=True, logit_bias=SPECIAL, **GREEDY
    )
    for i, _ in enumerate(stream):
        if i == 6:
            break
    stream.close()
    deadline = time.monotonic() + 30
    while busy_slots(v1_daemon) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert busy_slots(v1_daemon) == 0  # every choice's sequence was cancelled, not left to run to 400 tokens


def test_threaded_requests_beside_n(client: openai.OpenAI) -> None:
    """A request with n=2 and a plain one at the same time: both right (the slots are shared fairly)."""
    out: dict[str, Any] = {}

    def plain() -> None:
        out["plain"] = client.chat.completions.create(model="smol", messages=ASK, max_tokens=12, **GREEDY)

    t = threading.Thread(target=plain)
    t.start()
    many = client.chat.completions.create(model="smol", messages=ASK, max_tokens=12, n=2, **GREEDY)
    t.join(120)
    assert [c.message.content for c in many.choices] == [out["plain"].choices[0].message.content] * 2
