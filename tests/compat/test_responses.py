"""OpenAI's Responses API (``/v1/responses``) through the official ``openai`` SDK, against a real daemon."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import openai
import pytest

from tests.conftest import Daemon

pytestmark = pytest.mark.real_model
SEED = {"seed": 3}

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


@pytest.fixture
def client(v1_daemon: Daemon) -> openai.OpenAI:
    return openai.OpenAI(base_url=v1_daemon.url + "/v1", api_key="unused", max_retries=0)


def _events(stream: Any) -> list[Any]:
    events = list(stream)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    return events


def test_text_input(client: openai.OpenAI) -> None:
    r = client.responses.create(
        model="smol",
        input="What is the capital of France?",
        max_output_tokens=24,
        temperature=0,
        extra_body={"options": SEED},
    )
    assert r.object == "response" and r.id.startswith("resp_") and r.model == "smol"
    assert r.status in ("completed", "incomplete") and r.created_at > 0
    assert r.output and r.output[0].type == "message" and r.output[0].role == "assistant"
    assert r.output[0].content[0].type == "output_text" and r.output_text
    assert r.output_text == r.output[0].content[0].text
    u = r.usage
    assert u is not None and u.input_tokens > 0 and 0 < u.output_tokens <= 24
    assert u.total_tokens == u.input_tokens + u.output_tokens
    assert u.input_tokens_details.cached_tokens >= 0 and u.output_tokens_details.reasoning_tokens == 0


def test_messages_with_instructions_streamed_and_whole_agree(client: openai.OpenAI) -> None:
    args: dict[str, Any] = {
        "model": "smol",
        "instructions": "Answer with one word.",
        "input": [
            {"role": "user", "content": "Hi!"},
            {"role": "assistant", "content": [{"type": "output_text", "text": "Hello! How can I help?"}]},
            {"role": "user", "content": [{"type": "input_text", "text": "Name a colour."}]},
        ],
        "max_output_tokens": 48,
        "temperature": 0,
        # stop at the end of the first line, so the answer completes before the limit
        "extra_body": {"options": {**SEED, "stop": ["\n"]}},
    }
    whole = client.responses.create(**args)
    assert whole.status == "completed" and whole.incomplete_details is None
    assert whole.instructions == "Answer with one word." and whole.output_text
    events = _events(client.responses.create(stream=True, **args))
    kinds = [e.type for e in events]
    assert kinds[2:4] == ["response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == events[-4].text
    done = events[-1].response
    assert done.status == "completed" and done.output_text == text
    assert done.output[0].id == events[2].item.id  # one message item from added to done
    assert done.usage is not None and whole.usage is not None
    assert done.usage.output_tokens == whole.usage.output_tokens
    # the same prompt again: all of it but the last token comes from the KV cache, and usage says so
    assert done.usage.input_tokens == whole.usage.input_tokens
    assert done.usage.input_tokens_details.cached_tokens == whole.usage.input_tokens - 1


def test_function_call_and_its_output(client: openai.OpenAI) -> None:
    question = {"role": "user", "content": "What is the weather in Paris?"}
    r = client.responses.create(
        model="smol-tools",
        input=[question],
        tools=[WEATHER],
        tool_choice="required",
        max_output_tokens=40,
        temperature=0,
        extra_body={"options": SEED},
    )
    calls = [o for o in r.output if o.type == "function_call"]
    assert r.status == "completed" and calls
    call = calls[0]
    assert call.name == "get_weather" and call.call_id and call.id and call.status == "completed"
    assert isinstance(json.loads(call.arguments)["city"], str)
    assert r.tools and r.tools[0].name == "get_weather"

    streamed = _events(
        client.responses.create(
            model="smol-tools",
            input=[question],
            tools=[WEATHER],
            tool_choice={"type": "function", "name": "get_weather"},
            max_output_tokens=40,
            temperature=0,
            stream=True,
            extra_body={"options": SEED},
        )
    )
    kinds = [e.type for e in streamed]
    assert kinds[2:] == [
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert streamed[2].item.type == "function_call" and streamed[2].item.status == "in_progress"
    assert json.loads(streamed[4].arguments) == json.loads(call.arguments) == json.loads(streamed[3].delta)
    assert streamed[-1].response.output[0].arguments == streamed[4].arguments

    after = client.responses.create(
        model="smol-tools",
        input=[
            question,
            call.model_dump(exclude_none=True),  # sent back as the SDK returned it (with its id and status)
            {"type": "function_call_output", "call_id": call.call_id, "output": "18 degrees and sunny"},
        ],
        tools=[WEATHER],
        tool_choice="none",
        max_output_tokens=30,
        temperature=0,
        extra_body={"options": SEED},
    )
    assert [o.type for o in after.output] == ["message"] and after.output_text
    assert after.status in ("completed", "incomplete")


def test_json_schema_output_validates(client: openai.OpenAI) -> None:
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    r = client.responses.create(
        model="smol",
        input="Invent a person with a name and an age.",
        text={"format": {"type": "json_schema", "name": "person", "schema": schema, "strict": True}},
        max_output_tokens=60,
        temperature=0,
        extra_body={"options": SEED},
    )
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), schema)
    assert r.text is not None and r.text.format.type == "json_schema"  # echoed back
    obj = client.responses.create(
        model="smol",
        input="A JSON object, please.",
        text={"format": {"type": "json_object"}},
        max_output_tokens=200,
        temperature=0,
        extra_body={"options": SEED},
    )
    if obj.status == "completed":  # the grammar let it close the object: it parses
        assert isinstance(json.loads(obj.output_text), dict)
    else:  # a small model may ramble past the limit inside the object
        assert obj.output_text.lstrip().startswith("{")


def test_max_output_tokens_makes_it_incomplete(client: openai.OpenAI) -> None:
    args: dict[str, Any] = {
        "model": "smol",
        "input": "Write a long story about a dragon.",
        "max_output_tokens": 3,
        "temperature": 0,
        "extra_body": {"options": SEED},
    }
    r = client.responses.create(**args)
    assert r.status == "incomplete" and r.incomplete_details is not None
    assert r.incomplete_details.reason == "max_output_tokens"
    assert r.usage is not None and r.usage.output_tokens == 3 and r.output_text
    assert r.output[0].status == "incomplete"
    events = _events(client.responses.create(stream=True, **args))
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"
    assert events[-1].response.output_text == r.output_text


def test_a_limit_the_client_did_not_set_completes(client: openai.OpenAI) -> None:
    """Cut by num_predict (a Modelfile's or options'), not by max_output_tokens: "completed", as Ollama answers;
    Codex, which never sets max_output_tokens, fails a whole turn on response.incomplete."""
    args: dict[str, Any] = {
        "model": "smol",
        "input": "Write a long story about a dragon.",
        "temperature": 0,
        "extra_body": {"options": {**SEED, "num_predict": 3}},
    }
    r = client.responses.create(**args)
    assert r.status == "completed" and r.incomplete_details is None
    assert r.usage is not None and r.usage.output_tokens == 3
    events = _events(client.responses.create(stream=True, **args))
    assert events[-1].type == "response.completed"


def test_errors_in_openai_shape(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as stateful:
        client.responses.create(model="smol", input="And then?", previous_response_id="resp_123")
    assert stateful.value.status_code == 400 and "does not store responses" in stateful.value.message
    assert stateful.value.param == "previous_response_id"
    with pytest.raises(openai.BadRequestError) as hosted:  # forcing a call when the only tool is a hosted one
        client.responses.create(model="smol", input="x", tools=[{"type": "web_search"}], tool_choice="required")
    assert hosted.value.param == "tool_choice" and "none of the 'tools' is a function" in hosted.value.message
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model="smol", input=[{"type": "mystery"}])
    with pytest.raises(openai.NotFoundError) as missing:
        client.responses.create(model="no-such-model", input="x")
    assert "no-such-model" in missing.value.message


def test_hosted_tools_are_left_out_as_in_ollama(client: openai.OpenAI) -> None:
    # Codex sends web_search (and a namespace tool) on every request: corral runs no hosted tool, so the model is
    # not offered it, and the request is answered rather than refused
    r = client.responses.create(
        model="smol",
        input="Hi",
        tools=[{"type": "web_search"}, {"type": "file_search", "vector_store_ids": ["vs_1"]}],
        max_output_tokens=4,
        temperature=0,
        extra_body={"options": SEED},
    )
    assert r.output_text and [o.type for o in r.output] == ["message"]
    assert [t.type for t in r.tools] == ["web_search", "file_search"]  # echoed as sent


def test_reasoning_effort_is_ignored_by_a_model_that_cannot_think(client: openai.OpenAI) -> None:
    r = client.responses.create(
        model="smol",
        input="Hi",
        reasoning={"effort": "low", "summary": "auto"},
        store=True,  # accepted and ignored: corral stores nothing
        max_output_tokens=4,
        temperature=0,
        extra_body={"options": SEED},
    )
    assert r.output_text and r.model_dump()["store"] is False
    assert r.reasoning is not None and r.reasoning.effort == "low"
    assert [o.type for o in r.output] == ["message"]


def test_logprobs_on_output_text(client: openai.OpenAI) -> None:
    r = client.responses.create(
        model="smol",
        input="Hi",
        include=["message.output_text.logprobs"],
        top_logprobs=2,
        max_output_tokens=4,
        temperature=0,
        extra_body={"options": {**SEED, "repeat_penalty": 1.0}},
    )
    part = r.output[0].content[0]
    assert part.logprobs and len(part.logprobs) == r.usage.output_tokens
    assert "".join(t.token for t in part.logprobs) == r.output_text
    assert all(t.logprob <= 0 and len(t.top_logprobs) == 2 for t in part.logprobs)
