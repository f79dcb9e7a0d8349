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

from daemon.chat.parsers import register
from daemon.chat.parsers.base import Message, Tool
from daemon.chat.types import Parsed, ThinkValue, ToolCall, think_enabled

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
TOOL_OPEN = "<tool_call>"
TOOL_CLOSE = "</tool_call>"

# parser states
_THINKING = "thinking"
_CONTENT = "content"
_TOOL = "tool"


def overlap(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag`` (a tag that may be arriving)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def trailing_space(text: str) -> int:
    """Length of the whitespace at the end of ``text``."""
    return len(text) - len(text.rstrip())


def assistant_prefill(last: Message | None) -> bool:
    """True when the prompt ends with an assistant message that already has content: the generation continues the
    answer, so whatever thinking there was is over."""
    return last is not None and last.get("role") == "assistant" and bool(last.get("content"))


class Qwen3Parser:
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
        self._state = _CONTENT
        self._eat_space = False  # drop the whitespace that follows a tag, however it is split
        self._maybe_open = False  # a single leading <think> may still come (and is dropped)

    # -- the Parser protocol -------------------------------------------------------------------------------------

    def init(self, tools: Sequence[Tool] | None, last: Message | None, think: ThinkValue) -> Sequence[Tool] | None:
        self._tools = list(tools or [])
        self._buf = ""
        self._eat_space = False
        thinking = self._always_thinks or (self._default_thinking if think is None else think_enabled(think))
        if self.has_thinking and thinking and not assistant_prefill(last):
            self._state = _THINKING
            self._maybe_open = True
        else:
            self._state = _CONTENT
            self._maybe_open = False
        return tools

    def add(self, text: str, done: bool) -> Parsed:
        self._buf += text
        out = Parsed()
        while self._step(out):
            pass
        if done:
            self._flush(out)
        return out

    # -- the state machine ---------------------------------------------------------------------------------------

    def _step(self, out: Parsed) -> bool:
        """Consume what the buffer makes certain; True when the state changed and another step may do more."""
        if self._eat_space:
            self._buf = self._buf.lstrip()
            if not self._buf:
                return False
            self._eat_space = False
        if self._state == _THINKING:
            return self._step_thinking(out)
        if self._state == _CONTENT:
            return self._step_content(out)
        return self._step_tool(out)

    def _step_thinking(self, out: Parsed) -> bool:
        buf = self._buf
        if self._maybe_open:
            stripped = buf.lstrip()
            if stripped.startswith(THINK_OPEN):
                self._buf = stripped[len(THINK_OPEN) :]
                self._maybe_open = False
                self._eat_space = True
                return True
            if THINK_OPEN.startswith(stripped):  # nothing yet, or "<thi" that may still become <think>
                return False
            self._maybe_open = False
        close, tool = buf.find(THINK_CLOSE), buf.find(TOOL_OPEN)
        if tool != -1 and (close == -1 or tool < close):
            # a call before </think>: the thinking is over, whether or not the model said so
            out.thinking += buf[:tool].rstrip()
            self._buf = buf[tool + len(TOOL_OPEN) :]
            self._state = _TOOL
            return True
        if close != -1:
            out.thinking += buf[:close].rstrip()
            self._buf = buf[close + len(THINK_CLOSE) :]
            self._state = _CONTENT
            self._eat_space = True
            return True
        self._emit_certain(out, "thinking", (THINK_CLOSE, TOOL_OPEN))
        return False

    def _step_content(self, out: Parsed) -> bool:
        buf = self._buf
        tool = buf.find(TOOL_OPEN)
        if tool != -1:
            out.content += buf[:tool].rstrip()
            self._buf = buf[tool + len(TOOL_OPEN) :]
            self._state = _TOOL
            return True
        self._emit_certain(out, "content", (TOOL_OPEN,))
        return False

    def _step_tool(self, out: Parsed) -> bool:
        end = self._buf.find(TOOL_CLOSE)
        if end == -1:
            return False  # the body is not streamed; wait for the whole call
        body = self._buf[:end]
        self._buf = self._buf[end + len(TOOL_CLOSE) :]
        self._state = _CONTENT
        self._eat_space = True
        self._finish_call(out, body, closed=True)
        return True

    def _emit_certain(self, out: Parsed, field: str, tags: tuple[str, ...]) -> None:
        """Emit the buffer except a tail that may be the start of one of ``tags`` and the whitespace before it
        (whitespace before a tag is trimmed, so it is only certain once something else follows)."""
        buf = self._buf
        keep = max(overlap(buf, tag) for tag in tags)
        head = buf[: len(buf) - keep]
        cut = len(head) - trailing_space(head)
        if cut:
            setattr(out, field, getattr(out, field) + buf[:cut])
            self._buf = buf[cut:]

    def _flush(self, out: Parsed) -> None:
        """End of generation: everything still held is returned (an unfinished call is tried, else kept as text)."""
        buf, self._buf = self._buf, ""
        if self._eat_space:
            buf = buf.lstrip()
        if self._state == _THINKING:
            out.thinking += buf
        elif self._state == _CONTENT:
            out.content += buf
        else:
            self._finish_call(out, buf, closed=False)
        self._state = _CONTENT

    def _finish_call(self, out: Parsed, body: str, closed: bool) -> None:
        """Turn a call's body into a ToolCall, or, when it does not parse, give the original text back as content."""
        call = self.parse_call(body)
        if call is not None:
            out.calls.append(call)
            return
        out.content += TOOL_OPEN + body + (TOOL_CLOSE if closed else "")

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
