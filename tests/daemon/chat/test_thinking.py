"""The thinking splitter: Ollama's states, fed whole, split at every offset, and one character at a time."""

from __future__ import annotations

import pytest

from daemon.chat.parsers.thinking import ThinkingParser
from tests.daemon.chat.feeding import split_all


def _run(pieces: list[str], opening: str, closing: str, prefilled: bool) -> tuple[str, str]:
    p = ThinkingParser(opening, closing, prefilled=prefilled)
    thinking, content = "", ""
    for piece in pieces:
        t, c = p.add(piece)
        thinking, content = thinking + t, content + c
    t, c = p.flush()
    return thinking + t, content + c


CASES = [
    ("<think>I should add them.</think>The sum is 4.", False, "I should add them.", "The sum is 4."),
    ("  \n<think>\n  step one\nstep two \n</think>\n\n  Answer.", False, "step one\nstep two \n", "Answer."),
    (
        "Plain answer, no thinking. <think>not this</think>",
        False,
        "",
        "Plain answer, no thinking. <think>not this</think>",
    ),
    ("  leading spaces kept", False, "", "  leading spaces kept"),
    ("<think></think>Hi", False, "", "Hi"),
    ("<think>a</think>b</think>c", False, "a", "b</think>c"),
    ("<think>a <thi b </th c</think>d", False, "a <thi b </th c", "d"),
    ("<think>unfinished", False, "unfinished", ""),
    ("<think>cut at a partial tag </thi", False, "cut at a partial tag </thi", ""),
    ("<thi", False, "", "<thi"),
    ("   ", False, "", "   "),
    ("<think>only thinking</think>   ", False, "only thinking", ""),
    ("reasoning first</think>then the answer", True, "reasoning first", "then the answer"),
    ("\n\n  reasoning</think>\nanswer", True, "reasoning", "answer"),
    ("<think>x</think>y", True, "<think>x", "y"),  # prefilled: the tag is already behind us
    ("no closing tag at all", True, "no closing tag at all", ""),
    ("", False, "", ""),
    ("", True, "", ""),
]


@pytest.mark.parametrize(("text", "prefilled", "thinking", "content"), CASES)
def test_split_anywhere(text: str, prefilled: bool, thinking: str, content: str) -> None:
    for pieces in split_all(text):
        assert _run(pieces, "<think>", "</think>", prefilled) == (thinking, content), pieces


def test_other_tags() -> None:
    text = "[THINK]Let me see.[/THINK]Yes."
    for pieces in split_all(text):
        assert _run(pieces, "[THINK]", "[/THINK]", False) == ("Let me see.", "Yes."), pieces


def test_streams_without_waiting() -> None:
    p = ThinkingParser("<think>", "</think>")
    assert p.add("<think>") == ("", "")
    assert p.add("abc ") == ("abc ", "")
    assert p.add("d</") == ("d", "")  # only the possible partial tag is held
    assert p.add("x") == ("</x", "")
    assert p.add("</think>\n") == ("", "")
    assert p.add("\nHello") == ("", "Hello")
    assert p.add(" world") == ("", " world")
    assert p.flush() == ("", "")


def test_content_streams_when_no_thinking() -> None:
    p = ThinkingParser("<think>", "</think>")
    assert p.add("  ") == ("", "")
    assert p.add("<") == ("", "")
    assert p.add("b>bold") == ("", "  <b>bold")
    assert p.add("</think>") == ("", "</think>")


def test_prefill_method() -> None:
    p = ThinkingParser("<think>", "</think>")
    p.prefill()
    assert p.add("hm</think>ok") == ("hm", "ok")


def test_empty_tags_refused() -> None:
    with pytest.raises(ValueError):
        ThinkingParser("", "</think>")
