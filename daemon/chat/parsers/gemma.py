"""``gemma4``, ``gemma4-no-thinking`` and ``functiongemma``: Google's Gemma tool-call formats.

Gemma 4 thinks in a channel, ``<|channel>thought\\n ... <channel|>``, and calls tools as
``<|tool_call>call:NAME{key:value,...}<tool_call|>`` with strings between ``<|"|>`` markers. FunctionGemma calls
them as ``<start_function_call>call:NAME{key:<escape>value<escape>,...}<end_function_call>`` and does not think.
Both write other values bare (numbers, booleans, nested ``{}``/``[]``); a bare value of a field the schema says is
a string stays the text written."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from enum import Enum, auto
from typing import Any

from daemon.chat.parsers.base import register
from daemon.chat.parsers.text import StreamParser, give_call, hold_back
from daemon.chat.schema import declared_function, declared_properties
from daemon.chat.types import JSONObject, Message, Parsed, ThinkValue, Tool, ToolCall, think_enabled

G4_CHANNEL_OPEN = "<|channel>"
G4_CHANNEL_CLOSE = "<channel|>"
G4_CALL_OPEN = "<|tool_call>"
G4_CALL_CLOSE = "<tool_call|>"
G4_RESPONSE = "<|tool_response>"
G4_STRING = '<|"|>'
G4_CHANNEL_NAME = "thought\n"
FG_CALL_OPEN = "<start_function_call>"
FG_CALL_CLOSE = "<end_function_call>"
FG_STRING = "<escape>"


class _Malformed(ValueError):
    pass


class _ArgReader:
    """A recursive-descent reader of Gemma's argument syntax: ``{key:value,...}``, keys bare or quoted, strings
    between the family's string marker (or JSON-quoted), other values bare JSON literals."""

    def __init__(self, text: str, marker: str) -> None:
        self.s, self.i, self.marker = text, 0, marker
        self.bare: dict[str, str] = {}  # top-level keys whose value was written bare, with that text

    def _ws(self) -> None:
        while self.i < len(self.s) and self.s[self.i].isspace():
            self.i += 1

    def _peek(self) -> str:
        self._ws()
        if self.i >= len(self.s):
            raise _Malformed("unexpected end")
        return self.s[self.i]

    def _marked(self) -> str | None:
        """A string between markers, when one starts here."""
        if not self.s.startswith(self.marker, self.i):
            return None
        start = self.i + len(self.marker)
        end = self.s.find(self.marker, start)
        if end == -1:
            raise _Malformed("unclosed string")
        self.i = end + len(self.marker)
        return self.s[start:end]

    def _quoted(self) -> str:
        try:
            value, self.i = json.JSONDecoder().raw_decode(self.s, self.i)
        except ValueError as e:
            raise _Malformed("bad quoted string") from e
        return str(value)

    def read_object(self, top: bool = False) -> dict[str, Any]:
        if self._peek() != "{":
            raise _Malformed("expected {")
        self.i += 1
        out: dict[str, Any] = {}
        if self._peek() == "}":
            self.i += 1
            return out
        while True:
            key = self._key()
            if self._peek() != ":":
                raise _Malformed("expected :")
            self.i += 1
            self._peek()
            start = self.i
            value, was_bare = self._value()
            out[key] = value
            if top and was_bare:
                self.bare[key] = self.s[start : self.i].strip()
            c = self._peek()
            self.i += 1
            if c == "}":
                return out
            if c != ",":
                raise _Malformed("expected , or }")

    def _key(self) -> str:
        self._peek()
        marked = self._marked()
        if marked is not None:
            return marked
        if self.s[self.i] == '"':
            return self._quoted()
        end = self.s.find(":", self.i)
        key = self.s[self.i : end].strip() if end != -1 else ""
        if not key or any(c in key for c in "{}[],\"'"):
            raise _Malformed("bad key")
        self.i = end
        return key

    def _array(self) -> list[Any]:
        self.i += 1
        out: list[Any] = []
        if self._peek() == "]":
            self.i += 1
            return out
        while True:
            out.append(self._value()[0])
            c = self._peek()
            self.i += 1
            if c == "]":
                return out
            if c != ",":
                raise _Malformed("expected , or ]")

    def _value(self) -> tuple[Any, bool]:
        """The next value, and whether it was written bare."""
        c = self._peek()
        marked = self._marked()
        if marked is not None:
            return marked, False
        if c == "{":
            return self.read_object(), False
        if c == "[":
            return self._array(), False
        if c == '"':
            return self._quoted(), False
        start = self.i
        while self.i < len(self.s) and self.s[self.i] not in ",}]" and not self.s.startswith(self.marker, self.i):
            self.i += 1
        token = self.s[start : self.i].strip()
        if not token:
            raise _Malformed("empty value")
        try:
            return json.loads(token), True
        except ValueError:
            return token, True  # an unquoted word: the text written

    def at_end(self) -> bool:
        self._ws()
        return self.i >= len(self.s)


def _string_only(tool: JSONObject | None, key: str) -> bool:
    """Whether the declared tool says argument ``key`` is a string and nothing else."""
    prop = declared_properties(tool).get(key)
    return isinstance(prop, Mapping) and prop.get("type") in ("string", ["string"])


def parse_call(body: str, marker: str, tools: Sequence[Tool] | None) -> ToolCall | None:
    """``call:NAME{...}``; None when it is not a well-formed call (the caller keeps it as content)."""
    body = body.strip()
    if not body.startswith("call:"):
        return None
    brace = body.find("{")
    name = body[len("call:") : brace].strip() if brace != -1 else ""
    if not name:
        return None
    reader = _ArgReader(body[brace:], marker)
    try:
        args = reader.read_object(top=True)
        if not reader.at_end():
            return None
    except _Malformed:
        return None
    tool = declared_function(tools, name)
    for key, text in reader.bare.items():
        if _string_only(tool, key):
            args[key] = text  # "007" for a string field is the text, not the number 7
    return ToolCall(name=name, arguments=args)


class _G4(Enum):
    CONTENT = auto()
    CHANNEL_NAME = auto()  # just after <|channel>: the channel's name ("thought\n") is not thinking
    THINKING = auto()
    CALL = auto()
    AFTER_CALL = auto()  # Gemma 4 may repeat <tool_call|> or open <|tool_response> after a call: not content


class Gemma4Parser(StreamParser):
    """Gemma 4. Whitespace around the channel and calls is trimmed (as Ollama does), so trailing whitespace waits
    for the next visible character; the result is the same however the text is split. When thinking was not asked
    for, what the model writes in its channel is dropped."""

    has_tools = True

    def __init__(self, thinking: bool = True) -> None:
        self.has_thinking = thinking
        self._show_thinking = False
        self._state = _G4.CONTENT
        self._buf = ""
        self._skip_ws = False
        self._tools: Sequence[Tool] | None = None

    def init(self, tools: Sequence[Tool] | None, last: Message | None, think: ThinkValue) -> Sequence[Tool] | None:
        self._tools, self._buf, self._skip_ws = tools, "", False
        self._show_thinking = self.has_thinking and think_enabled(think)
        # after a tool result the prompt leaves the model inside its thinking channel
        after_tool = last is not None and last.role == "tool"
        self._state = _G4.THINKING if self._show_thinking and after_tool else _G4.CONTENT
        return tools

    def _think(self, out: Parsed, text: str) -> None:
        if self._show_thinking:
            out.thinking += text

    def _step(self, out: Parsed) -> bool:
        if not self._skip_space():
            return False
        buf, st = self._buf, self._state
        if st is _G4.CONTENT:
            text, tag = self._cut((G4_CHANNEL_OPEN, G4_CALL_OPEN))
            out.content += text
            if tag:
                self._state = _G4.CHANNEL_NAME if tag == G4_CHANNEL_OPEN else _G4.CALL
            return bool(tag)
        if st is _G4.CHANNEL_NAME:
            if buf.startswith(G4_CHANNEL_NAME):
                self._buf = buf[len(G4_CHANNEL_NAME) :]
            elif G4_CHANNEL_NAME.startswith(buf):
                return False
            self._state = _G4.THINKING
            return True
        if st is _G4.THINKING:
            text, tag = self._cut((G4_CHANNEL_CLOSE,))
            self._think(out, text)
            if tag:
                self._state, self._skip_ws = _G4.CONTENT, True
            return bool(tag)
        if st is _G4.CALL:
            i = buf.find(G4_CALL_CLOSE)
            if i == -1:
                return False  # calls are not streamed: wait for the whole call
            call = parse_call(buf[:i], G4_STRING, self._tools)
            give_call(out, call, G4_CALL_OPEN + buf[: i + len(G4_CALL_CLOSE)])  # not a call: nothing is lost
            self._buf, self._state, self._skip_ws = buf[i + len(G4_CALL_CLOSE) :], _G4.AFTER_CALL, True
            return True
        # AFTER_CALL
        for noise in (G4_CALL_CLOSE, G4_RESPONSE):
            if buf.startswith(noise):
                self._buf, self._skip_ws = buf[len(noise) :], True
                return True
        if G4_CALL_CLOSE.startswith(buf) or G4_RESPONSE.startswith(buf):
            return False
        self._state = _G4.CONTENT
        return True

    def _flush(self, out: Parsed) -> None:
        buf, st = self._buf, self._state
        self._buf = ""
        if st is _G4.CONTENT:
            out.content += buf
        elif st in (_G4.THINKING, _G4.CHANNEL_NAME):
            self._think(out, buf)
        elif st is _G4.CALL:
            # a stop may come before <tool_call|>: a call that reads whole still counts
            call = parse_call(hold_back(buf, (G4_CALL_CLOSE,), trim=False)[0], G4_STRING, self._tools)
            give_call(out, call, G4_CALL_OPEN + buf)
        # AFTER_CALL: only the start of a noise token is left


@register("gemma4")
class Gemma4ThinkingParser(Gemma4Parser):
    def __init__(self) -> None:
        super().__init__(thinking=True)


@register("gemma4-no-thinking")
class Gemma4PlainParser(Gemma4Parser):
    def __init__(self) -> None:
        super().__init__(thinking=False)


@register("functiongemma")
class FunctionGemmaParser(StreamParser):
    """FunctionGemma: content and calls only, text kept exactly as written around the calls."""

    has_tools = True
    has_thinking = False

    def __init__(self) -> None:
        self._in_call = False
        self._buf = ""
        self._tools: Sequence[Tool] | None = None

    def init(self, tools: Sequence[Tool] | None, last: Message | None, think: ThinkValue) -> Sequence[Tool] | None:
        self._tools, self._buf, self._in_call = tools, "", False
        return tools

    def _flush(self, out: Parsed) -> None:
        buf, self._buf = self._buf, ""
        if not self._in_call:
            out.content += buf
            return
        call = parse_call(hold_back(buf, (FG_CALL_CLOSE,), trim=False)[0], FG_STRING, self._tools)
        give_call(out, call, FG_CALL_OPEN + buf)

    def _step(self, out: Parsed) -> bool:
        if not self._in_call:
            # unlike Gemma 4, the text around FunctionGemma's calls is kept as written: nothing is trimmed
            text, tag = self._cut((FG_CALL_OPEN,), trim=False)
            out.content += text
            self._in_call = bool(tag)
            return bool(tag)
        buf = self._buf
        i = buf.find(FG_CALL_CLOSE)
        if i == -1:
            return False
        call = parse_call(buf[:i], FG_STRING, self._tools)
        give_call(out, call, FG_CALL_OPEN + buf[: i + len(FG_CALL_CLOSE)])
        self._buf, self._in_call = buf[i + len(FG_CALL_CLOSE) :], False
        return True
