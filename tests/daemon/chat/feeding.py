"""Feeding a parser its fixture in every way the stream may split it, for the parser tests: whole, in two pieces at
every offset, one character at a time (and then an empty last piece), each of which must give the same result."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from daemon.chat.parsers import parser_for
from daemon.chat.types import Message, ThinkValue, Tool

#: (content, thinking, calls as (name, arguments)), each joined over the pieces
Result = tuple[str, str, list[tuple[str, dict[str, Any]]]]


def feed(
    name: str,
    pieces: Sequence[str],
    think: ThinkValue = None,
    tools: Sequence[Tool] | None = None,
    last: Message | None = None,
) -> Result:
    """Run the registered parser ``name`` over ``pieces`` (the last one with ``done``) and join what it returns;
    every call must come without the id and index the pipeline gives, and with dict arguments."""
    p = parser_for(name)
    assert p is not None
    p.init(tools, last, think)
    content, thinking, calls = "", "", []
    for i, piece in enumerate(pieces):
        got = p.add(piece, i == len(pieces) - 1)
        content += got.content
        thinking += got.thinking
        for c in got.calls:
            assert c.id == "" and c.index is None and isinstance(c.arguments, dict)
            calls.append((c.name, c.arguments))
    return content, thinking, calls


def parse(
    name: str,
    text: str,
    think: ThinkValue = None,
    tools: Sequence[Tool] | None = None,
    last: Message | None = None,
) -> Result:
    """The result of ``text`` whole, after checking that every two-piece split, the char-by-char feed, and a feed
    ending with an empty done piece agree with it."""
    whole = feed(name, [text], think, tools, last)
    for i in range(len(text) + 1):
        assert feed(name, [text[:i], text[i:]], think, tools, last) == whole, f"split at {i}"
    assert feed(name, list(text) or [""], think, tools, last) == whole, "char by char"
    assert feed(name, [*text, ""], think, tools, last) == whole, "char by char, then done"
    return whole


def agrees(name: str, pieces: Sequence[str]) -> None:
    """The text of ``pieces`` (cut anywhere, as hypothesis draws them) gives the same fed in those pieces, one
    character at a time, and whole (no tools, think unset); and the parser does not raise on it."""
    text = "".join(pieces)
    whole = feed(name, [text])
    assert feed(name, pieces or [""]) == whole
    assert feed(name, list(text) or [""]) == whole


def split_all(text: str, step: int = 3, step2: int = 5) -> list[list[str]]:
    """The ways to feed ``text`` to a lower-level splitter: whole, one character at a time, in two pieces at every
    offset, and in three pieces (cuts every ``step`` and ``step2`` characters, to keep the count small)."""
    ways = [[text], list(text)]
    ways += [[text[:i], text[i:]] for i in range(len(text) + 1)]
    ways += [
        [text[:i], text[i:j], text[j:]] for i in range(0, len(text) + 1, step) for j in range(i, len(text) + 1, step2)
    ]
    return ways
