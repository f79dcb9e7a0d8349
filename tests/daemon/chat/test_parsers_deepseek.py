"""The DeepSeek-shaped parsers (deepseek3, deepseek-r1, cogito): fixtures fed whole, split at every offset and one
character at a time, all giving the same content, thinking and calls."""

from __future__ import annotations

import pytest

from daemon.chat.parsers import parser_for
from daemon.chat.types import Message, Tool
from tests.daemon.chat.feeding import parse

# DeepSeek's special tokens: full-width vertical bars (U+FF5C) around words joined by U+2581
CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
CALLS_END = "<｜tool▁calls▁end｜>"
CALL_BEGIN = "<｜tool▁call▁begin｜>"
CALL_END = "<｜tool▁call▁end｜>"
SEP = "<｜tool▁sep｜>"
OUT_BEGIN = "<｜tool▁output▁begin｜>"
OUT_END = "<｜tool▁output▁end｜>"


def call(name: str, args: str) -> str:
    return f"{CALL_BEGIN}{name}{SEP}{args}{CALL_END}"


def test_registered() -> None:
    for name in ("deepseek3", "deepseek-r1", "cogito"):
        p = parser_for(name)
        assert p is not None and p.has_tools and p.has_thinking


def test_content_only() -> None:
    assert parse("deepseek3", "Hello, how are you?") == ("Hello, how are you?", "", [])
    assert parse("deepseek3", "Line 1\n\nLine 3\t\tTabbed  ") == ("Line 1\n\nLine 3\t\tTabbed  ", "", [])
    assert parse("deepseek3", "") == ("", "", [])
    assert parse("deepseek3", "مرحبا 你好 🌍") == ("مرحبا 你好 🌍", "", [])


def test_thinking_then_content() -> None:
    text = "Let me think:\n- one\n- two  </think>\n\nHere's my answer."
    assert parse("deepseek3", text, think=True) == ("Here's my answer.", "Let me think:\n- one\n- two", [])
    assert parse("deepseek3", "我在思考...</think>答案是42。", think="high") == ("答案是42。", "我在思考...", [])


def test_thinking_off_keeps_tags_as_content() -> None:
    assert parse("deepseek3", "Some</think>more", think=False) == ("Some</think>more", "", [])
    # an assistant prefill with text has already left thinking
    prefill = Message(role="assistant", content="So far")
    assert parse("deepseek3", "rest</think>x", think=True, last=prefill) == ("rest</think>x", "", [])


def test_only_later_close_tags_are_content() -> None:
    got = parse("deepseek3", "First</think>Second</think>Final", think=True)
    assert got == ("Second</think>Final", "First", [])


def test_thinking_cut_off_is_flushed() -> None:
    assert parse("deepseek3", "Thinking content</th", think=True) == ("", "Thinking content</th", [])


def test_tool_call() -> None:
    text = "I'll check the weather." + CALLS_BEGIN + call("get_weather", '{"location":"Paris"}') + CALLS_END
    assert parse("deepseek3", text) == ("I'll check the weather.", "", [("get_weather", {"location": "Paris"})])


def test_thinking_then_call() -> None:
    text = "Need the weather.\n</think>\n\n" + CALLS_BEGIN + call("get_weather", '{"location": "Tokyo"}') + CALLS_END
    assert parse("deepseek3", text, think=True) == ("", "Need the weather.", [("get_weather", {"location": "Tokyo"})])


def test_two_calls_and_text_after() -> None:
    text = (
        "Both cities. \n"
        + CALLS_BEGIN
        + call("get_weather", '{"location":"Paris"}')
        + "\n"
        + call("get_weather", '{"location":"London","days":[1,2],"opts":{"metric":true,"t":0.5}}')
        + CALLS_END
        + "\n完成 ✅"
    )
    assert parse("deepseek3", text) == (
        "Both cities.完成 ✅",
        "",
        [
            ("get_weather", {"location": "Paris"}),
            ("get_weather", {"location": "London", "days": [1, 2], "opts": {"metric": True, "t": 0.5}}),
        ],
    )


def test_empty_arguments_and_escapes() -> None:
    text = CALLS_BEGIN + call("ping", "{}") + call("run", r'{"cmd":"ls && echo \"done\""}') + CALLS_END
    assert parse("deepseek3", text) == ("", "", [("ping", {}), ("run", {"cmd": 'ls && echo "done"'})])


def test_undeclared_tool_is_still_a_call() -> None:
    tools = [
        Tool.of({"type": "function", "function": {"name": "known", "parameters": {"type": "object", "properties": {}}}})
    ]
    text = CALLS_BEGIN + call("unknown_tool", '{"a":1}') + CALLS_END
    assert parse("deepseek3", text, tools=tools) == ("", "", [("unknown_tool", {"a": 1})])


@pytest.mark.parametrize(
    "inner",
    [
        'bad_tool{"arg":"value"}',  # no separator
        "bad_tool" + SEP + "{invalid json}",
        "bad_tool" + SEP + "[1, 2]",  # arguments must be an object
        SEP + "{}",  # no name
    ],
)
def test_malformed_call_is_content(inner: str) -> None:
    text = "Testing." + CALLS_BEGIN + CALL_BEGIN + inner + CALL_END + CALLS_END + " after"
    assert parse("deepseek3", text) == ("Testing." + CALL_BEGIN + inner + CALL_END + "after", "", [])


def test_unfinished_call_is_content() -> None:
    text = "Hi." + CALLS_BEGIN + CALL_BEGIN + "f" + SEP + '{"a":'
    assert parse("deepseek3", text) == ("Hi." + CALL_BEGIN + "f" + SEP + '{"a":', "", [])


def test_call_cut_before_end_token_still_counts() -> None:
    text = CALLS_BEGIN + CALL_BEGIN + "f" + SEP + '{"a": 1}'
    assert parse("deepseek3", text) == ("", "", [("f", {"a": 1})])


def test_partial_token_at_end_is_content() -> None:
    assert parse("deepseek3", "Content with partial <｜tool▁calls▁") == ("Content with partial <｜tool▁calls▁", "", [])


def test_tool_output_is_content() -> None:
    text = "Results: " + OUT_BEGIN + "Paris: 22°C" + OUT_END + " and " + OUT_BEGIN + OUT_END + "done"
    assert parse("deepseek3", text) == ("Results: Paris: 22°C and done", "", [])


def test_v3_fenced_call_shape() -> None:
    fenced = CALL_BEGIN + "function" + SEP + 'get_weather\n```json\n{"location": "Paris"}\n```' + CALL_END
    text = "<think>\nhmm\n</think>\n\n" + CALLS_BEGIN + fenced + CALLS_END
    assert parse("deepseek-r1", text, think=True) == ("", "hmm", [("get_weather", {"location": "Paris"})])


def test_r1_opens_thinking_itself() -> None:
    text = "<think>\nI should say hi.\n</think>\n\nHi!"
    assert parse("deepseek-r1", text, think=True) == ("Hi!", "I should say hi.", [])
    # asked or not, its thinking never shows as content
    assert parse("deepseek-r1", text, think=False) == ("Hi!", "I should say hi.", [])
    # the prompt opened it: output starts inside thinking
    assert parse("deepseek-r1", "  plan</think>answer", think=True) == ("answer", "plan", [])
    # not asked and not written: all content, a later <think> included
    assert parse("deepseek-r1", "  a <think> b", think=False) == ("  a <think> b", "", [])


def test_r1_cut_off_at_start() -> None:
    assert parse("deepseek-r1", " <thi", think=False) == (" <thi", "", [])
    assert parse("deepseek-r1", "<think>", think=False) == ("", "", [])


def test_cogito() -> None:
    fenced = CALL_BEGIN + "function" + SEP + 'get_weather\n```json\n{"location":"Paris"}\n```' + CALL_END
    tools = [Tool.of({"type": "function", "function": {"name": "get_weather"}})]
    # no thinking when tools are offered
    got = parse("cogito", "Checking.</think>" + CALLS_BEGIN + fenced + CALLS_END, think=True, tools=tools)
    assert got == ("Checking.</think>", "", [("get_weather", {"location": "Paris"})])
    assert parse("cogito", "line 1\nline 2</think>Final.", think=True) == ("Final.", "line 1\nline 2", [])
    outputs = "<｜tool▁outputs▁begin｜>" + OUT_BEGIN + '{"t": 22}' + OUT_END + "<｜tool▁outputs▁end｜>"
    assert parse("cogito", "A" + outputs + " B") == ("AB", "", [])
