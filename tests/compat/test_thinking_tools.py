"""Thinking and streamed tool calls with the real SmolLM2, through every API and its official client.

SmolLM2-135M neither thinks nor calls tools by itself, but it copies a pattern: the requests carry two worked
examples (earlier turns with thinking, or with tool calls), and at temperature 0 the model answers the third the
same way, tags included. What is tested is corral's part: the tags inferred from the template, the output split
into thinking, content and tool calls while streaming, each API's shape for them, and format after thinking.
"""

from __future__ import annotations

import json
from typing import Any

import anthropic
import httpx
import ollama
import openai
import pytest

from tests.conftest import Daemon

pytestmark = pytest.mark.real_model
OPTS = {"temperature": 0, "seed": 3, "num_predict": 40}
QUESTION = "What is 3+3?"
SHOTS = [
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "thinking": "2 plus 2 is 4.", "content": "4"},
    {"role": "user", "content": "What is 5+1?"},
    {"role": "assistant", "thinking": "5 plus 1 is 6.", "content": "6"},
]
THOUGHT, ANSWER = "3 plus 3 is 6.", "6"
TAGS = ("<think>", "</think>")

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
CALL_SHOTS: list[dict[str, Any]] = [
    {"role": "user", "content": "What is the weather in London?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "London"}}}],
    },
    {"role": "user", "content": "What is the weather in Rome?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Rome"}}}],
    },
    {"role": "user", "content": "What is the weather in Paris?"},
]


@pytest.fixture
def client(v1_daemon: Daemon) -> ollama.Client:
    return ollama.Client(host=v1_daemon.url)


def _no_tags(*texts: str | None) -> None:
    for text in texts:
        assert not any(tag in (text or "") for tag in TAGS), text


# -- thinking ---------------------------------------------------------------------------------------------------
def test_capabilities_say_thinking(client: ollama.Client) -> None:
    assert "thinking" in (client.show("smol-think").capabilities or [])
    assert "thinking" not in (client.show("smol").capabilities or [])
    assert "tools" in (client.show("smol-hermes").capabilities or [])


def test_api_chat_splits_thinking_whole_and_streamed(client: ollama.Client) -> None:
    messages = [*SHOTS, {"role": "user", "content": QUESTION}]
    r = client.chat(model="smol-think", messages=messages, options=OPTS)  # think unset: on, as in Ollama
    assert (r.message.thinking, r.message.content) == (THOUGHT, ANSWER)
    parts = list(client.chat(model="smol-think", messages=messages, options=OPTS, think=True, stream=True))
    thinking = [p.message.thinking for p in parts if p.message.thinking]
    content = [p.message.content for p in parts if p.message.content]
    # streamed in pieces, not held to the end (on the CPU a piece may carry several tokens: STREAM_INTERVAL)
    assert len(thinking) > 1 and "".join(thinking) == THOUGHT
    assert "".join(content) == ANSWER
    _no_tags(*thinking, *content)
    assert parts[-1].done and parts[-1].eval_count


def test_think_false_and_bad_values(client: ollama.Client) -> None:
    r = client.chat(
        model="smol-think", messages=[*SHOTS, {"role": "user", "content": QUESTION}], options=OPTS, think=False
    )
    assert not r.message.thinking  # the template opens no <think>; what the model writes is its answer
    with pytest.raises(ollama.ResponseError) as cannot:
        client.chat(model="smol", messages=[{"role": "user", "content": "hi"}], think=True)
    assert cannot.value.status_code == 400 and "does not support thinking" in cannot.value.error
    bad = httpx.post(
        f"{client._client.base_url}/api/chat",
        json={"model": "smol-think", "messages": [{"role": "user", "content": "hi"}], "think": "very"},
    )
    assert bad.status_code == 400 and "invalid think value" in bad.json()["error"]


def test_api_generate_thinks(client: ollama.Client) -> None:
    r = client.generate(model="smol-think", prompt=QUESTION, options=OPTS, think=True)
    assert r.thinking and not r.response  # the prompt opens <think> and this model never closes it unprompted
    _no_tags(r.thinking)
    plain = client.generate(model="smol-think", prompt=QUESTION, options=OPTS, think=False)
    assert plain.response and not plain.thinking


def test_format_applies_after_thinking(client: ollama.Client) -> None:
    schema = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]}
    r = client.chat(
        model="smol-think", messages=[*SHOTS, {"role": "user", "content": QUESTION}], options=OPTS, format=schema
    )
    assert r.message.thinking == THOUGHT  # thought freely, then answered under the grammar
    assert isinstance(json.loads(r.message.content or "")["answer"], int)
    _no_tags(r.message.content)


def test_openai_reasoning(v1_daemon: Daemon) -> None:
    oai = openai.OpenAI(base_url=v1_daemon.url + "/v1", api_key="unused", max_retries=0)
    messages: list[Any] = [
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4", "reasoning": "2 plus 2 is 4."},
        {"role": "user", "content": "What is 5+1?"},
        {"role": "assistant", "content": "6", "reasoning": "5 plus 1 is 6."},
        {"role": "user", "content": QUESTION},
    ]
    kw: dict[str, Any] = {"model": "smol-think", "messages": messages, "temperature": 0, "seed": 3, "max_tokens": 40}
    r = client_reasoning = oai.chat.completions.create(**kw)
    msg = client_reasoning.choices[0].message
    assert (msg.model_extra or {}).get("reasoning") == THOUGHT and msg.content == ANSWER
    chunks = list(oai.chat.completions.create(**kw, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    reasoning = [(d.model_extra or {}).get("reasoning") or "" for d in deltas]
    assert sum(1 for x in reasoning if x) > 1 and "".join(reasoning) == THOUGHT
    assert "".join(d.content or "" for d in deltas) == ANSWER
    off = oai.chat.completions.create(**kw, reasoning_effort="none")  # type: ignore[arg-type]
    assert not (off.choices[0].message.model_extra or {}).get("reasoning")
    assert r.usage and r.usage.completion_tokens > 0


def test_anthropic_thinking_blocks(v1_daemon: Daemon) -> None:
    ant = anthropic.Anthropic(base_url=v1_daemon.url, api_key="unused", max_retries=0)
    messages: list[Any] = [
        {"role": "user", "content": "What is 2+2?"},
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "2 plus 2 is 4.", "signature": ""},
                {"type": "text", "text": "4"},
            ],
        },
        {"role": "user", "content": "What is 5+1?"},
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "5 plus 1 is 6.", "signature": ""},
                {"type": "text", "text": "6"},
            ],
        },
        {"role": "user", "content": QUESTION},
    ]
    kw: dict[str, Any] = {
        "model": "smol-think",
        "max_tokens": 40,
        "messages": messages,
        "thinking": {"type": "enabled", "budget_tokens": 1024},
        "extra_body": {"temperature": 0, "options": {"seed": 3}},
    }
    r = ant.messages.create(**kw)
    assert [b.type for b in r.content] == ["thinking", "text"]
    assert r.content[0].thinking == THOUGHT and r.content[1].text == ANSWER  # type: ignore[union-attr]
    kinds = []
    with ant.messages.stream(**kw) as stream:
        for event in stream:
            if event.type == "content_block_delta":
                kinds.append(event.delta.type)
        final = stream.get_final_message()
    assert kinds.count("thinking_delta") > 1 and kinds.index("text_delta") > kinds.index("thinking_delta")
    assert final.content[0].thinking == THOUGHT and final.content[1].text == ANSWER  # type: ignore[union-attr]


def test_responses_reasoning_items(v1_daemon: Daemon) -> None:
    oai = openai.OpenAI(base_url=v1_daemon.url + "/v1", api_key="unused", max_retries=0)

    def shot(question: str, thought: str, answer: str) -> list[Any]:
        return [
            {"role": "user", "content": question},
            {"type": "reasoning", "id": "rs_x", "summary": [{"type": "summary_text", "text": thought}]},
            {"role": "assistant", "content": answer},
        ]

    kw: dict[str, Any] = {
        "model": "smol-think",
        "input": [
            *shot("What is 2+2?", "2 plus 2 is 4.", "4"),
            *shot("What is 5+1?", "5 plus 1 is 6.", "6"),
            {"role": "user", "content": QUESTION},
        ],
        "max_output_tokens": 40,
        "temperature": 0,
        "extra_body": {"seed": 3},
    }
    r = oai.responses.create(**kw)
    assert [o.type for o in r.output] == ["reasoning", "message"]
    assert r.output[0].summary[0].text == THOUGHT and r.output_text == ANSWER  # type: ignore[union-attr]
    events = list(oai.responses.create(**kw, stream=True))
    deltas = [e.delta for e in events if e.type == "response.reasoning_summary_text.delta"]
    assert len(deltas) > 1 and "".join(deltas) == THOUGHT  # streamed in pieces (on the CPU, a few tokens each)
    assert events[-1].type == "response.completed"


# -- tool calls that stream -------------------------------------------------------------------------------------
def test_api_chat_streams_a_tool_call(client: ollama.Client) -> None:
    parts = list(client.chat(model="smol-hermes", messages=CALL_SHOTS, tools=[WEATHER], options=OPTS, stream=True))
    calls = [c for p in parts for c in (p.message.tool_calls or [])]
    assert [(c.function.name, dict(c.function.arguments)) for c in calls] == [("get_weather", {"city": "Paris"})]
    assert not parts[0].done and parts[-1].done  # the call came in its own chunk, before the end
    assert "".join(p.message.content or "" for p in parts) == ""  # no tag or JSON leaks into the content
    whole = client.chat(model="smol-hermes", messages=CALL_SHOTS, tools=[WEATHER], options=OPTS)
    assert whole.message.tool_calls and whole.message.tool_calls[0].function.arguments == {"city": "Paris"}


def test_content_still_streams_when_tools_are_given(client: ollama.Client) -> None:
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    parts = list(client.chat(model="smol-hermes", messages=messages, tools=[WEATHER], options=OPTS, stream=True))
    texts = [p.message.content for p in parts if p.message.content]
    assert len(texts) > 1 and not any(p.message.tool_calls for p in parts)  # streamed, not one chunk at the end


def test_an_undeclared_tool_is_not_a_tool_call(client: ollama.Client) -> None:
    clock = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
    r = client.chat(model="smol-hermes", messages=CALL_SHOTS, tools=[clock], options=OPTS)
    assert not r.message.tool_calls  # the model called get_weather, which this request did not offer
    assert "get_weather" in (r.message.content or "")  # and its text is kept, not lost


def test_openai_streams_tool_call_deltas(v1_daemon: Daemon) -> None:
    oai = openai.OpenAI(base_url=v1_daemon.url + "/v1", api_key="unused", max_retries=0)
    messages: list[Any] = []
    for i, m in enumerate(CALL_SHOTS):
        if m.get("tool_calls"):
            fn = m["tool_calls"][0]["function"]
            call = {
                "id": f"call_{i}",
                "type": "function",
                "function": {"name": fn["name"], "arguments": json.dumps(fn["arguments"])},
            }
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        else:
            messages.append(m)
    kw: dict[str, Any] = {
        "model": "smol-hermes",
        "messages": messages,
        "tools": [WEATHER],
        "temperature": 0,
        "seed": 3,
        "max_tokens": 40,
    }
    r = oai.chat.completions.create(**kw)
    assert r.choices[0].finish_reason == "tool_calls"
    call = r.choices[0].message.tool_calls[0]  # type: ignore[index]
    assert call.id.startswith("call_") and json.loads(call.function.arguments) == {"city": "Paris"}
    chunks = list(oai.chat.completions.create(**kw, stream=True))
    deltas = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert len(deltas) == 1 and deltas[0].index == 0 and deltas[0].id and deltas[0].id.startswith("call_")
    assert deltas[0].function and json.loads(deltas[0].function.arguments or "") == {"city": "Paris"}
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


def test_anthropic_streams_tool_use(v1_daemon: Daemon) -> None:
    ant = anthropic.Anthropic(base_url=v1_daemon.url, api_key="unused", max_retries=0)
    messages: list[Any] = []
    for i, m in enumerate(CALL_SHOTS):
        if m.get("tool_calls"):
            fn = m["tool_calls"][0]["function"]
            messages.append(
                {
                    "role": "assistant",
                    "content": [{"type": "tool_use", "id": f"toolu_{i}", "name": fn["name"], "input": fn["arguments"]}],
                }
            )
        else:
            messages.append(m)
    tool = {
        "name": "get_weather",
        "description": "The weather in a city",
        "input_schema": WEATHER["function"]["parameters"],
    }  # type: ignore[index]
    kw: dict[str, Any] = {
        "model": "smol-hermes",
        "max_tokens": 40,
        "messages": messages,
        "tools": [tool],
        "extra_body": {"temperature": 0, "options": {"seed": 3}},
    }
    r = ant.messages.create(**kw)
    assert r.stop_reason == "tool_use"
    uses = [b for b in r.content if b.type == "tool_use"]
    assert len(uses) == 1 and uses[0].name == "get_weather" and uses[0].input == {"city": "Paris"}
    kinds = []
    with ant.messages.stream(**kw) as stream:
        for event in stream:
            if event.type == "content_block_delta":
                kinds.append(event.delta.type)
        final = stream.get_final_message()
    assert "input_json_delta" in kinds and final.stop_reason == "tool_use"
    assert [b.input for b in final.content if b.type == "tool_use"] == [{"city": "Paris"}]


def test_reasoning_asked_of_a_model_that_cannot_think_is_ignored(v1_daemon: Daemon) -> None:
    # as Ollama: the OpenAI and Anthropic layers do not refuse (Claude Code asks every model to think)
    oai = openai.OpenAI(base_url=v1_daemon.url + "/v1", api_key="unused", max_retries=0)
    r = oai.chat.completions.create(
        model="smol", messages=[{"role": "user", "content": "Hi"}], max_tokens=4, reasoning_effort="high"
    )
    assert r.choices[0].message.content and not (r.choices[0].message.model_extra or {}).get("reasoning")
    ant = anthropic.Anthropic(base_url=v1_daemon.url, api_key="unused", max_retries=0)
    m = ant.messages.create(
        model="smol",
        max_tokens=4,
        messages=[{"role": "user", "content": "Hi"}],
        thinking={"type": "enabled", "budget_tokens": 1024},
    )
    assert [b.type for b in m.content] == ["text"]
    with pytest.raises(openai.BadRequestError) as bad:
        oai.chat.completions.create(
            model="smol",
            messages=[{"role": "user", "content": "Hi"}],
            reasoning_effort="extreme",  # type: ignore[arg-type]
        )
    assert "invalid reasoning value" in bad.value.message
