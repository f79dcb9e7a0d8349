"""The GLM parsers (glm-4.5, glm-4.6, glm-4.7): fixtures fed whole, split at every offset and one character at a
time, all giving the same content, thinking and calls; argument values typed by the tool's schema."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest

from daemon.chat.parsers import parser_for
from daemon.chat.parsers.glm import typed_value
from daemon.chat.types import Message, Tool
from tests.daemon.chat.feeding import parse


def tool(name: str, props: dict[str, Any], required: Sequence[str] = ()) -> Tool:
    params = {"type": "object", "properties": props, "required": list(required)}
    return Tool.of({"type": "function", "function": {"name": name, "description": "", "parameters": params}})


WEATHER = tool(
    "get_weather",
    {
        "city": {"type": "string"},
        "days": {"type": "integer"},
        "scale": {"type": "number"},
        "metric": {"type": "boolean"},
        "hours": {"type": "array"},
        "opts": {"type": "object"},
        "zip": {"type": "string"},
        "note": {"anyOf": [{"type": "integer"}, {"type": "null"}]},
    },
    required=["city"],
)


def glm_call(name: str, **args: str) -> str:
    pairs = "".join(f"<arg_key>{k}</arg_key>\n<arg_value>{v}</arg_value>\n" for k, v in args.items())
    return f"<tool_call>{name}\n{pairs}</tool_call>"


@pytest.mark.parametrize("name", ["glm-4.5", "glm-4.6", "glm-4.7"])
def test_registered(name: str) -> None:
    p = parser_for(name)
    assert p is not None and p.has_tools and p.has_thinking


@pytest.mark.parametrize("name", ["glm-4.5", "glm-4.6", "glm-4.7"])
def test_thinking_then_content(name: str) -> None:
    text = "<think>  \n  thinking content  \n  </think>\n\nregular content"
    assert parse(name, text, think=True) == ("regular content", "thinking content", [])


def test_content_only() -> None:
    assert parse("glm-4.6", "  \n  content with leading whitespace") == (
        "  \n  content with leading whitespace",
        "",
        [],
    )
    assert parse("glm-4.6", "  <thinking is fun") == ("  <thinking is fun", "", [])
    assert parse("glm-4.6", "content\n<tool fakeout") == ("content\n<tool fakeout", "", [])
    assert parse("glm-4.6", "") == ("", "", [])


def test_glm47_output_starts_inside_thinking() -> None:
    assert parse("glm-4.7", "I reason.</think>Answer.") == ("Answer.", "I reason.", [])  # think unset: on
    assert parse("glm-4.7", "I reason.</think>Answer.", think=True) == ("Answer.", "I reason.", [])
    assert parse("glm-4.7", "Plain answer.", think=False) == ("Plain answer.", "", [])
    prefill = Message(role="assistant", content="Partly")
    assert parse("glm-4.7", " done.", think=True, last=prefill) == (" done.", "", [])


def test_thinking_then_call_typed_by_schema() -> None:
    text = (
        "<think>Need weather.</think>\n"
        + glm_call(
            "get_weather",
            city="Paris",
            days="3",
            scale="1.5",
            metric="true",
            hours="[9, 12]",
            opts='{"a": {"b": null}}',
            zip="07001",
            note="null",
        )
        + "\n\n"
    )
    args = {
        "city": "Paris",
        "days": 3,
        "scale": 1.5,
        "metric": True,
        "hours": [9, 12],
        "opts": {"a": {"b": None}},
        "zip": "07001",  # a string stays a string, digits or not
        "note": None,
    }
    assert parse("glm-4.6", text, tools=[WEATHER]) == ("", "Need weather.", [("get_weather", args)])


def test_two_calls_and_text_between_and_after() -> None:
    text = (
        "Here goes: \n"
        + glm_call("get_weather", city="Paris")
        + "\nbetween\n"
        + glm_call("get_weather", city="New York, NY", days="2")
        + "  \n\t after"
    )
    calls = [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "New York, NY", "days": 2})]
    assert parse("glm-4.7", text, think=False, tools=[WEATHER]) == ("Here goes:betweenafter", "", calls)


def test_values_keep_special_characters() -> None:
    text = glm_call("get_weather", city="a & b < c > d\n  indented\n", zip="\"quoted\" 'single'")
    got = parse("glm-4.6", text, tools=[WEATHER])
    assert got == ("", "", [("get_weather", {"city": "a & b < c > d\n  indented", "zip": "\"quoted\" 'single'"})])


def test_undeclared_tool_values_stay_text() -> None:
    text = glm_call("shell", command="ls -la", count="5")
    assert parse("glm-4.6", text, tools=[WEATHER]) == ("", "", [("shell", {"command": "ls -la", "count": "5"})])
    assert parse("glm-4.6", text) == ("", "", [("shell", {"command": "ls -la", "count": "5"})])


def test_value_not_fitting_schema_stays_text() -> None:
    text = glm_call("get_weather", city="Oslo", days="three", metric="maybe", hours="[1,")
    got = parse("glm-4.6", text, tools=[WEATHER])
    assert got == ("", "", [("get_weather", {"city": "Oslo", "days": "three", "metric": "maybe", "hours": "[1,"})])


@pytest.mark.parametrize(
    "body",
    [
        "",  # no name
        "\n<arg_key>a</arg_key><arg_value>1</arg_value>",  # no name before the arguments
        "f\n<arg_key>a</arg_key>\n<arg_value>1</arg_value>\nstray text",
        "f\n<arg_key>a</arg_key>\n<arg_value>1",  # unclosed value
    ],
)
def test_malformed_call_is_content(body: str) -> None:
    text = "Before <tool_call>" + body + "</tool_call> after"
    assert parse("glm-4.6", text) == ("Before<tool_call>" + body.lstrip() + "</tool_call>after", "", [])


def test_call_without_closing_tag_at_end() -> None:
    grep = tool("grep", {"pattern": {"type": "string"}, "path": {"type": "string"}}, required=["pattern", "path"])
    body = "<tool_call>grep\n<arg_key>pattern</arg_key>\n<arg_value>needle</arg_value>\n"
    complete = body + "<arg_key>path</arg_key>\n<arg_value>.</arg_value>"
    assert parse("glm-4.6", complete, tools=[grep]) == ("", "", [("grep", {"pattern": "needle", "path": "."})])
    assert parse("glm-4.6", complete + "</tool_", tools=[grep]) == (
        "",
        "",
        [("grep", {"pattern": "needle", "path": "."})],
    )
    # a required argument missing, an undeclared tool or a cut value: not made, kept as text
    assert parse("glm-4.6", body, tools=[grep]) == (body, "", [])
    assert parse("glm-4.6", complete, tools=[WEATHER]) == (complete, "", [])
    cut = body + "<arg_key>path</arg_key>\n<arg_value>partial"
    assert parse("glm-4.6", cut, tools=[grep]) == (cut, "", [])


def test_thinking_cut_off_is_flushed() -> None:
    assert parse("glm-4.6", "<think>thinking content</th") == ("", "thinking content</th", [])


def test_typed_value_rules() -> None:
    assert typed_value("\n42\n", {"integer"}) == 42
    assert typed_value("42", {"string"}) == "42"
    assert typed_value("42", set()) == "42"
    assert typed_value("4.0", {"number"}) == 4
    assert typed_value("True", {"boolean"}) is True
    assert typed_value("true", {"integer"}) == "true"
    assert typed_value("7", {"integer", "string"}) == 7
    assert typed_value('"x"', {"integer"}) == '"x"'
