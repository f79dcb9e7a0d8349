"""The Anthropic Messages API through the official ``anthropic`` SDK against a real daemon."""

from __future__ import annotations

import anthropic
import httpx
import pytest

from tests.conftest import Daemon

pytestmark = pytest.mark.real_model
GREEDY = {"extra_body": {"temperature": 0, "options": {"seed": 3}}}


@pytest.fixture
def client(v1_daemon: Daemon) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=v1_daemon.url, api_key="unused", max_retries=0)


def test_message_plain_and_streamed(client: anthropic.Anthropic) -> None:
    kw = {
        "model": "smol",
        "max_tokens": 20,
        "system": [{"type": "text", "text": "Be brief."}],
        "messages": [{"role": "user", "content": "Say hello."}],
    }
    r = client.messages.create(**kw, **GREEDY)  # type: ignore[arg-type]
    assert r.type == "message" and r.role == "assistant" and r.content[0].type == "text"
    assert r.stop_reason in ("end_turn", "max_tokens") and r.usage.output_tokens > 0
    events, told = [], -1
    with client.messages.stream(**kw, **GREEDY) as stream:  # type: ignore[arg-type]
        for event in stream:
            events.append(event.type)
            if event.type == "message_start":
                told = event.message.usage.input_tokens
        final = stream.get_final_message()
    assert told == r.usage.input_tokens == final.usage.input_tokens > 5  # said at the start, exactly
    assert final.content[0].text == r.content[0].text  # type: ignore[union-attr]
    assert events[0] == "message_start" and events[-1] == "message_stop"
    for needed in ("content_block_start", "content_block_delta", "content_block_stop", "message_delta"):
        assert needed in events


def test_stop_reasons(client: anthropic.Anthropic) -> None:
    seq = client.messages.create(
        model="smol",
        max_tokens=40,
        stop_sequences=["!"],
        messages=[{"role": "user", "content": "Say hello."}],
        **GREEDY,
    )
    assert seq.stop_reason == "stop_sequence" and seq.stop_sequence == "!"
    assert "!" not in seq.content[0].text  # type: ignore[union-attr]
    short = client.messages.create(
        model="smol", max_tokens=2, messages=[{"role": "user", "content": "Tell a story"}], **GREEDY
    )
    assert short.stop_reason == "max_tokens" and short.usage.output_tokens == 2


WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


def test_tool_use_round_trip(client: anthropic.Anthropic) -> None:
    msgs: list[dict[str, object]] = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = client.messages.create(
        model="smol-tools",
        max_tokens=40,
        tools=[WEATHER],
        messages=msgs,  # type: ignore[arg-type,list-item]
        tool_choice={"type": "tool", "name": "get_weather"},
        **GREEDY,
    )
    assert r.stop_reason == "tool_use"
    use = next(b for b in r.content if b.type == "tool_use")
    assert use.name == "get_weather" and isinstance(use.input["city"], str)  # type: ignore[union-attr,index]
    with client.messages.stream(
        model="smol-tools",
        max_tokens=40,
        tools=[WEATHER],
        messages=msgs,  # type: ignore[arg-type,list-item]
        tool_choice={"type": "tool", "name": "get_weather"},
        **GREEDY,
    ) as stream:
        streamed = stream.get_final_message()
    assert streamed.stop_reason == "tool_use"
    assert next(b for b in streamed.content if b.type == "tool_use").input == use.input  # type: ignore[union-attr]
    msgs += [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in r.content]},
        {
            "role": "user",
            "content": [
                {
                    "type": "tool_result",
                    "tool_use_id": use.id,  # type: ignore[union-attr]
                    "content": "18 degrees and sunny",
                }
            ],
        },
    ]
    after = client.messages.create(
        model="smol-tools",
        max_tokens=30,
        tools=[WEATHER],
        messages=msgs,  # type: ignore[arg-type,list-item]
        tool_choice={"type": "none"},
        **GREEDY,
    )
    assert after.stop_reason in ("end_turn", "max_tokens") and after.content[0].type == "text"


def test_count_tokens(client: anthropic.Anthropic) -> None:
    short = client.messages.count_tokens(model="smol", system="Be brief.", messages=[{"role": "user", "content": "Hi"}])
    longer = client.messages.count_tokens(
        model="smol", system="Be brief.", messages=[{"role": "user", "content": "Hi, how are you today?"}]
    )
    assert 0 < short.input_tokens < longer.input_tokens
    r = client.messages.create(
        model="smol", max_tokens=1, system="Be brief.", messages=[{"role": "user", "content": "Hi"}]
    )
    assert r.usage.input_tokens == short.input_tokens  # every prompt token, cached or not, as Ollama counts


def test_errors_in_anthropic_shape(client: anthropic.Anthropic, v1_daemon: Daemon) -> None:
    with pytest.raises(anthropic.NotFoundError) as missing:
        client.messages.create(model="no-such-model", max_tokens=5, messages=[{"role": "user", "content": "x"}])
    assert missing.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]
    with pytest.raises(anthropic.BadRequestError) as empty:
        client.messages.create(model="smol", max_tokens=5, messages=[])
    assert "messages" in empty.value.message
    with pytest.raises(anthropic.BadRequestError) as bad:
        client.messages.create(
            model="smol", max_tokens=5, messages=[{"role": "user", "content": "x"}], extra_body={"top_k": "many"}
        )
    assert "top_k" in bad.value.message
    with pytest.raises(anthropic.BadRequestError) as hot:
        client.messages.create(
            model="smol", max_tokens=5, messages=[{"role": "user", "content": "x"}], extra_body={"temperature": 1.5}
        )
    assert "'temperature' must be between 0 and 1" in hot.value.message
    raw = httpx.post(v1_daemon.url + "/v1/messages", json={"model": "smol", "messages": []}, timeout=30)
    assert raw.status_code == 400 and raw.json()["type"] == "error"
