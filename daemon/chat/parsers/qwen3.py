"""``qwen3`` / ``qwen3-thinking`` / ``qwen3-vl-*``: Qwen3's ``<think>…</think>`` reasoning and its JSON tool calls,
``<tool_call>{"name": …, "arguments": {…}}</tool_call>``, each returned as soon as it closes.

The thinking variants' templates end the prompt with ``<think>``, so the output usually starts inside the thinking
and only ``</think>`` is seen (some checkpoints repeat the opening tag; one leading ``<think>`` is dropped). A
``<tool_call>`` before ``</think>`` also ends the thinking: small checkpoints forget to close it. Whitespace around
the tags is trimmed, as Ollama does; a call whose body does not parse comes back verbatim as content.

The scanning here is shared with ``qwen3_coder`` (XML calls), which subclasses :class:`Qwen3Parser`."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from daemon.chat.parsers.base import register
from daemon.chat.parsers.text import CONTENT, THINKING, Lead, ThinkContentCalls, assistant_prefill, give_call, leading
from daemon.chat.types import Message, Parsed, ThinkValue, Tool, ToolCall, think_enabled

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
TOOL_OPEN = "<tool_call>"
TOOL_CLOSE = "</tool_call>"

_TOOL = "tool"  # the parser state inside <tool_call> (besides thinking and content)


class Qwen3Parser(ThinkContentCalls):
    """Splits Qwen3 output into thinking, content and tool calls. ``has_thinking`` says whether the family thinks,
    ``default_thinking`` what an unset ``think`` means, ``always_thinks`` that the template opens the thinking
    whatever ``think`` says (qwen3-vl-thinking)."""

    has_tools = True

    def __init__(self, has_thinking: bool = False, default_thinking: bool = False, always_thinks: bool = False) -> None:
        self.has_thinking = has_thinking
        self._default_thinking = default_thinking
        self._always_thinks = always_thinks
        self._tools: list[Tool] = []
        self._buf = ""
        self._state = CONTENT
        self._skip_ws = False  # drop the whitespace that follows a tag, however it is split
        self._maybe_open = False  # a single leading <think> may still come (and is dropped)

    # -- the Parser protocol -------------------------------------------------------------------------------------

    def init(self, tools: Sequence[Tool] | None, last: Message | None, think: ThinkValue) -> Sequence[Tool] | None:
        self._tools = list(tools or [])
        self._buf, self._skip_ws = "", False
        thinking = self._always_thinks or (self._default_thinking if think is None else think_enabled(think))
        if self.has_thinking and thinking and not assistant_prefill(last):
            self._state = THINKING
            self._maybe_open = True
        else:
            self._state = CONTENT
            self._maybe_open = False
        return tools

    # -- the state machine ---------------------------------------------------------------------------------------

    def _step_thinking(self, out: Parsed) -> bool:
        if self._maybe_open:
            lead, rest = leading(self._buf, THINK_OPEN)
            if lead is Lead.WAIT:  # nothing yet, or "<thi" that may still become <think>
                return False
            self._maybe_open = False
            if lead is Lead.FOUND:
                self._buf, self._skip_ws = rest, True
                return True
        # a call before </think> ends the thinking too, whether or not the model said so
        text, tag = self._cut((THINK_CLOSE, TOOL_OPEN))
        out.thinking += text
        if tag == TOOL_OPEN:
            self._state = _TOOL
        elif tag == THINK_CLOSE:
            self._state, self._skip_ws = CONTENT, True
        return bool(tag)

    def _step_content(self, out: Parsed) -> bool:
        text, tag = self._cut((TOOL_OPEN,))
        out.content += text
        if tag:
            self._state = _TOOL
        return bool(tag)

    def _step_call(self, out: Parsed) -> bool:
        end = self._buf.find(TOOL_CLOSE)
        if end == -1:
            return False  # the body is not streamed; wait for the whole call
        body = self._buf[:end]
        self._buf = self._buf[end + len(TOOL_CLOSE) :]
        self._state, self._skip_ws = CONTENT, True
        self._finish_call(out, body, closed=True)
        return True

    def _flush_call(self, out: Parsed, held: str) -> None:
        """A call cut off by the end of generation is tried, else kept as text."""
        self._finish_call(out, held, closed=False)

    def _finish_call(self, out: Parsed, body: str, closed: bool) -> None:
        """Turn a call's body into a ToolCall, or, when it does not parse, give the original text back as content."""
        give_call(out, self.parse_call(body), TOOL_OPEN + body + (TOOL_CLOSE if closed else ""))

    # -- the call format -----------------------------------------------------------------------------------------

    def parse_call(self, body: str) -> ToolCall | None:
        """A JSON call ``{"name": …, "arguments": {…}}``; None when it is not one."""
        return json_call(body)


def json_call(body: str) -> ToolCall | None:
    """Parse ``{"name": …, "arguments": {…}}`` (arguments may also come as a JSON string, or be absent)."""
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError):
        return None
    if not isinstance(obj, dict):
        return None
    name = obj.get("name")
    if not isinstance(name, str) or not name.strip():
        return None
    args: Any = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some checkpoints encode the arguments object as a string
        try:
            args = json.loads(args) if args.strip() else {}
        except (ValueError, RecursionError):
            return None
    if args is None:
        args = {}
    if not isinstance(args, dict):
        return None
    return ToolCall(name=name.strip(), arguments=args)


register("qwen3", "qwen3-vl-instruct", has_thinking=False)(Qwen3Parser)
register("qwen3-thinking", has_thinking=True, default_thinking=True)(Qwen3Parser)
register("qwen3-vl-thinking", has_thinking=True, default_thinking=True, always_thinks=True)(Qwen3Parser)
