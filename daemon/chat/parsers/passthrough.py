"""``passthrough``: every piece is content."""

from __future__ import annotations

from collections.abc import Sequence

from daemon.chat.parsers.base import register
from daemon.chat.types import Message, Parsed, ThinkValue, Tool


@register("passthrough")
class PassthroughParser:
    has_tools = False
    has_thinking = False
    answer_after_thinking = ""

    def init(self, tools: Sequence[Tool] | None, last: Message | None, think: ThinkValue) -> Sequence[Tool] | None:
        return tools

    def add(self, text: str, done: bool) -> Parsed:
        return Parsed(content=text)
