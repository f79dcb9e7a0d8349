"""The harmony parser (gpt-oss): fixtures fed whole, split at every offset and one character at a time, all giving
the same content, thinking and calls; and the renaming of tools to harmony identifiers."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from daemon.chat.parsers import parser_for
from daemon.chat.parsers.harmony import parse_header
from daemon.chat.types import Message, ThinkValue, Tool
from tests.daemon.chat import feeding
from tests.daemon.chat.feeding import Result


def parse(
    text: str, think: ThinkValue = None, tools: Sequence[Tool] | None = None, last: Message | None = None
) -> Result:
    """:func:`feeding.parse` for harmony, the text first."""
    return feeding.parse("harmony", text, think, tools, last)


def tool(name: str) -> Tool:
    return Tool.of({"type": "function", "function": {"name": name, "parameters": {"type": "object", "properties": {}}}})


WEATHER = [tool("get_weather"), tool("get_time")]

# the prompt ends with "<|start|>assistant", so a reply starts at its channel
ANALYSIS = "<|channel|>analysis<|message|>"
NEXT = "<|start|>assistant"


def commentary_call(name: str, args: str, end: str = "<|call|>") -> str:
    return f"<|channel|>commentary to=functions.{name} <|constrain|>json<|message|>{args}{end}"


def test_thinking_then_content() -> None:
    text = f"{ANALYSIS}User says hi. Reply briefly.<|end|>{NEXT}<|channel|>final<|message|>Hello! 👋<|return|>"
    assert parse(text) == ("Hello! 👋", "User says hi. Reply briefly.", [])


def test_final_without_return_token() -> None:
    # <|return|> is a stop token: the runtime usually strips it
    text = f"{ANALYSIS}Simple.<|end|>{NEXT}<|channel|>final<|message|>Four."
    assert parse(text) == ("Four.", "Simple.", [])


def test_thinking_then_call() -> None:
    text = f"{ANALYSIS}Need weather for Paris.<|end|>{NEXT}" + commentary_call("get_weather", '{"city":"Paris"}')
    assert parse(text, tools=WEATHER) == ("", "Need weather for Paris.", [("get_weather", {"city": "Paris"})])


def test_call_ended_by_stop_token_missing() -> None:
    text = commentary_call("get_time", '{"zone": "UTC"}', end="")
    assert parse(text, tools=WEATHER) == ("", "", [("get_time", {"zone": "UTC"})])


@pytest.mark.parametrize(
    "header",
    [
        " to=functions.get_weather<|channel|>commentary <|constrain|>json",  # recipient before the channel
        " to=functions.get_weather<|channel|>commentary<|constrain|>json",
        "<|channel|>commentary to=functions.get_weather<|constrain|>json",
        "<|channel|>analysis to=functions.get_weather <|constrain|>json",  # a call from the analysis channel
        "<|channel|>commentary to=functions.get_weather json",
    ],
)
def test_recipient_positions(header: str) -> None:
    text = header + '<|message|>{"city": "Lima"}<|call|>'
    assert parse(text, tools=WEATHER) == ("", "", [("get_weather", {"city": "Lima"})])


def test_two_calls_and_text_after() -> None:
    text = (
        commentary_call("get_weather", '{"city": "Oslo"}')
        + NEXT
        + commentary_call("get_time", "{}")
        + f"{NEXT}<|channel|>final<|message|>Both fetched.<|return|>"
    )
    assert parse(text, tools=WEATHER) == (
        "Both fetched.",
        "",
        [("get_weather", {"city": "Oslo"}), ("get_time", {})],
    )


def test_undeclared_tool_is_returned() -> None:
    text = commentary_call("launch_rocket", '{"to": "moon"}')
    assert parse(text, tools=WEATHER) == ("", "", [("launch_rocket", {"to": "moon"})])


@pytest.mark.parametrize("body", ['{"city": }', "[1, 2]", "not json"])
def test_malformed_call_is_content(body: str) -> None:
    text = commentary_call("get_weather", body) + f"{NEXT}<|channel|>final<|message|>Sorry.<|return|>"
    assert parse(text, tools=WEATHER) == (body + "Sorry.", "", [])


def test_commentary_preamble_is_content() -> None:
    text = f"<|channel|>commentary<|message|>Checking now.<|end|>{NEXT}" + commentary_call("get_time", "{}")
    assert parse(text, tools=WEATHER) == ("Checking now.", "", [("get_time", {})])


def test_renamed_tools_map_back() -> None:
    tools = [tool("get-weather"), tool("get weather.v2"), tool("a_b"), tool("a-b"), tool("2fast"), tool("!!!")]
    tools.append(tool("browser.search"))
    p = parser_for("harmony")
    assert p is not None
    rendered = p.init(tools, None, None)
    assert rendered is not None
    names = [t.name for t in rendered]
    assert names == ["get_weather", "get_weather_v2", "a_b", "a_b_2", "_2fast", "unnamed", "browser.search"]
    assert [t.name for t in tools][0] == "get-weather"  # the request's tools are not changed
    text = commentary_call("get_weather", '{"city": "Rome"}') + NEXT + commentary_call("a_b_2", "{}")
    assert parse(text, tools=tools)[2] == [("get-weather", {"city": "Rome"}), ("a-b", {})]


def test_no_tools_is_kept() -> None:
    p = parser_for("harmony")
    assert p is not None
    assert p.init(None, None, True) is None
    assert p.init([], None, True) == []


def test_prefill_continues_its_message() -> None:
    last = Message(role="assistant", content="The answer")
    assert parse(" is four.<|return|>", last=last) == (" is four.", "", [])
    last = Message(role="assistant", content="", thinking="Let me")
    assert parse(f" see.<|end|>{NEXT}<|channel|>final<|message|>Done.", last=last) == ("Done.", " see.", [])


def test_full_message_start_and_stray_text() -> None:
    # a reply that repeats the header start, and text between messages, are handled; nothing is lost
    text = "<|channel|>analysis<|message|>a<|end|> stray <|start|>assistant<|channel|>final<|message|>b<|end|>\n"
    assert parse(text) == (" strayb", "a", [])


def test_not_harmony_at_all_is_content() -> None:
    assert parse("Just plain text, no tokens.") == ("Just plain text, no tokens.", "", [])


def test_cut_off_header_is_dropped() -> None:
    assert parse(f"{ANALYSIS}Hmm.<|end|>{NEXT}<|channel|>fin") == ("", "Hmm.", [])


def test_tag_lookalikes_in_body() -> None:
    text = "<|channel|>final<|message|>Use <|en and <| or <|call in text<|end|>"
    assert parse(text) == ("Use <|en and <| or <|call in text", "", [])


@pytest.mark.parametrize(
    ("raw", "want"),
    [
        ("assistant<|channel|>analysis", ("assistant", "analysis", "")),
        ("assistant<|channel|>commentary to=functions.f <|constrain|>json", ("assistant", "commentary", "functions.f")),
        ("assistant to=functions.f<|channel|>commentary", ("assistant", "commentary", "functions.f")),
        ("to=functions.f<|channel|>analysis", ("tool", "analysis", "functions.f")),
        ("assistant to=functions.f abc<|channel|>analysis", ("assistant", "analysis", "functions.f")),
        ("", ("", "", "")),
    ],
)
def test_parse_header(raw: str, want: tuple[str, str, str]) -> None:
    assert parse_header(raw) == want


_PIECES = st.sampled_from(
    [
        "<|start|>",
        "assistant",
        "<|channel|>",
        "analysis",
        "final",
        "commentary",
        " to=functions.f",
        "<|constrain|>",
        "json",
        "<|message|>",
        "<|end|>",
        "<|call|>",
        "<|return|>",
        '{"a": 1}',
        "{",
        "}",
        "x",
        " ",
        "\n",
        "<|",
        "é",
    ]
)


@settings(max_examples=150, deadline=None)
@given(st.lists(_PIECES, max_size=14))
def test_fuzz_never_raises_and_splits_agree(pieces: list[str]) -> None:
    feeding.agrees("harmony", pieces)
