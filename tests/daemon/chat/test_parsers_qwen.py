"""The Qwen parsers (qwen3, qwen3-thinking, qwen3-vl-*, qwen3-coder, qwen3.5): fixtures fed whole, split at every
offset and one character at a time, all giving the same content, thinking and calls."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from daemon.chat.parsers import parser_for
from daemon.chat.parsers.qwen3_coder import convert
from daemon.chat.types import Message, Tool
from tests.daemon.chat.feeding import agrees, parse


def tool(name: str, **props: Any) -> Tool:
    return Tool.of(
        {
            "type": "function",
            "function": {"name": name, "description": "", "parameters": {"type": "object", "properties": props}},
        }
    )


WEATHER = [tool("get_weather", city={"type": "string"}), tool("get_time", zone={"type": "string"})]


def json_call(name: str, args: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {args}}}\n</tool_call>'


# -- qwen3 / qwen3-thinking: JSON calls ----------------------------------------------------------------------------


def test_thinking_then_content() -> None:
    text = "The user greets me.\nI should greet back.\n</think>\n\nHello! How can I help?"
    assert parse("qwen3-thinking", text) == (
        "Hello! How can I help?",
        "The user greets me.\nI should greet back.",
        [],
    )


def test_repeated_opening_tag_is_dropped() -> None:
    text = "<think>\nPlan the answer.\n</think>\n\nDone."
    assert parse("qwen3-thinking", text, think=True) == ("Done.", "Plan the answer.", [])


def test_thinking_then_call() -> None:
    text = "Need the weather in Paris.\n</think>\n\n" + json_call("get_weather", '{"city": "Paris"}')
    assert parse("qwen3-thinking", text, tools=WEATHER) == (
        "",
        "Need the weather in Paris.",
        [("get_weather", {"city": "Paris"})],
    )


def test_call_before_closing_think_ends_thinking() -> None:
    text = "Checking the clock.\n" + json_call("get_time", '{"zone": "UTC"}') + "\nIt is noon."
    assert parse("qwen3-thinking", text, tools=WEATHER) == (
        "It is noon.",
        "Checking the clock.",
        [("get_time", {"zone": "UTC"})],
    )


def test_two_calls_and_text_after() -> None:
    text = (
        "Let me check both.\n"
        + json_call("get_weather", '{"city": "Oslo"}')
        + "\n"
        + json_call("get_time", '{"zone": "CET"}')
        + "\n\nBoth requested."
    )
    assert parse("qwen3", text, tools=WEATHER) == (
        "Let me check both.Both requested.",
        "",
        [("get_weather", {"city": "Oslo"}), ("get_time", {"zone": "CET"})],
    )


def test_undeclared_tool_is_returned() -> None:
    text = json_call("launch_rocket", '{"target": "moon", "count": 2}')
    assert parse("qwen3", text, tools=WEATHER) == ("", "", [("launch_rocket", {"target": "moon", "count": 2})])


@pytest.mark.parametrize(
    "body",
    [
        '{"name": "get_weather", "arguments": {"city": }}',  # broken JSON
        '["get_weather"]',  # JSON but not a call
        '{"arguments": {"city": "Rome"}}',  # no name
        '{"name": "get_weather", "arguments": [1, 2]}',  # arguments not an object
    ],
)
def test_malformed_call_is_content(body: str) -> None:
    text = f"Trying.\n<tool_call>\n{body}\n</tool_call>\nAfter."
    assert parse("qwen3", text, tools=WEATHER) == (f"Trying.<tool_call>\n{body}\n</tool_call>After.", "", [])


def test_string_encoded_arguments_and_missing_arguments() -> None:
    text = (
        '<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Lima\\"}"}</tool_call>'
        '<tool_call>{"name": "get_time"}</tool_call>'
    )
    assert parse("qwen3", text) == ("", "", [("get_weather", {"city": "Lima"}), ("get_time", {})])


def test_unclosed_call_at_end() -> None:
    # a stop at </tool_call> leaves a complete body: still a call
    assert parse("qwen3", '<tool_call>\n{"name": "get_time", "arguments": {}}\n') == ("", "", [("get_time", {})])
    # cut off by the length limit: the text is kept
    cut = '<tool_call>\n{"name": "get_time", "argu'
    assert parse("qwen3", "Sure. " + cut) == ("Sure." + cut, "", [])


def test_tag_lookalikes_are_content() -> None:
    text = "if a < b and c <tool> then </think> ends with <tool_"
    assert parse("qwen3", text) == (text, "", [])


def test_think_off_gives_content() -> None:
    assert parse("qwen3-thinking", "Just the answer.", think=False) == ("Just the answer.", "", [])
    assert parse("qwen3-thinking", "Just the answer.", think="false") == ("Just the answer.", "", [])


def test_non_thinking_family_ignores_think() -> None:
    p = parser_for("qwen3")
    assert p is not None and not p.has_thinking and p.has_tools
    assert parse("qwen3", "Plain answer.", think=True) == ("Plain answer.", "", [])


def test_prefill_continues_the_answer() -> None:
    last = Message(role="assistant", content="The answer is")
    assert parse("qwen3-thinking", " forty-two.", last=last) == (" forty-two.", "", [])


def test_unclosed_thinking_is_thinking() -> None:
    assert parse("qwen3-thinking", "Still pondering </thi") == ("", "Still pondering </thi", [])


def test_vl_variants() -> None:
    # the thinking VL template always opens the thinking, whatever think says
    text = "Look at the image.\n</think>\n\nA cat."
    assert parse("qwen3-vl-thinking", text, think=False) == ("A cat.", "Look at the image.", [])
    assert parse("qwen3-vl-instruct", json_call("get_time", "{}")) == ("", "", [("get_time", {})])


def test_unicode_passes_through() -> None:
    text = "思考中…🌟\n</think>\n\n你好 🌍"
    assert parse("qwen3-thinking", text) == ("你好 🌍", "思考中…🌟", [])


# -- qwen3-coder / qwen3.5: XML calls ------------------------------------------------------------------------------

TYPED = [
    tool(
        "plan_trip",
        city={"type": "string"},
        days={"type": "integer"},
        budget={"type": "number"},
        ratio={"type": "number"},
        refundable={"type": "boolean"},
        stops={"type": "array"},
        prefs={"type": "object"},
        note={"type": ["string", "null"]},
        count={"anyOf": [{"type": "integer"}, {"type": "string"}]},
    )
]


def xml_call(name: str, **params: str) -> str:
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


def test_coder_typed_parameters() -> None:
    text = "I'll plan it.\n\n" + xml_call(
        "plan_trip",
        city="123",
        days="4",
        budget="1500",
        ratio="0.25",
        refundable="True",
        stops='["Lyon", "Nice"]',
        prefs='{"window": true}',
        note="null",
        count="7",
    )
    assert parse("qwen3-coder", text, tools=TYPED) == (
        "I'll plan it.",
        "",
        [
            (
                "plan_trip",
                {
                    "city": "123",
                    "days": 4,
                    "budget": 1500,
                    "ratio": 0.25,
                    "refundable": True,
                    "stops": ["Lyon", "Nice"],
                    "prefs": {"window": True},
                    "note": None,
                    "count": 7,
                },
            )
        ],
    )


def test_coder_fallbacks() -> None:
    text = xml_call(
        "plan_trip", days="four", budget="lots", refundable="maybe", stops="Lyon, Nice", prefs="{bad", count="x"
    )
    assert parse("qwen3-coder", text, tools=TYPED)[2] == [
        (
            "plan_trip",
            {
                "days": "four",
                "budget": "lots",
                "refundable": False,
                "stops": "Lyon, Nice",
                "prefs": "{bad",
                "count": "x",
            },
        )
    ]


@pytest.mark.parametrize(
    ("raw", "types", "want"),
    [
        ("12", ["string", "number"], 12),
        ("hello", ["string", "number"], "hello"),
        ("2.50", ["number"], 2.5),
        ("-3", ["integer"], -3),
        ("1e3", ["number"], 1000),
        ("inf", ["number"], "inf"),
        ("NULL", ["string"], None),
        ("false", ["boolean", "string"], False),
        ("[1]", ["object", "array"], [1]),
        ("text", [], "text"),
    ],
)
def test_convert(raw: str, types: list[str], want: Any) -> None:
    got = convert(raw, types)
    assert got == want and type(got) is type(want)


def test_coder_two_calls_undeclared_and_text_after() -> None:
    text = (
        xml_call("run_shell", command='ls && echo "a > b < c"')
        + "\n"
        + xml_call("获取天气", 城市="北京")
        + "\n\nAll done."
    )
    assert parse("qwen3-coder", text, tools=TYPED) == (
        "All done.",
        "",
        [("run_shell", {"command": 'ls && echo "a > b < c"'}), ("获取天气", {"城市": "北京"})],
    )


def test_coder_multiline_value_keeps_inner_newlines() -> None:
    text = xml_call("write_file", path="a.py", content="def f():\n    return 1\n")
    assert parse("qwen3-coder", text)[2] == [("write_file", {"path": "a.py", "content": "def f():\n    return 1\n"})]


def test_coder_missing_parameter_close_is_tolerated() -> None:
    text = "<tool_call>\n<function=f>\n<parameter=a>\n1\n<parameter=b>\n2\n</function>\n</tool_call>"
    assert parse("qwen3-coder", text) == ("", "", [("f", {"a": "1", "b": "2"})])


def test_coder_malformed_is_content() -> None:
    text = "Oops <tool_call>\nnot a function\n</tool_call> end"
    assert parse("qwen3-coder", text) == ("Oops<tool_call>\nnot a function\n</tool_call>end", "", [])


def test_qwen35_thinking_then_xml_call() -> None:
    text = "Plan a short trip.\n</think>\n\n" + xml_call("plan_trip", city="Rome", days="2")
    assert parse("qwen3.5", text, tools=TYPED) == (
        "",
        "Plan a short trip.",
        [("plan_trip", {"city": "Rome", "days": 2})],
    )
    # a forgotten </think> before the call
    text = "Plan a short trip.\n" + xml_call("plan_trip", days="3")
    assert parse("qwen3.5", text, tools=TYPED) == ("", "Plan a short trip.", [("plan_trip", {"days": 3})])
    assert parse("qwen3.5", "Answer.", think=False) == ("Answer.", "", [])


def test_registered_names() -> None:
    for name in ("qwen3", "qwen3-thinking", "qwen3-vl-instruct", "qwen3-vl-thinking", "qwen3-coder", "qwen3.5"):
        assert parser_for(name) is not None
    thinking = {n: parser_for(n).has_thinking for n in ("qwen3", "qwen3-thinking", "qwen3-coder", "qwen3.5")}  # type: ignore[union-attr]
    assert thinking == {"qwen3": False, "qwen3-thinking": True, "qwen3-coder": False, "qwen3.5": True}


_PIECES = st.sampled_from(
    [
        "<think>",
        "</think>",
        "<tool_call>",
        "</tool_call>",
        "<function=f>",
        "</function>",
        "<parameter=a>",
        "</parameter>",
        '{"name": "f", "arguments": {}}',
        "{",
        "}",
        "<",
        " ",
        "\n",
        "x",
        "é",
    ]
)


@settings(max_examples=100, deadline=None)
@given(st.sampled_from(["qwen3", "qwen3-thinking", "qwen3-coder", "qwen3.5"]), st.lists(_PIECES, max_size=14))
def test_fuzz_never_raises_and_splits_agree(name: str, pieces: list[str]) -> None:
    agrees(name, pieces)
