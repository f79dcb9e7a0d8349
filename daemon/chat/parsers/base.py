"""What an output parser is: a streaming splitter of generated text into content, thinking and tool calls."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from daemon.chat.types import Parsed, ThinkValue

Tool = Mapping[str, Any]  # Ollama/OpenAI shape: {"type": "function", "function": {"name", "description", "parameters"}}
Message = Mapping[str, Any]  # Ollama shape: role, content, thinking, tool_calls, tool_name, images


class Parser(Protocol):
    """A parser is made fresh for each generation (``parser_for(name)``), told the request with ``init``, then fed
    the generated text piece by piece (pieces split anywhere, even inside a tag or a UTF-8-complete character run)
    with ``add``; the last call has ``done=True`` and must flush everything held back. Tags never leak into content
    or thinking. A parser never raises on odd model output: what it cannot parse is content."""

    #: whether the family calls tools / thinks in a way this parser understands (capabilities follow these)
    has_tools: bool
    has_thinking: bool

    def init(self, tools: Sequence[Tool] | None, last: Message | None, think: ThinkValue) -> Sequence[Tool] | None:
        """Start a generation: the request's tools, the last message of the prompt (an assistant prefill continues
        it), and ``think``. Returns the tools to render (a parser may rename them, as harmony does)."""
        ...

    def add(self, text: str, done: bool) -> Parsed:
        """Take the next piece of output; return what is now certain."""
        ...
