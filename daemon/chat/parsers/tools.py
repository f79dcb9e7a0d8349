"""The generic tool-call parser: a model writes a tag (``<tool_call>``, ``[TOOL_CALLS]``, ``<|python_tag|>``), or
nothing but a JSON object at the very start (tag ``{``/``[``), then the calls as JSON. Also the generic chat parser
built on it (thinking splitter first, then tool calls on the content), and the named families that are nothing
more: ``llama3`` and ``json-tools``/``hermes``.

Behaviour follows Ollama's ``tools/tools.go``: text before the tag streams out at once (only what may be a partial
tag is held back); after the tag, each complete JSON value becomes calls as soon as it closes; a value that is not a
call of a declared tool is given back as content, tag included, so nothing is lost."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from enum import Enum
from typing import Any

from daemon.chat.parsers.base import register
from daemon.chat.parsers.text import JsonEnd, overlap
from daemon.chat.parsers.thinking import ThinkingParser
from daemon.chat.types import Message, Parsed, ThinkValue, Tool, ToolCall, think_enabled

BARE_TAGS = ("{", "[")  # "tags" that are the JSON's own first character: calls only at the start of the output
_SEPARATORS = ";,"  # between consecutive calls (llama 3.2 writes `{...}; {...}`)


def tool_names(tools: Iterable[Tool] | None) -> set[str]:
    """The names of the declared function tools (Ollama/OpenAI ``{"function": {"name"}}`` or a bare ``{"name"}``)."""
    return {tool.name for tool in tools or () if tool.name}


def closing_tag(tag: str) -> str | None:
    """The closing form of an XML-like or bracketed tag (``<tool_call>`` → ``</tool_call>``,
    ``[TOOL_CALLS]`` → ``[/TOOL_CALLS]``); None for others (``<|python_tag|>``)."""
    if len(tag) > 2 and tag[0] == "<" and tag[-1] == ">" and tag[1] not in "/|":
        return "</" + tag[1:]
    if len(tag) > 2 and tag[0] == "[" and tag[-1] == "]" and tag[1] != "/":
        return "[/" + tag[1:]
    return None


def _arguments(value: Any) -> dict[str, Any] | None:
    """Arguments as a dict: a missing/null value is none at all, a JSON string is decoded; else None (not a call)."""
    if value is None:
        return {}
    if isinstance(value, str):
        if not value.strip():
            return {}
        try:
            value = json.loads(value)
        except (ValueError, RecursionError):
            return None
    return value if isinstance(value, dict) else None


def to_call(obj: Any, names: set[str] | None) -> ToolCall | None:
    """One call from a decoded JSON value, or None when it is not a call of a declared tool (``names``; None:
    any name). Shapes: ``{"name", "arguments"}``, ``{"name", "parameters"}``, ``{"function": {...}}`` (OpenAI's,
    with or without ``"type"``), and ``{"<tool name>": {arguments}}``."""
    if not isinstance(obj, dict):
        return None
    if isinstance(obj.get("function"), dict) and "name" not in obj:
        obj = obj["function"]
    name = obj.get("name")
    if isinstance(name, str):
        raw = obj["arguments"] if "arguments" in obj else obj.get("parameters")
        args = _arguments(raw)
    elif len(obj) == 1 and names:
        name, raw = next(iter(obj.items()))
        args = raw if isinstance(raw, dict) and name in names else None
    else:
        return None
    if args is None or not name or (names is not None and name not in names):
        return None
    return ToolCall(name=name, arguments=args)


def to_calls(text: str, names: set[str] | None) -> list[ToolCall] | None:
    """The calls a complete JSON object (one call) or array (each item a call) holds, or None when any is not."""
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        return None
    items = value if isinstance(value, list) else [value]
    calls = [to_call(item, names) for item in items]
    if not calls or any(c is None for c in calls):
        return None
    return [c for c in calls if c is not None]


class _State(Enum):
    LOOKING = 0  # content, watching for the tag
    CALLING = 1  # after the tag: JSON calls, closing tags, whitespace
    DONE = 2  # everything else is content


class ToolCallParser:
    """The streaming tag + JSON tool-call parser. ``tag``: what precedes the calls (``{`` or ``[``: no tag, the
    output must begin with the JSON). ``tools``: the declared tools; calls of other names are content (None:
    any name is accepted). ``leading_json``: besides the tag, a JSON value at the very start is also a call (the
    Llama 3 family writes ``<|python_tag|>`` or bare JSON)."""

    def __init__(self, tag: str, tools: Sequence[Tool] | None = None, leading_json: bool = False) -> None:
        if not tag.strip():
            raise ValueError("the tool tag must not be blank")
        self.tag = tag.strip()
        if len(self.tag) > 1 and self.tag.endswith("["):
            # Templates such as `[TOOL_CALLS] [` or `functools[` open an array right after the tag: match the tag
            # alone and read the array as JSON (an array of calls), whatever the spacing the model uses.
            self.tag = self.tag[:-1].rstrip()
        self.bare = self.tag in BARE_TAGS
        self.leading_json = leading_json or self.bare
        self.names = tool_names(tools) if tools is not None else None
        # What may stand between calls after the tag: the closing tag, or the tag again (one per call).
        closing = "```" if self.tag.startswith("```") else closing_tag(self.tag)
        self._skip = tuple(t for t in ((closing, None) if self.bare else (closing, self.tag)) if t)
        self.state = _State.LOOKING
        self.seen_text = False  # non-whitespace content went out (a leading JSON is no longer at the start)
        self.count = 0  # calls found so far
        self._buf = ""
        self._pending = ""  # the tag and what was skipped after it, given back if no call follows
        self._stint = 0  # calls since the tag
        self._scan = JsonEnd()  # where the JSON at the start of _buf closes, scanned once however it grows

    def add(self, text: str, done: bool = False) -> tuple[list[ToolCall], str]:
        """Take the next piece of content; return the calls completed and the content now certain."""
        self._buf += text
        calls: list[ToolCall] = []
        out: list[str] = []
        while self._step(calls, out, done):
            pass
        content = "".join(out)
        if content.strip():
            self.seen_text = True
        return calls, content

    # ----------------------------------------------------------------------------------------------- states

    def _step(self, calls: list[ToolCall], out: list[str], done: bool) -> bool:
        """One move; True when there may be more to do with the buffer as it is."""
        if self.state is _State.DONE:
            out.append(self._buf)
            self._buf = ""
            return False
        if self.state is _State.LOOKING:
            return self._look(out, done)
        return self._call(calls, out, done)

    def _look(self, out: list[str], done: bool) -> bool:
        buf = self._buf
        if self.leading_json and not self.seen_text and not "".join(out).strip():
            rest = buf.lstrip()
            if not rest:
                if done:  # only whitespace, ever
                    out.append(buf)
                    self._buf = ""
                return False
            if rest[0] in BARE_TAGS:
                self._enter(rest, buf[: len(buf) - len(rest)])  # the whitespace is given back if no call follows
                return True
            if self.bare:  # the output began with something else: no calls
                self.state = _State.DONE
                return True
        i = buf.find(self.tag)
        if i >= 0:
            out.append(buf[:i])
            self._enter(buf[i + len(self.tag) :], self.tag)
            return True
        keep = 0 if done else overlap(buf, self.tag)
        out.append(buf[: len(buf) - keep])
        self._buf = buf[len(buf) - keep :]
        return False

    def _enter(self, rest: str, tag: str) -> None:
        self.state = _State.CALLING
        self._buf, self._pending, self._stint = rest, tag, 0
        self._scan = JsonEnd()

    def _leave(self, out: list[str], rest: str) -> None:
        """The calls are over (or never came): give back the tag etc. if no call followed it, then content."""
        if not self._stint:
            out.append(self._pending)
        self._pending, self._buf = "", rest
        self.state = _State.DONE if self.bare else _State.LOOKING
        self.seen_text = self.seen_text or bool(rest.strip()) or not self._stint

    def _call(self, calls: list[ToolCall], out: list[str], done: bool) -> bool:
        buf = self._buf
        rest = buf.lstrip()
        if not rest:
            if done:
                self._leave(out, "")
                if not self._stint:
                    out.append(buf)
            return False
        ws = buf[: len(buf) - len(rest)]
        # Closing tags first: `[/TOOL_CALLS]` must not be read as the start of a JSON array.
        for skip in self._skip:
            if rest.startswith(skip):
                self._pending += ws + skip
                self._buf = rest[len(skip) :]
                return True
            if skip.startswith(rest) and not done:
                return False  # may be a partial closing tag
        if rest[0] in BARE_TAGS:
            if ws:  # keep the scan aligned with the start of the JSON
                self._pending += ws
                self._buf, self._scan = rest, JsonEnd()
            close = self._scan.feed(self._buf)
            if close == -1:
                if done:  # never closed
                    self._leave(out, self._buf)
                    return True
                return False
            raw, after = self._buf[: close + 1], self._buf[close + 1 :]
            found = to_calls(raw, self.names)
            self._scan = JsonEnd()
            if found is None:
                self._leave(out, "")
                out.append(raw)
                self._buf = after
                return True
            calls.extend(found)
            self.count += len(found)
            self._stint += len(found)
            self._pending, self._buf = "", after
            return True
        if self._stint and rest[0] in _SEPARATORS:
            self._pending += ws + rest[0]
            self._buf = rest[1:]
            return True
        # Other text: the calls are over. Whitespace is dropped after calls, kept when it followed a bare tag.
        self._leave(out, rest if self._stint else buf)
        return True


@register("llama3", tool_tag="<|python_tag|>", leading_json=True)
@register("json-tools", "hermes", think_tags=("<think>", "</think>"), tool_tag="<tool_call>")
class GenericParser:
    """Thinking between tags (when ``think`` asks for it), then tool calls after a tag, on any model. Used for
    models without a ``PARSER``, with tags inferred from their template, and registered for the families that
    need nothing more. ``prefilled_thinking``: the prompt ends with the opening tag (see also :meth:`prefill`)."""

    answer_after_thinking = ""

    def __init__(
        self,
        think_tags: tuple[str, str] | None = None,
        tool_tag: str | None = None,
        prefilled_thinking: bool = False,
        leading_json: bool = False,
    ) -> None:
        self.think_tags = think_tags if think_tags and all(t.strip() for t in think_tags) else None
        self.tool_tag = tool_tag.strip() if tool_tag and tool_tag.strip() else None
        self.has_thinking = self.think_tags is not None
        self.has_tools = self.tool_tag is not None
        self.prefilled_thinking = prefilled_thinking
        self.leading_json = leading_json
        self._thinking: ThinkingParser | None = None
        self._tools: ToolCallParser | None = None

    def init(self, tools: Sequence[Tool] | None, last: Message | None, think: ThinkValue) -> Sequence[Tool] | None:
        self._thinking = self._tools = None
        # A prefilled assistant message with content is continued as content: its thinking (if any) is over.
        continuing = last is not None and last.role == "assistant" and bool(last.content)
        if self.think_tags and think_enabled(think) and not continuing:
            opening, closing = self.think_tags
            self._thinking = ThinkingParser(opening, closing, prefilled=self.prefilled_thinking)
        if self.tool_tag and tools:
            self._tools = ToolCallParser(self.tool_tag, tools, leading_json=self.leading_json)
        return tools

    def prefill(self) -> None:
        """The rendered prompt ended with the opening thinking tag: the model starts inside its thinking."""
        self.prefilled_thinking = True
        if self._thinking is not None:
            self._thinking.prefill()

    def add(self, text: str, done: bool) -> Parsed:
        thinking, content = "", text
        if self._thinking is not None:
            thinking, content = self._thinking.add(text)
            if done:
                more_thinking, more_content = self._thinking.flush()
                thinking, content = thinking + more_thinking, content + more_content
        if self._tools is None:
            return Parsed(content=content, thinking=thinking)
        calls, content = self._tools.add(content, done)
        return Parsed(content=content, thinking=thinking, calls=calls)
