"""What an output parser is: a streaming splitter of generated text into content, thinking and tool calls; and the
table the family modules register their parsers in (``@register("name", ...)``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from daemon.chat.registry import Registry
from daemon.chat.types import Message, Parsed, ThinkValue, Tool


class Parser(Protocol):
    """A parser is made fresh for each generation (``parser_for(name)``), told the request with ``init``, then fed
    the generated text piece by piece (pieces split anywhere, even inside a tag or a UTF-8-complete character run)
    with ``add``; the last call has ``done=True`` and must flush everything held back. Tags never leak into content
    or thinking. A parser never raises on odd model output: what it cannot parse is content."""

    #: whether the family calls tools / thinks in a way this parser understands (capabilities follow these)
    has_tools: bool
    has_thinking: bool
    #: what a prompt continued after the model's finished thinking needs before the answer (thinking, then an
    #: answer under a format: ``pipeline.answer_after_thinking``); "" for most families, whose templates close the
    #: thinking themselves (harmony's is the channel switch into its final answer)
    answer_after_thinking: str

    def init(self, tools: Sequence[Tool] | None, last: Message | None, think: ThinkValue) -> Sequence[Tool] | None:
        """Start a generation: the request's tools, the last message of the prompt (an assistant prefill continues
        it), and ``think``. Returns the tools to render (a parser may rename them, as harmony does)."""
        ...

    def add(self, text: str, done: bool) -> Parsed:
        """Take the next piece of output; return what is now certain."""
        ...


PARSERS: Registry[Parser] = Registry("parser")
register = PARSERS.register
