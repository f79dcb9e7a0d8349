"""The /v1 shims' request translation and stream framing as units (no daemon, no model)."""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

import pytest

from daemon.api.compat import BadParam, get, guarded
from daemon.api.routes import anthropic as anth
from daemon.api.routes import openai as oai
from daemon.chat.types import Finished, Message, ToolCall
from errors import CorralError

pytestmark = pytest.mark.anyio


def test_openai_messages_translate() -> None:
    body = {
        "messages": [
            {"role": "developer", "content": "Be brief."},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "Look:"},
                    {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                ],
            },
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "cold"},
        ]
    }
    system, user, assistant, tool = oai._messages(body)
    assert system == Message(role="system", content="Be brief.")
    assert user == Message(role="user", content="Look:", images=("AAAA",))
    assert assistant.tool_calls == (ToolCall(name="get_weather", arguments={"city": "Oslo"}, id="call_1"),)
    assert tool == Message(role="tool", content="cold", tool_call_id="call_1", tool_name="get_weather")


def test_openai_bad_tool_arguments_are_named() -> None:
    body = {"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}]}]}
    with pytest.raises(BadParam) as bad:
        oai._messages(body)
    assert bad.value.param == "messages[0].tool_calls[0].function.arguments"
    body["messages"][0]["tool_calls"][0]["function"]["arguments"] = "[1, 2]"  # JSON, but not an object
    with pytest.raises(BadParam) as bad:
        oai._messages(body)
    assert bad.value.param == "messages[0].tool_calls[0].function.arguments"


def test_openai_options() -> None:
    assert oai._options({}) == ({"temperature": 1.0, "top_p": 1.0}, ())
    opts = oai._options(
        {
            "temperature": 0,
            "seed": 7,
            "max_tokens": 9,
            "max_completion_tokens": 5,
            "stop": "\n",
            "frequency_penalty": 0.5,
            "options": {"num_ctx": 512, "top_p": 0.5},
        }
    )
    assert opts == (
        {
            "temperature": 0,
            "top_p": 0.5,
            "seed": 7,
            "num_predict": 5,
            "stop": ["\n"],
            "frequency_penalty": 0.5,
            "num_ctx": 512,
        },
        (),
    )
    # logit_bias parsed once, out of the options: the body's own wins over one in options (a corral extension)
    assert oai._options({"logit_bias": {"7": 5, "3": -100}, "options": {"logit_bias": {"9": 1}}})[1] == (
        (3, -100.0),
        (7, 5.0),
    )
    assert oai._options({"options": {"logit_bias": [[9, 1]]}}) == ({"temperature": 1.0, "top_p": 1.0}, ((9, 1.0),))
    with pytest.raises(BadParam) as bad:
        oai._options({"seed": 1.5})
    assert bad.value.param == "seed" and "an integer" in str(bad.value)


def test_openai_tool_choice_forces_a_call_by_schema() -> None:
    fn = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    other = {"type": "function", "function": {"name": "g"}}
    tools, forced = oai._tools({"tools": [fn, other], "tool_choice": {"type": "function", "function": {"name": "f"}}})
    assert tools == [fn, other]
    assert forced == {
        "type": "object",
        "properties": {"name": {"const": "f"}, "arguments": {"type": "object"}},
        "required": ["name", "arguments"],
    }
    assert len(oai._tools({"tools": [fn, other], "tool_choice": "required"})[1]["anyOf"]) == 2
    assert oai._tools({"tools": [fn], "tool_choice": "none"}) == (None, None)
    assert oai._tools({"tools": [fn]}) == ([fn], None)
    with pytest.raises(BadParam, match="not among the tools"):
        oai._tools({"tools": [fn], "tool_choice": {"type": "function", "function": {"name": "h"}}})


def test_completion_logprobs_offsets() -> None:
    entries = [
        {"token": "He", "logprob": -0.5, "top_logprobs": [{"token": "He", "logprob": -0.5}]},
        {"token": "llo", "logprob": -1.0},
    ]
    assert oai._completion_logprobs(entries, 3) == {
        "tokens": ["He", "llo"],
        "token_logprobs": [-0.5, -1.0],
        "top_logprobs": [{"He": -0.5}, {}],
        "text_offset": [3, 5],
    }


def test_get_checks_ranges() -> None:
    assert get({"x": 1}, "x", "num", lo=0, hi=2) == 1
    with pytest.raises(BadParam, match="'x' must be at least 1, got 0"):
        get({"x": 0}, "x", "int", lo=1)
    with pytest.raises(BadParam, match="got a boolean"):
        get({"x": True}, "x", "int")


def test_anthropic_messages_translate() -> None:
    body = {
        "system": [{"type": "text", "text": "Be brief."}],
        "messages": [
            {"role": "user", "content": "Weather?"},
            {
                "role": "assistant",
                "content": [
                    {"type": "text", "text": "Checking."},
                    {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Oslo"}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "cold"}]}
                ],
            },
        ],
    }
    assert anth._messages(body) == [
        Message(role="system", content="Be brief."),
        Message(role="user", content="Weather?"),
        Message(
            role="assistant",
            content="Checking.",
            tool_calls=(ToolCall(name="get_weather", arguments={"city": "Oslo"}, id="toolu_1"),),
        ),
        Message(role="tool", content="cold", tool_call_id="toolu_1", tool_name="get_weather"),
    ]
    with pytest.raises(BadParam) as bad:
        anth._messages(
            {
                "messages": [
                    {
                        "role": "assistant",
                        "content": [{"type": "tool_use", "id": "t", "name": "f", "input": "city=Oslo"}],
                    }
                ]
            }
        )
    assert bad.value.param == "messages[0].content[0].input"


def test_anthropic_stop_reasons() -> None:
    assert anth._stop_reason(Finished("stop"), True) == ("tool_use", None)
    assert anth._stop_reason(Finished("length"), False) == ("max_tokens", None)
    assert anth._stop_reason(Finished("stop", stop_sequence="!"), False) == ("stop_sequence", "!")
    assert anth._stop_reason(Finished("stop"), False) == ("end_turn", None)


class Chunks:
    """A runner stream stand-in that records being closed."""

    def __init__(self) -> None:
        self.closed = False

    def __aiter__(self) -> Chunks:
        return self

    async def __anext__(self) -> dict[str, Any]:
        raise StopAsyncIteration

    async def aclose(self) -> None:
        self.closed = True


async def test_an_error_mid_stream_is_an_error_event_then_done() -> None:
    async def frames() -> AsyncGenerator[bytes, None]:
        yield b"data: 1\n\n"
        raise CorralError("runner crashed")

    rest = Chunks()
    out = [f async for f in oai.openai_stream(frames(), rest)]
    assert out[0] == b"data: 1\n\n" and out[-1] == b"data: [DONE]\n\n"
    assert json.loads(out[1][len(b"data: ") :])["error"]["message"] == "runner crashed"
    assert rest.closed

    rest = Chunks()
    out = [f async for f in guarded(frames(), rest, anth._error_event)]
    assert out[1].startswith(b"event: error\n") and rest.closed


async def test_a_client_leaving_closes_the_runner_stream() -> None:
    async def frames() -> AsyncGenerator[bytes, None]:
        while True:
            yield b"data: x\n\n"

    rest = Chunks()
    body: AsyncIterator[bytes] = oai.openai_stream(frames(), rest)
    assert await anext(body) == b"data: x\n\n"
    await body.aclose()  # type: ignore[attr-defined]
    assert rest.closed
