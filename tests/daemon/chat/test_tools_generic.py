"""The generic tag + JSON tool-call parser, the generic chat parser, and the llama3 / json-tools families. Every
fixture is fed whole, split at every offset, and one character at a time."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest

from daemon.chat.parsers import parser_for
from daemon.chat.parsers.tools import GenericParser, ToolCallParser
from daemon.chat.types import Message, ThinkValue, Tool, ToolCall
from tests.daemon.chat import feeding


def _tool(name: str) -> Tool:
    return Tool.of({"type": "function", "function": {"name": name, "parameters": {"type": "object", "properties": {}}}})


TOOLS = [_tool("get_weather"), _tool("get_time"), _tool("say_hello"), _tool("get")]


def split_all(text: str) -> list[list[str]]:
    """:func:`feeding.split_all` with sparser three-piece cuts (these fixtures are longer)."""
    return feeding.split_all(text, 7, 11)


def run_tools(pieces: Sequence[str], tag: str, tools: Any = TOOLS, leading: bool = False) -> tuple[str, list[ToolCall]]:
    p = ToolCallParser(tag, tools, leading_json=leading)
    content, calls = "", []
    for i, piece in enumerate(pieces):
        c, text = p.add(piece, done=i == len(pieces) - 1)
        content += text
        calls += c
    if not pieces:
        calls += p.add("", done=True)[0]
    return content, calls


def W(city: str) -> ToolCall:
    return ToolCall("get_weather", {"city": city})


TAGGED = [
    # (output, content, calls)
    ("Hello, nothing to call here.", "Hello, nothing to call here.", []),
    ("", "", []),
    ('<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>', "", [W("Oslo")]),
    ('<tool_call>\n{"name": "say_hello", "arguments": {}}\n</tool_call>', "", [ToolCall("say_hello", {})]),
    ('<tool_call>{"name": "say_hello"}</tool_call>', "", [ToolCall("say_hello", {})]),
    (
        'Checking the weather. <tool_call>{"name": "get_weather", "arguments": {"city": "Lima"}}</tool_call>',
        "Checking the weather. ",
        [W("Lima")],
    ),
    (
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>\n'
        '<tool_call>{"name": "get_time", "arguments": {"zone": "CET"}}</tool_call>',
        "",
        [W("Rome"), ToolCall("get_time", {"zone": "CET"})],
    ),
    # arguments given as a JSON string, OpenAI's function shape, "parameters", a brace inside a string
    (
        '<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Kyiv\\"}"}</tool_call>',
        "",
        [W("Kyiv")],
    ),
    (
        '<tool_call>{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Bern"}}}'
        "</tool_call>",
        "",
        [W("Bern")],
    ),
    ('<tool_call>{"name": "get_weather", "parameters": {"city": "a}b{\\"c"}}</tool_call>', "", [W('a}b{"c')]),
    # one call, then text after it
    (
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Pisa"}}</tool_call>\n\nDone, asked.',
        "Done, asked.",
        [W("Pisa")],
    ),
    # an undeclared tool or a non-call is content, tag included
    (
        '<tool_call>{"name": "launch", "arguments": {}}</tool_call>',
        '<tool_call>{"name": "launch", "arguments": {}}</tool_call>',
        [],
    ),
    ("<tool_call>not json at all</tool_call>", "<tool_call>not json at all</tool_call>", []),
    ("<tool_call> {broken json}", "<tool_call> {broken json}", []),
    (
        '<tool_call>{"name": "get_weather", "arguments": {"city": ',
        '<tool_call>{"name": "get_weather", "arguments": {"city": ',
        [],
    ),
    ("text ending in a partial tag <tool_", "text ending in a partial tag <tool_", []),
    ("text ending in the tag <tool_call>", "text ending in the tag <tool_call>", []),
    ("a < b and c <tool", "a < b and c <tool", []),
    # the name must match exactly: "get" is a prefix of others
    (
        '<tool_call>{"name": "get", "arguments": {"x": [1, {"y": 2}]}}</tool_call>',
        "",
        [ToolCall("get", {"x": [1, {"y": 2}]})],
    ),
    # an array of calls
    (
        '<tool_call>[{"name": "get_weather", "arguments": {"city": "Ulm"}}, '
        '{"name": "get_time", "arguments": {}}]</tool_call>',
        "",
        [W("Ulm"), ToolCall("get_time", {})],
    ),
    # the tag name as the key
    ('<tool_call>{"get_weather": {"city": "Nice"}}</tool_call>', "", [W("Nice")]),
    # unicode survives
    ('<tool_call>{"name": "get_weather", "arguments": {"city": "Zürich ☃"}}</tool_call>', "", [W("Zürich ☃")]),
]


@pytest.mark.parametrize(("text", "content", "calls"), TAGGED)
def test_tagged(text: str, content: str, calls: list[ToolCall]) -> None:
    for pieces in split_all(text):
        assert run_tools(pieces, "<tool_call>") == (content, calls), pieces


BARE = [
    ('{"name": "get_weather", "arguments": {"city": "Oslo"}}', "", [W("Oslo")]),
    ('  \n{"name": "get_weather", "parameters": {"city": "Oslo"}}\n', "", [W("Oslo")]),
    (
        '{"name": "get_weather", "parameters": {"city": "A"}}; {"name": "get_weather", "parameters": {"city": "B"}}',
        "",
        [W("A"), W("B")],
    ),
    ('[{"name": "get_weather", "arguments": {"city": "A"}}]', "", [W("A")]),
    # JSON that is no call, and JSON that is not first, are content
    ('{"name": "search", "arguments": {"q": "x"}}', '{"name": "search", "arguments": {"q": "x"}}', []),
    (
        '{"name": "jeff"}{"name": "get_weather", "arguments": {}}',
        '{"name": "jeff"}{"name": "get_weather", "arguments": {}}',
        [],
    ),
    (
        'Sure: {"name": "get_weather", "arguments": {"city": "A"}}',
        'Sure: {"name": "get_weather", "arguments": {"city": "A"}}',
        [],
    ),
    ('for { fmt.Println("hello") }', 'for { fmt.Println("hello") }', []),
    ('{ fmt.Println("hello")', '{ fmt.Println("hello")', []),
    ("[special delivery]", "[special delivery]", []),
    ("  [1] is a citation", "  [1] is a citation", []),
    # text after a call is content
    ('{"name": "get_weather", "arguments": {"city": "A"}}\nThat is all.', "That is all.", [W("A")]),
]


@pytest.mark.parametrize(("text", "content", "calls"), BARE)
def test_bare_json(text: str, content: str, calls: list[ToolCall]) -> None:
    for pieces in split_all(text):
        assert run_tools(pieces, "{") == (content, calls), pieces


def test_other_tags() -> None:
    text = '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "A"}}, {"name": "get_time", "arguments": {}}]'
    for tag in ("[TOOL_CALLS]", "[TOOL_CALLS] ["):
        for pieces in split_all(text):
            assert run_tools(pieces, tag) == ("", [W("A"), ToolCall("get_time", {})]), pieces
    text = '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "A"}}][/TOOL_CALLS]'
    for pieces in split_all(text):
        assert run_tools(pieces, "[TOOL_CALLS]") == ("", [W("A")]), pieces
    text = 'functools[{"name": "get_weather", "arguments": {"city": "A"}}, '
    text += '{"name": "get_weather", "arguments": {"city": "B"}}]'
    for pieces in split_all(text):
        assert run_tools(pieces, "functools[") == ("", [W("A"), W("B")]), pieces
    text = 'Let me look.\n```json\n{"name": "get_weather", "arguments": {"city": "A"}}\n```'
    for pieces in split_all(text):
        assert run_tools(pieces, "```json") == ("Let me look.\n", [W("A")]), pieces


def test_no_declared_tools_accepts_any_name() -> None:
    assert run_tools(['<tool_call>{"name": "x", "arguments": {}}</tool_call>'], "<tool_call>", None) == (
        "",
        [ToolCall("x", {})],
    )


def test_content_streams_at_once() -> None:
    p = ToolCallParser("<tool_call>", TOOLS)
    assert p.add("Hello ") == ([], "Hello ")
    assert p.add("world <tool") == ([], "world ")
    assert p.add('_call>{"name": "get_weather", ') == ([], "")
    assert p.add('"arguments": {"city": "A"}}') == ([W("A")], "")  # as soon as the object closes
    assert p.add("</tool_call>") == ([], "")
    assert p.add("", done=True) == ([], "")


def test_blank_tag_refused() -> None:
    with pytest.raises(ValueError):
        ToolCallParser("  ")


# ---------------------------------------------------------------------------------------------- generic parser


def run_parser(
    parser: Any, pieces: Sequence[str], tools: Any = TOOLS, think: ThinkValue = True, last: Any = None
) -> tuple[str, str, list[ToolCall]]:
    parser.init(tools, last, think)
    content, thinking, calls = "", "", []
    for i, piece in enumerate(pieces):
        out = parser.add(piece, i == len(pieces) - 1)
        content, thinking, calls = content + out.content, thinking + out.thinking, calls + out.calls
    return content, thinking, calls


QWEN_OUT = (
    "<think>\nThe user wants the weather.\n</think>\n\n"
    'I will check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
)


def test_generic_thinking_and_tools() -> None:
    for pieces in split_all(QWEN_OUT):
        p = GenericParser(("<think>", "</think>"), "<tool_call>", False)
        assert run_parser(p, pieces) == ("I will check.\n", "The user wants the weather.\n", [W("Oslo")]), pieces


def test_generic_think_off_or_no_tools() -> None:
    p = GenericParser(("<think>", "</think>"), "<tool_call>")
    assert run_parser(p, [QWEN_OUT], think=False)[1:] == ("", [W("Oslo")])
    assert run_parser(p, [QWEN_OUT], think=False)[0].startswith("<think>")
    p = GenericParser(("<think>", "</think>"), "<tool_call>")
    content, thinking, calls = run_parser(p, [QWEN_OUT], tools=None)
    assert calls == [] and "<tool_call>" in content and thinking


def test_generic_prefilled_thinking() -> None:
    text = "Hmm, the weather.</think>\n\nIt is sunny."
    for pieces in split_all(text):
        p = GenericParser(("<think>", "</think>"), None, prefilled_thinking=True)
        assert run_parser(p, pieces) == ("It is sunny.", "Hmm, the weather.", []), pieces
        p = GenericParser(("<think>", "</think>"), None)
        p.init(None, None, True)
        p.prefill()
        out = [p.add(piece, i == len(pieces) - 1) for i, piece in enumerate(pieces)]
        assert "".join(o.thinking for o in out) == "Hmm, the weather."


def test_generic_assistant_prefill_is_content() -> None:
    p = GenericParser(("<think>", "</think>"), None, prefilled_thinking=True)
    last = Message(role="assistant", content="The answer is")
    assert run_parser(p, [" 4."], last=last) == (" 4.", "", [])


def test_generic_capabilities() -> None:
    assert GenericParser(None, None).has_thinking is False
    assert GenericParser(None, None).has_tools is False
    assert GenericParser(("<think>", "</think>"), "{").has_tools is True
    assert GenericParser(("", ""), "").has_thinking is False


# ----------------------------------------------------------------------------------------------- named families


def test_hermes_family() -> None:
    for name in ("json-tools", "hermes"):
        for pieces in split_all(QWEN_OUT):
            p = parser_for(name)
            assert p is not None and p.has_tools and p.has_thinking
            assert run_parser(p, pieces) == ("I will check.\n", "The user wants the weather.\n", [W("Oslo")]), pieces


LLAMA = [
    ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}', "", [W("Oslo")]),
    ('{"name": "get_weather", "parameters": {"city": "Oslo"}}', "", [W("Oslo")]),
    (
        'I will look it up. <|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}',
        "I will look it up. ",
        [W("Oslo")],
    ),
    ("The set {1, 2} is small.", "The set {1, 2} is small.", []),
    ('{"name": "unknown", "parameters": {}}', '{"name": "unknown", "parameters": {}}', []),
    ('<|python_tag|>brave_search.call(query="x")', '<|python_tag|>brave_search.call(query="x")', []),
]


@pytest.mark.parametrize(("text", "content", "calls"), LLAMA)
def test_llama3_family(text: str, content: str, calls: list[ToolCall]) -> None:
    for pieces in split_all(text):
        p = parser_for("llama3")
        assert p is not None and p.has_tools and not p.has_thinking
        assert run_parser(p, pieces) == (content, "", calls), pieces
