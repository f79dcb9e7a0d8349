"""``passthrough``: every piece is content."""

from __future__ import annotations

from collections.abc import Sequence

from daemon.chat.parsers import register
from daemon.chat.parsers.base import Message, Tool
from daemon.chat.types import Parsed, ThinkValue


@register("passthrough")
class PassthroughParser:
    has_tools = False
    has_thinking = False

    def init(self, tools: Sequence[Tool] | None, last: Message | None, think: ThinkValue) -> Sequence[Tool] | None:
        return tools

    def add(self, text: str, done: bool) -> Parsed:
        return Parsed(content=text)
