"""``ministral`` / ``mistral``: Mistral's control tokens. ``[THINK]…[/THINK]`` is thinking (Magistral, Ministral 3);
``[TOOL_CALLS]`` starts calls in one of two forms:

* the newer one, a call per tag: ``[TOOL_CALLS]NAME[ARGS]{json}`` (perhaps ``NAME[CALL_ID]id[ARGS]…``), repeated
  for several calls;
* the older one, a JSON array after a single tag: ``[TOOL_CALLS][{"name": …, "arguments": {…}}, …]``.

Calls are returned as soon as their JSON closes; text after them is content. A call that does not parse is given
back verbatim as content."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from daemon.chat.parsers.base import register
from daemon.chat.parsers.text import CONTENT, THINKING, JsonEnd, ThinkContentCalls, assistant_prefill
from daemon.chat.types import Message, Parsed, ThinkValue, Tool, ToolCall

TOOL_CALLS = "[TOOL_CALLS]"
THINK = "[THINK]"
THINK_END = "[/THINK]"
ARGS = "[ARGS]"
CALL_ID = "[CALL_ID]"

_CALL = "call"  # the parser state after [TOOL_CALLS] (besides thinking and content); the buffer keeps the call's
# text verbatim until it is decided

# where in a call the parser is
_FORM = "form"  # which form follows
_NAME = "name"  # NAME up to [ARGS]
_ARGS = "args"  # waiting for the arguments object
_JSON = "json"  # inside the arguments object (or the array of the older form)

_NOT_IN_NAME = frozenset('\n{}"')  # a "name" holding these is prose or JSON, not a call


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return None


def _call_from(obj: Any) -> ToolCall | None:
    """``{"name": …, "arguments": {…}}`` (arguments may be a JSON string) as a ToolCall; None when it is not one."""
    if not isinstance(obj, dict):
        return None
    name = obj.get("name")
    args = obj.get("arguments", {})
    if isinstance(args, str):
        args = _loads(args) if args.strip() else {}
    if args is None:
        args = {}
    if not isinstance(name, str) or not name.strip() or not isinstance(args, dict):
        return None
    return ToolCall(name=name.strip(), arguments=args)


class MinistralParser(ThinkContentCalls):
    """Splits Mistral-family output into thinking, content and tool calls. ``has_thinking`` starts the generation
    inside the thinking (a template that opens ``[THINK]``); ``[THINK]`` in the output starts it in any case."""

    has_tools = True

    def __init__(self, has_thinking: bool = False) -> None:
        self.has_thinking = has_thinking
        self._buf = ""
        self._state = CONTENT
        self._skip_ws = False
        self._part = _FORM
        self._at = 0  # where the current part of a call starts in the buffer
        self._name = ""
        self._json: JsonEnd | None = None

    def init(self, tools: Sequence[Tool] | None, last: Message | None, think: ThinkValue) -> Sequence[Tool] | None:
        self._buf, self._skip_ws = "", False
        self._state = THINKING if self.has_thinking and not assistant_prefill(last) else CONTENT
        return tools

    # -- the state machine ---------------------------------------------------------------------------------------

    def _step_content(self, out: Parsed) -> bool:
        # what may be a tag arriving is held back, and the whitespace before it (trimmed if it is a tag)
        text, tag = self._cut((TOOL_CALLS, THINK))
        out.content += text
        if tag == TOOL_CALLS:
            self._state, self._part = _CALL, _FORM
        elif tag == THINK:
            self._state = THINKING
        return bool(tag)

    def _step_thinking(self, out: Parsed) -> bool:
        # unlike the content, the thinking keeps the whitespace before [/THINK] (only what follows it is eaten)
        text, tag = self._cut((THINK_END,), trim=False)
        out.thinking += text
        if tag:
            self._state, self._skip_ws = CONTENT, True
        return bool(tag)

    def _step_call(self, out: Parsed) -> bool:
        buf = self._buf
        if self._part == _FORM:
            start = len(buf) - len(buf.lstrip())
            if start == len(buf):
                return False
            if buf[start] in "[{":  # the older form: a JSON array of calls (or one call object)
                self._part, self._at, self._json = _JSON, start, JsonEnd(start)
                self._name = ""
            else:
                self._part, self._at = _NAME, start
            return True
        if self._part == _NAME:
            end = buf.find(ARGS, self._at)
            name = buf[self._at : end if end != -1 else len(buf)]
            if _NOT_IN_NAME.intersection(name):
                return self._fail(out)
            if end == -1:
                return False
            name = name.split(CALL_ID, 1)[0].strip()
            if not name:
                return self._fail(out)
            self._name, self._part, self._at = name, _ARGS, end + len(ARGS)
            return True
        if self._part == _ARGS:
            start = self._at + len(buf[self._at :]) - len(buf[self._at :].lstrip())
            if start == len(buf):
                return False
            if buf[start] != "{":
                return self._fail(out)
            self._part, self._at, self._json = _JSON, start, JsonEnd(start)
            return True
        assert self._json is not None
        end = self._json.feed(buf)
        if end == -1:
            return False
        calls = self._calls(_loads(buf[self._at : end + 1]))
        if calls is None:
            return self._fail(out)
        out.calls.extend(calls)
        self._buf = buf[end + 1 :]
        self._state, self._skip_ws = CONTENT, True
        return True

    def _calls(self, parsed: Any) -> list[ToolCall] | None:
        """The calls a finished JSON value holds: ``NAME[ARGS]``'s object, or the older form's array or object."""
        if self._name:
            return [ToolCall(name=self._name, arguments=parsed)] if isinstance(parsed, dict) else None
        items = parsed if isinstance(parsed, list) else [parsed]
        calls = [_call_from(item) for item in items]
        if not calls or any(call is None for call in calls):
            return None
        return [call for call in calls if call is not None]

    def _fail(self, out: Parsed) -> bool:
        """Not a call after all: the tag is content, and the text after it is read again as content."""
        out.content += TOOL_CALLS
        self._state = CONTENT
        self._json = None
        return True

    def _flush_call(self, out: Parsed, held: str) -> None:
        out.content += TOOL_CALLS + held  # a call cut off before its JSON closed


register("ministral", "mistral", has_thinking=False)(MinistralParser)
