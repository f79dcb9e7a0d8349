"""The Mistral-family parser (ministral, mistral): fixtures fed whole, split at every offset and one character at a
time, all giving the same content, thinking and calls."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from daemon.chat.parsers import parser_for
from daemon.chat.types import Message, ThinkValue, Tool
from tests.daemon.chat import feeding
from tests.daemon.chat.feeding import Result


def parse(
    text: str,
    name: str = "ministral",
    think: ThinkValue = None,
    tools: Sequence[Tool] | None = None,
    last: Message | None = None,
) -> Result:
    """:func:`feeding.parse` with the text first and ministral by default."""
    return feeding.parse(name, text, think, tools, last)


def tool(name: str) -> Tool:
    return Tool.of({"type": "function", "function": {"name": name, "parameters": {"type": "object", "properties": {}}}})


WEATHER = [tool("get_weather"), tool("get_time")]


def test_content_only() -> None:
    assert parse("Bonjour ! Comment puis-je aider ?") == ("Bonjour ! Comment puis-je aider ?", "", [])


def test_thinking_then_content() -> None:
    text = "[THINK]The user wants 2+2. That is 4.[/THINK]\n\nThe answer is 4."
    assert parse(text) == ("The answer is 4.", "The user wants 2+2. That is 4.", [])


def test_thinking_then_call() -> None:
    text = '[THINK]Need the weather.[/THINK][TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}'
    assert parse(text, tools=WEATHER) == ("", "Need the weather.", [("get_weather", {"city": "Paris"})])


def test_two_calls_and_text_after() -> None:
    text = (
        'Checking.\n[TOOL_CALLS]get_weather[ARGS]{"city": "NYC"}[TOOL_CALLS]get_time[ARGS]{"zone": "EST"}'
        "\nBoth requested."
    )
    assert parse(text, tools=WEATHER) == (
        "Checking.Both requested.",
        "",
        [("get_weather", {"city": "NYC"}), ("get_time", {"zone": "EST"})],
    )


def test_older_json_array_form() -> None:
    text = (
        '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Oslo"}}, '
        '{"name": "get_time", "arguments": "{\\"zone\\": \\"CET\\"}"}, {"name": "get_time"}]'
    )
    assert parse(text, name="mistral", tools=WEATHER) == (
        "",
        "",
        [("get_weather", {"city": "Oslo"}), ("get_time", {"zone": "CET"}), ("get_time", {})],
    )


def test_call_id_is_skipped() -> None:
    text = '[TOOL_CALLS]get_time[CALL_ID]a1B2c3D4e[ARGS]{"zone": "UTC"}'
    assert parse(text, tools=WEATHER) == ("", "", [("get_time", {"zone": "UTC"})])


def test_nested_json_with_brackets_in_strings() -> None:
    args = '{"template": "Hello {name}! ]}", "q": "say \\"hi\\" \\\\", "items": [{"id": 1}, {"id": [2, 3]}]}'
    want = {"template": "Hello {name}! ]}", "q": 'say "hi" \\', "items": [{"id": 1}, {"id": [2, 3]}]}
    assert parse(f"[TOOL_CALLS]format[ARGS]{args} ok") == ("ok", "", [("format", want)])


def test_undeclared_tool_is_returned() -> None:
    text = '[TOOL_CALLS]launch_rocket[ARGS]{"target": "moon"}'
    assert parse(text, tools=WEATHER) == ("", "", [("launch_rocket", {"target": "moon"})])


@pytest.mark.parametrize(
    "call",
    [
        '[TOOL_CALLS]get_weather[ARGS]{"city": }',  # broken JSON
        "[TOOL_CALLS]get_weather[ARGS]city=Paris",  # arguments not JSON
        '[TOOL_CALLS][{"name": "get_weather", "arguments": [1]}]',  # arguments not an object
        '[TOOL_CALLS][{"city": "Paris"}]',  # no name
        "[TOOL_CALLS] well, this is\nnot a call",  # prose after the tag
    ],
)
def test_malformed_call_is_content(call: str) -> None:
    assert parse(call + " Then text.", tools=WEATHER) == (call + " Then text.", "", [])


def test_cut_off_call_is_content() -> None:
    text = 'Sure. [TOOL_CALLS]get_weather[ARGS]{"city": "Par'
    assert parse(text) == ('Sure.[TOOL_CALLS]get_weather[ARGS]{"city": "Par', "", [])


def test_tag_lookalikes_are_content() -> None:
    text = "Arrays like [1, 2] and [TOOL or [THIN or [/THINK] stay [ARGS] text [TOOL_"
    assert parse(text) == (text, "", [])


def test_unclosed_thinking_is_thinking() -> None:
    assert parse("[THINK]Still going [/THI") == ("", "Still going [/THI", [])


def test_thinking_family_starts_inside_thinking() -> None:
    from daemon.chat.parsers.ministral import MinistralParser

    p = MinistralParser(has_thinking=True)
    p.init(None, None, True)
    got = p.add("Hmm.[/THINK]Yes.", True)
    assert (got.content, got.thinking) == ("Yes.", "Hmm.")
    p.init(None, Message(role="assistant", content="Partial"), True)
    got = p.add(" answer.", True)
    assert (got.content, got.thinking) == (" answer.", "")


def test_registered_names() -> None:
    for name in ("ministral", "mistral"):
        p = parser_for(name)
        assert p is not None and p.has_tools and not p.has_thinking


_PIECES = st.sampled_from(
    [
        "[TOOL_CALLS]",
        "[THINK]",
        "[/THINK]",
        "[ARGS]",
        "[CALL_ID]",
        "f",
        '{"a": 1}',
        '[{"name": "g"}]',
        "{",
        "}",
        "[",
        "]",
        '"',
        "\\",
        " ",
        "\n",
        "x",
        "é",
    ]
)


@settings(max_examples=150, deadline=None)
@given(st.lists(_PIECES, max_size=14))
def test_fuzz_never_raises_and_splits_agree(pieces: list[str]) -> None:
    feeding.agrees("ministral", pieces)
