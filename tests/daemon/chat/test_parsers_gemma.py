"""The Gemma parsers (gemma4, gemma4-no-thinking, functiongemma): fixtures fed whole, split at every offset and one
character at a time, all giving the same content, thinking and calls."""

from __future__ import annotations

from typing import Any

import pytest

from daemon.chat.parsers import parser_for
from daemon.chat.types import Message, Tool
from tests.daemon.chat.feeding import parse

Q = '<|"|>'  # Gemma 4's string marker


def tool(name: str, props: dict[str, Any]) -> Tool:
    params = {"type": "object", "properties": props}
    return Tool.of({"type": "function", "function": {"name": name, "description": "", "parameters": params}})


def g4(name: str, args: str) -> str:
    return f"<|tool_call>call:{name}{args}<tool_call|>"


def test_registered() -> None:
    for name, thinks in (("gemma4", True), ("gemma4-no-thinking", False), ("functiongemma", False)):
        p = parser_for(name)
        assert p is not None and p.has_tools and p.has_thinking is thinks


def test_gemma4_content_only() -> None:
    assert parse("gemma4", "This is a simple response.") == ("This is a simple response.", "", [])
    assert parse("gemma4", "a < b <| c |> d  ") == ("a < b <| c |> d  ", "", [])


def test_gemma4_thinking_then_content() -> None:
    text = "<|channel>thought\nLet me think about this...\n<channel|>\n\nThe answer is 42."
    assert parse("gemma4", text, think=True) == ("The answer is 42.", "Let me think about this...", [])
    two = "<|channel>first thought<channel|><|channel>second thought<channel|>Final answer."
    assert parse("gemma4", two, think="low") == ("Final answer.", "first thoughtsecond thought", [])


def test_gemma4_thinking_not_asked_is_dropped() -> None:
    text = "<|channel>thought\nhidden<channel|>actual content"
    assert parse("gemma4", text, think=False) == ("actual content", "", [])
    assert parse("gemma4-no-thinking", text, think=True) == ("actual content", "", [])


def test_gemma4_after_tool_result_starts_thinking() -> None:
    last = Message(role="tool", content="22C")
    assert parse("gemma4", "It is warm.<channel|>22 degrees.", think=True, last=last) == (
        "22 degrees.",
        "It is warm.",
        [],
    )


def test_gemma4_thinking_then_call() -> None:
    text = "<|channel>thought\nI need the weather<channel|>" + g4("get_weather", "{location:" + Q + "Paris" + Q + "}")
    assert parse("gemma4", text, think=True) == ("", "I need the weather", [("get_weather", {"location": "Paris"})])


def test_gemma4_two_calls_and_text_after() -> None:
    text = (
        "Let me check. "
        + g4("get_weather", "{location:" + Q + "Paris" + Q + ",units:" + Q + "metric" + Q + "}")
        + g4("get_weather", "{location:" + Q + "London" + Q + "}")
        + "<tool_call|><|tool_response>\n Done."
    )
    calls = [("get_weather", {"location": "Paris", "units": "metric"}), ("get_weather", {"location": "London"})]
    assert parse("gemma4", text) == ("Let me check.Done.", "", calls)


def test_gemma4_value_kinds() -> None:
    args = (
        "{value:42,ratio:-0.5,enabled:true,none:null,"
        "config:{enabled:false,name:" + Q + "test" + Q + "},"
        "items:[" + Q + "a" + Q + "," + Q + 'b "quoted"' + Q + "],"
        "steps:[{title:" + Q + "one" + Q + ",done:false}],"
        "cmd:" + Q + "date\n" + Q + ","
        "query:" + Q + 'say \\"hi\\", a,b:{c}[d]' + Q + ","
        'raw:"json \\"quoted\\"",'
        "path:" + Q + "C:\\users\\bob" + Q + "}"
    )
    expected = {
        "value": 42,
        "ratio": -0.5,
        "enabled": True,
        "none": None,
        "config": {"enabled": False, "name": "test"},
        "items": ["a", 'b "quoted"'],
        "steps": [{"title": "one", "done": False}],
        "cmd": "date\n",
        "query": 'say \\"hi\\", a,b:{c}[d]',  # between markers the text is kept exactly
        "raw": 'json "quoted"',
        "path": "C:\\users\\bob",
    }
    assert parse("gemma4", g4("process", args)) == ("", "", [("process", expected)])


def test_bare_value_of_string_field_stays_text() -> None:
    t = tool("lookup", {"zip": {"type": "string"}, "n": {"type": "integer"}})
    assert parse("gemma4", g4("lookup", "{zip:07001,n:3}"), tools=[t]) == (
        "",
        "",
        [("lookup", {"zip": "07001", "n": 3})],
    )
    # not declared: literals are read as what they look like
    assert parse("gemma4", g4("other", "{zip:07001,word:hello}")) == (
        "",
        "",
        [("other", {"zip": "07001", "word": "hello"})],
    )


def test_undeclared_tool_is_still_a_call() -> None:
    t = tool("known", {})
    assert parse("gemma4", g4("mystery", "{a:1}"), tools=[t]) == ("", "", [("mystery", {"a": 1})])


@pytest.mark.parametrize(
    "body",
    [
        "get_weather{location:" + Q + "Paris" + Q + "}",  # no "call:"
        "call:{a:1}",  # no name
        "call:f{a:" + Q + "unclosed}",
        "call:f{a:1",  # unclosed object
        "call:f{a:1} trailing",
        "call:f{:1}",
    ],
)
def test_gemma4_malformed_call_is_content(body: str) -> None:
    text = "Before " + "<|tool_call>" + body + "<tool_call|>" + " after"
    assert parse("gemma4", text) == ("Before<|tool_call>" + body + "<tool_call|>after", "", [])


def test_gemma4_call_cut_off_at_end() -> None:
    text = "<|tool_call>call:search{query:" + Q + "x" + Q + "}"
    assert parse("gemma4", text) == ("", "", [("search", {"query": "x"})])
    assert parse("gemma4", text + "<tool_") == ("", "", [("search", {"query": "x"})])
    cut = "<|tool_call>call:search{query:" + Q + "x"
    assert parse("gemma4", cut) == (cut, "", [])


def test_gemma4_thinking_cut_off_is_flushed() -> None:
    assert parse("gemma4", "<|channel>thought\nhmm <chan", think=True) == ("", "hmm <chan", [])
    assert parse("gemma4", "<|channel>thou", think=True) == ("", "thou", [])


FG_CALL = "<start_function_call>call:get_weather{city:<escape>Paris<escape>}<end_function_call>"


def test_functiongemma_content() -> None:
    assert parse("functiongemma", "Hello, world!  ") == ("Hello, world!  ", "", [])
    assert parse("functiongemma", "") == ("", "", [])


def test_functiongemma_call_keeps_text_around() -> None:
    text = "Let me check. " + FG_CALL + " Done."
    assert parse("functiongemma", text) == ("Let me check.  Done.", "", [("get_weather", {"city": "Paris"})])


def test_functiongemma_two_calls_and_values() -> None:
    text = (
        FG_CALL
        + "<start_function_call>call:set{a:1,b:2.5,on:true,off:false,tags:[<escape>x,y<escape>,3],"
        + "opt:{k:<escape>v<escape>},code:007}<end_function_call>"
    )
    t = tool("set", {"code": {"type": "string"}})
    calls = [
        ("get_weather", {"city": "Paris"}),
        ("set", {"a": 1, "b": 2.5, "on": True, "off": False, "tags": ["x,y", 3], "opt": {"k": "v"}, "code": "007"}),
    ]
    assert parse("functiongemma", text, tools=[t]) == ("", "", calls)


def test_functiongemma_malformed_and_cut_off() -> None:
    bad = "<start_function_call>not a call<end_function_call>"
    assert parse("functiongemma", "x " + bad + " y") == ("x " + bad + " y", "", [])
    cut = "<start_function_call>call:f{a:<escape>b"
    assert parse("functiongemma", cut) == (cut, "", [])
    assert parse("functiongemma", FG_CALL.removesuffix("<end_function_call>")) == (
        "",
        "",
        [("get_weather", {"city": "Paris"})],
    )
    # FunctionGemma does not think: its output is all content
    assert parse("functiongemma", "<think>x</think>", think=True) == ("<think>x</think>", "", [])
