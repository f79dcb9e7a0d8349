"""The OpenAI API through the official ``openai`` SDK, as a user's app would use it, against a real daemon."""

from __future__ import annotations

import base64
import json
import struct

import httpx
import jsonschema
import openai
import pytest

from tests.conftest import Daemon

pytestmark = pytest.mark.real_model
GREEDY = {"temperature": 0, "seed": 3}


@pytest.fixture
def client(v1_daemon: Daemon) -> openai.OpenAI:
    return openai.OpenAI(base_url=v1_daemon.url + "/v1", api_key="unused", max_retries=0)


def test_chat_plain_and_streamed_agree(client: openai.OpenAI) -> None:
    msgs = [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": [{"type": "text", "text": "What is the capital of France?"}]},
    ]
    r = client.chat.completions.create(model="smol", messages=msgs, max_tokens=16, **GREEDY)  # type: ignore[arg-type]
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content
    assert r.choices[0].finish_reason in ("stop", "length") and r.usage and r.usage.completion_tokens > 0
    chunks = list(
        client.chat.completions.create(
            model="smol",
            messages=msgs,
            max_tokens=16,
            stream=True,  # type: ignore[arg-type]
            stream_options={"include_usage": True},
            **GREEDY,
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == r.choices[0].message.content
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == r.usage.completion_tokens
    # the same prompt again: all of it but the last token comes from the KV cache, and usage says so
    assert chunks[-1].usage.prompt_tokens == r.usage.prompt_tokens
    assert chunks[-1].usage.prompt_tokens_details is not None
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == r.usage.prompt_tokens - 1
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == r.choices[0].finish_reason


def test_greedy_v1_equals_api_chat(client: openai.OpenAI, v1_daemon: Daemon) -> None:
    msgs = [{"role": "user", "content": "Name three colours."}]
    v1 = client.chat.completions.create(
        model="smol",
        messages=msgs,
        max_tokens=24,
        top_p=0.9,  # type: ignore[arg-type]
        extra_body={"options": {"top_k": 40, "repeat_penalty": 1.1}},
        **GREEDY,
    )
    api = httpx.post(
        v1_daemon.url + "/api/chat",
        json={
            "model": "smol",
            "messages": msgs,
            "stream": False,
            "options": {
                "temperature": 0,
                "seed": 3,
                "num_predict": 24,
                "top_p": 0.9,
                "top_k": 40,
                "repeat_penalty": 1.1,
            },
        },
        timeout=120,
    ).json()
    assert v1.choices[0].message.content == api["message"]["content"]


def test_options_through_extra_body(client: openai.OpenAI, v1_daemon: Daemon) -> None:
    client.chat.completions.create(
        model="smol",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=2,
        extra_body={"options": {"num_ctx": 1024}},
    )
    ps = httpx.get(v1_daemon.url + "/api/ps").json()["models"]
    assert any(m["name"] == "smol:latest" and m["context_length"] == 1024 for m in ps)


def test_completions(client: openai.OpenAI) -> None:
    r = client.completions.create(model="smol", prompt="The sky is", max_tokens=8, echo=True, **GREEDY)
    assert r.object == "text_completion" and r.choices[0].text.startswith("The sky is")
    assert len(r.choices[0].text) > len("The sky is") and r.usage and r.usage.completion_tokens <= 8
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(model="smol", prompt="The sky is", max_tokens=8, stream=True, **GREEDY)
        if c.choices
    )
    assert "The sky is" + streamed == r.choices[0].text


def test_embeddings_float_and_base64(client: openai.OpenAI) -> None:
    floats = client.embeddings.create(model="smol", input=["hello world", "goodbye"], encoding_format="float")
    assert [d.index for d in floats.data] == [0, 1] and len(floats.data[0].embedding) > 100
    raw = client.with_raw_response.embeddings.create(model="smol", input="hello world", encoding_format="base64")
    b64 = json.loads(raw.text)["data"][0]["embedding"]
    decoded = struct.unpack(f"<{len(base64.b64decode(b64)) // 4}f", base64.b64decode(b64))
    assert decoded == pytest.approx(floats.data[0].embedding, rel=1e-6, abs=1e-7)
    short = client.embeddings.create(model="smol", input="hello world", dimensions=16)
    assert len(short.data[0].embedding) == 16


def test_models(client: openai.OpenAI) -> None:
    ids = [m.id for m in client.models.list()]
    assert "smol:latest" in ids and "smol-tools:latest" in ids
    m = client.models.retrieve("smol")
    assert m.id == "smol:latest" and m.owned_by == "library" and m.created > 0


def test_json_schema_output_validates(client: openai.OpenAI) -> None:
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    r = client.chat.completions.create(
        model="smol",
        messages=[{"role": "user", "content": "Invent a person with a name and an age."}],
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema}},
        max_tokens=60,
        **GREEDY,
    )
    jsonschema.validate(json.loads(r.choices[0].message.content or ""), schema)
    obj = client.chat.completions.create(
        model="smol",
        messages=[{"role": "user", "content": "A JSON object, please."}],
        response_format={"type": "json_object"},
        max_tokens=200,
        **GREEDY,
    )
    text = obj.choices[0].message.content or ""
    if obj.choices[0].finish_reason == "stop":  # the grammar let it close the object: it parses
        assert isinstance(json.loads(text), dict)
    else:  # greedy output differs between CPUs, and a small model may ramble past max_tokens inside the object
        assert obj.choices[0].finish_reason == "length" and text.lstrip().startswith("{")


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


def test_tool_call_round_trip(client: openai.OpenAI) -> None:
    msgs: list[dict[str, object]] = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = client.chat.completions.create(
        model="smol-tools",
        messages=msgs,
        tools=[WEATHER],  # type: ignore[arg-type,list-item]
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=40,
        **GREEDY,
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    call = choice.message.tool_calls[0]
    assert call.function.name == "get_weather" and isinstance(json.loads(call.function.arguments)["city"], str)
    streamed = list(
        client.chat.completions.create(
            model="smol-tools",
            messages=msgs,
            tools=[WEATHER],
            stream=True,  # type: ignore[arg-type,list-item]
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
            max_tokens=40,
            **GREEDY,
        )
    )
    deltas = [tc for c in streamed if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert deltas and json.loads(deltas[0].function.arguments or "") == json.loads(call.function.arguments)
    assert [c.choices[0].finish_reason for c in streamed if c.choices][-1] == "tool_calls"
    msgs += [
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "18 degrees and sunny"},
    ]
    after = client.chat.completions.create(
        model="smol-tools",
        messages=msgs,
        tools=[WEATHER],
        tool_choice="none",  # type: ignore[arg-type,list-item]
        max_tokens=30,
        **GREEDY,
    )
    assert after.choices[0].message.content and after.choices[0].finish_reason in ("stop", "length")


def test_logprobs(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model="smol",
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=4,
        logprobs=True,
        top_logprobs=3,
        extra_body={"options": {"repeat_penalty": 1.0}},
        **GREEDY,
    )
    content = r.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content and len(content) == r.usage.completion_tokens  # type: ignore[union-attr]
    assert "".join(t.token for t in content) == r.choices[0].message.content
    assert all(t.logprob <= 0 and len(t.top_logprobs) == 3 for t in content)
    assert content[0].top_logprobs[0].logprob == pytest.approx(content[0].logprob)  # greedy: the best one


def test_errors_in_openai_shape(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "x"}])
    assert "no-such-model" in missing.value.message
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")
    with pytest.raises(openai.BadRequestError) as empty:
        client.chat.completions.create(model="smol", messages=[])
    assert empty.value.body["param"] == "messages"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model="smol", messages=[{"role": "user", "content": "x"}], temperature="hot")  # type: ignore[arg-type]
    assert bad.value.body["param"] == "temperature" and "number" in bad.value.message  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as opt:
        client.chat.completions.create(
            model="smol", messages=[{"role": "user", "content": "x"}], extra_body={"options": {"num_ctx": "big"}}
        )
    assert "num_ctx" in opt.value.message


def test_completions_logprobs(client: openai.OpenAI) -> None:
    r = client.completions.create(
        model="smol",
        prompt="The sky is",
        max_tokens=4,
        logprobs=2,
        echo=True,
        extra_body={"options": {"repeat_penalty": 1.0}},
        **GREEDY,
    )
    lp = r.choices[0].logprobs
    assert lp and lp.tokens and lp.token_logprobs and lp.top_logprobs and lp.text_offset
    assert "The sky is" + "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset[0] == len("The sky is")
    assert all(len(top) <= 2 and v <= 0 for top, v in zip(lp.top_logprobs, lp.token_logprobs, strict=True))
    # greedy without a repeat penalty picks the most likely token (logprobs are the model's, before penalties)
    assert lp.token_logprobs[0] == pytest.approx(max(lp.top_logprobs[0].values()))


@pytest.mark.parametrize(
    "kwargs, param, words",
    [
        ({"n": 17}, "n", "between 1 and 16"),
        ({"temperature": 3}, "temperature", "between 0 and 2"),
        ({"max_tokens": 0}, "max_tokens", "at least 1"),
        ({"top_logprobs": 2}, "top_logprobs", "logprobs"),
        ({"tool_choice": "required"}, "tool_choice", "no 'tools'"),
        ({"logit_bias": {"one": 5}}, "logit_bias", "token ids"),
        ({"stop": ["a", 1]}, "stop", "array of strings"),
        ({"response_format": {"type": "yaml"}}, "response_format.type", "json_schema"),
        ({"messages": [{"role": "user", "content": None}]}, "messages[0].content", "required"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role", "robot"),
        (
            {
                "messages": [
                    {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://x/y.png"}}]}
                ]
            },
            "messages[0].content[0].image_url",
            "never fetches",
        ),
    ],
)
def test_bad_parameters_are_named(client: openai.OpenAI, kwargs: dict[str, object], param: str, words: str) -> None:
    body: dict[str, object] = {"model": "smol", "messages": [{"role": "user", "content": "x"}], **kwargs}
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(**body)  # type: ignore[call-overload]
    assert bad.value.body["param"] == param and words in bad.value.message  # type: ignore[index]
    assert bad.value.body["type"] == "invalid_request_error"  # type: ignore[index]
