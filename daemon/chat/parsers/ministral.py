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

from daemon.chat.parsers import register
from daemon.chat.parsers.base import Message, Tool
from daemon.chat.types import Parsed, ThinkValue, ToolCall

TOOL_CALLS = "[TOOL_CALLS]"
THINK = "[THINK]"
THINK_END = "[/THINK]"
ARGS = "[ARGS]"
CALL_ID = "[CALL_ID]"

# parser states
_CONTENT = "content"
_THINKING = "thinking"
_CALL = "call"  # after [TOOL_CALLS]; the buffer keeps the call's text verbatim until it is decided

# where in a call the parser is
_FORM = "form"  # which form follows
_NAME = "name"  # NAME up to [ARGS]
_ARGS = "args"  # waiting for the arguments object
_JSON = "json"  # inside the arguments object (or the array of the older form)

_NOT_IN_NAME = frozenset('\n{}"')  # a "name" holding these is prose or JSON, not a call


def _overlap(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class JsonEnd:
    """Finds where a JSON object or array that starts at ``start`` closes, scanning each character once however
    the text grows (calls can be long, and arrive a token at a time)."""

    def __init__(self, start: int) -> None:
        self.pos = start
        self._depth = 0
        self._in_string = False
        self._escaped = False

    def feed(self, text: str) -> int:
        """The index of the closing bracket in ``text`` (the same text, grown), or -1 while it is still open."""
        while self.pos < len(text):
            c = text[self.pos]
            self.pos += 1
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif c == "\\":
                    self._escaped = True
                elif c == '"':
                    self._in_string = False
            elif c == '"':
                self._in_string = True
            elif c in "{[":
                self._depth += 1
            elif c in "}]":
                self._depth -= 1
                if self._depth == 0:
                    return self.pos - 1
        return -1


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


class MinistralParser:
    """Splits Mistral-family output into thinking, content and tool calls. ``has_thinking`` starts the generation
    inside the thinking (a template that opens ``[THINK]``); ``[THINK]`` in the output starts it in any case."""

    has_tools = True

    def __init__(self, has_thinking: bool = False) -> None:
        self.has_thinking = has_thinking
        self._buf = ""
        self._state = _CONTENT
        self._eat_space = False
        self._part = _FORM
        self._at = 0  # where the current part of a call starts in the buffer
        self._name = ""
        self._json: JsonEnd | None = None

    def init(self, tools: Sequence[Tool] | None, last: Message | None, think: ThinkValue) -> Sequence[Tool] | None:
        self._buf = ""
        self._eat_space = False
        prefill = last is not None and last.get("role") == "assistant" and bool(last.get("content"))
        self._state = _THINKING if self.has_thinking and not prefill else _CONTENT
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
        if self._eat_space:
            self._buf = self._buf.lstrip()
            if not self._buf:
                return False
            self._eat_space = False
        if self._state == _CONTENT:
            return self._step_content(out)
        if self._state == _THINKING:
            return self._step_thinking(out)
        return self._step_call(out)

    def _step_content(self, out: Parsed) -> bool:
        buf = self._buf
        calls, think = buf.find(TOOL_CALLS), buf.find(THINK)
        if calls != -1 and (think == -1 or calls < think):
            out.content += buf[:calls].rstrip()
            self._buf = buf[calls + len(TOOL_CALLS) :]
            self._state, self._part = _CALL, _FORM
            return True
        if think != -1:
            out.content += buf[:think].rstrip()
            self._buf = buf[think + len(THINK) :]
            self._state = _THINKING
            return True
        # hold back what may be a tag arriving, and the whitespace before it (trimmed if it is a tag)
        keep = max(_overlap(buf, TOOL_CALLS), _overlap(buf, THINK))
        head = buf[: len(buf) - keep]
        cut = len(head.rstrip())
        if cut:
            out.content += buf[:cut]
            self._buf = buf[cut:]
        return False

    def _step_thinking(self, out: Parsed) -> bool:
        buf = self._buf
        end = buf.find(THINK_END)
        if end != -1:
            out.thinking += buf[:end]
            self._buf = buf[end + len(THINK_END) :]
            self._state = _CONTENT
            self._eat_space = True
            return True
        keep = _overlap(buf, THINK_END)
        out.thinking += buf[: len(buf) - keep]
        self._buf = buf[len(buf) - keep :]
        return False

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
        self._state = _CONTENT
        self._eat_space = True
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
        self._state = _CONTENT
        self._json = None
        return True

    def _flush(self, out: Parsed) -> None:
        buf, self._buf = self._buf, ""
        if self._eat_space:
            buf = buf.lstrip()
        if self._state == _THINKING:
            out.thinking += buf
        elif self._state == _CONTENT:
            out.content += buf
        else:  # a call cut off before its JSON closed
            out.content += TOOL_CALLS + buf
        self._state = _CONTENT


register("ministral", "mistral", has_thinking=False)(MinistralParser)
