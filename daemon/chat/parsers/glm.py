"""``glm-4.5``, ``glm-4.6`` and ``glm-4.7``: Zhipu's GLM output, thinking in ``<think>`` ... ``</think>`` and tool calls
as ``<tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value>...</tool_call>``, each value typed by the declared
tool's parameter schema (GLM writes strings bare and everything else as JSON)."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from enum import Enum, auto
from typing import Any

from daemon.chat.parsers import register
from daemon.chat.parsers.base import Message, Tool
from daemon.chat.types import Parsed, ThinkValue, ToolCall, think_enabled

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
CALL_OPEN = "<tool_call>"
CALL_CLOSE = "</tool_call>"
_ARG = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)


class _State(Enum):
    START = auto()  # before the first visible text: a <think> may open thinking
    THINKING = auto()
    CONTENT = auto()
    CALL = auto()  # inside <tool_call> ... </tool_call>


def _partial_suffix(buf: str, tag: str) -> int:
    """Length of the longest end of ``buf`` that starts ``tag``: it waits for the next piece."""
    for n in range(min(len(tag) - 1, len(buf)), 0, -1):
        if buf.endswith(tag[:n]):
            return n
    return 0


def _schema_types(tool: Mapping[str, Any] | None, key: str) -> set[str]:
    """The JSON types the declared tool allows for argument ``key`` (``anyOf`` included); empty when unknown."""
    if tool is None:
        return set()
    params = tool.get("parameters") or {}
    props = params.get("properties") if isinstance(params, Mapping) else None
    prop = props.get(key) if isinstance(props, Mapping) else None
    if not isinstance(prop, Mapping):
        return set()
    types: set[str] = set()
    for p in [prop, *(prop.get("anyOf") or ())]:
        t = p.get("type") if isinstance(p, Mapping) else None
        types.update([t] if isinstance(t, str) else (t or ()))
    return types


def typed_value(raw: str, types: set[str]) -> Any:
    """A GLM argument value read as the schema says: strings (and values of unknown type) stay text; other types
    are parsed as JSON, and a value that does not fit stays text rather than being lost."""
    # the template puts each value on its own line: one newline either side is layout
    raw = raw.removeprefix("\n").removesuffix("\n")
    if not types or types == {"string"}:
        return raw
    text = raw.strip()
    if text.lower() == "null":
        return None
    if "boolean" in types and text.lower() in ("true", "false"):
        return text.lower() == "true"
    try:
        value = json.loads(text)
    except ValueError:
        return raw
    if isinstance(value, bool):
        return raw  # a JSON true/false for a field that is not boolean
    if "integer" in types and isinstance(value, int):
        return value
    if "number" in types and isinstance(value, int | float):
        return int(value) if isinstance(value, float) and value.is_integer() else value
    if ("array" in types and isinstance(value, list)) or ("object" in types and isinstance(value, dict)):
        return value
    return raw  # JSON, but not of a type the schema allows: keep the text


def parse_call(body: str, tools: Sequence[Tool] | None) -> ToolCall | None:
    """A call's text between ``<tool_call>`` and ``</tool_call>``; None when it is not a well-formed call."""
    m = _ARG.search(body)
    name = (body[: m.start()] if m else body).strip()
    if not name or any(c in name for c in "<>\n"):
        return None
    pairs = list(_ARG.finditer(body))
    # between and after the pairs only whitespace may stand: anything else is a malformed call
    pos = m.start() if m else len(body)
    for pair in pairs:
        if body[pos : pair.start()].strip():
            return None
        pos = pair.end()
    if body[pos:].strip():
        return None
    tool = _tool(tools, name)
    args = {k.strip(): typed_value(v, _schema_types(tool, k.strip())) for k, v in (p.groups() for p in pairs)}
    return ToolCall(name=name, arguments=args)


def _tool(tools: Sequence[Tool] | None, name: str) -> Mapping[str, Any] | None:
    for t in tools or ():
        fn = t.get("function")
        if isinstance(fn, Mapping) and fn.get("name") == name:
            return fn
    return None


def _complete(call: ToolCall, tools: Sequence[Tool] | None) -> bool:
    """Whether a call cut off before ``</tool_call>`` may still be made: only a declared tool with every required
    argument (a truncated value must not become a real call)."""
    tool = _tool(tools, call.name)
    if tool is None:
        return False
    params = tool.get("parameters") or {}
    required = params.get("required") if isinstance(params, Mapping) else None
    return all(r in call.arguments for r in required or ())


class GLMParser:
    """A streaming state machine over GLM's tags. Whitespace around thinking and calls is trimmed (as Ollama does),
    so trailing whitespace is held back until the next visible character; the result is the same however the text
    is split."""

    has_tools = True
    has_thinking = True

    def __init__(self, prompt_opens_thinking: bool = False) -> None:
        self._prompt_opens = prompt_opens_thinking  # GLM-4.7's prompt ends with <think> when thinking is on
        self._state = _State.START
        self._after_start = _State.CONTENT
        self._buf = ""
        self._skip_ws = False
        self._tools: Sequence[Tool] | None = None

    def init(self, tools: Sequence[Tool] | None, last: Message | None, think: ThinkValue) -> Sequence[Tool] | None:
        self._tools, self._buf, self._skip_ws = tools, "", False
        self._state = _State.START
        prefill = last is not None and last.get("role") == "assistant" and bool(last.get("content"))
        # unset think means on for GLM-4.7, as in its template
        opened = self._prompt_opens and not prefill and (think is None or think_enabled(think))
        self._after_start = _State.THINKING if opened else _State.CONTENT
        return tools

    def add(self, text: str, done: bool) -> Parsed:
        self._buf += text
        out = Parsed()
        while self._step(out):
            pass
        if done:
            self._flush(out)
        return out

    def _step(self, out: Parsed) -> bool:
        """Consume what is certain; True when the state changed and the buffer should be looked at again."""
        if self._skip_ws:
            self._buf = self._buf.lstrip()
            if not self._buf:
                return False
            self._skip_ws = False
        buf = self._buf
        if not buf:
            return False
        st = self._state
        if st is _State.START:
            head = buf.lstrip()
            if head.startswith(THINK_OPEN):
                self._buf, self._state, self._skip_ws = head[len(THINK_OPEN) :], _State.THINKING, True
                return True
            if not head or THINK_OPEN.startswith(head):
                return False
            self._state = self._after_start
            self._skip_ws = self._state is _State.THINKING
            return True
        if st is _State.THINKING:
            i = buf.find(THINK_CLOSE)
            if i != -1:
                out.thinking += buf[:i].rstrip()
                self._buf, self._state, self._skip_ws = buf[i + len(THINK_CLOSE) :], _State.CONTENT, True
                return True
            sure = buf[: len(buf) - _partial_suffix(buf, THINK_CLOSE)].rstrip()
            out.thinking += sure
            self._buf = buf[len(sure) :]
            return False
        if st is _State.CONTENT:
            i = buf.find(CALL_OPEN)
            if i != -1:
                out.content += buf[:i].rstrip()
                self._buf, self._state, self._skip_ws = buf[i + len(CALL_OPEN) :], _State.CALL, True
                return True
            sure = buf[: len(buf) - _partial_suffix(buf, CALL_OPEN)].rstrip()
            out.content += sure
            self._buf = buf[len(sure) :]
            return False
        # CALL: calls are not streamed, wait for the closing tag
        i = buf.find(CALL_CLOSE)
        if i == -1:
            return False
        call = parse_call(buf[:i], self._tools)
        if call is not None:
            out.calls.append(call)
        else:
            out.content += CALL_OPEN + buf[: i + len(CALL_CLOSE)]  # not a call: nothing is lost
        self._buf, self._state, self._skip_ws = buf[i + len(CALL_CLOSE) :], _State.CONTENT, True
        return True

    def _flush(self, out: Parsed) -> None:
        """The end of the output: what was held back is given out as what it was."""
        buf, st = self._buf, self._state
        self._buf = ""
        if st is _State.START:
            st = self._after_start
        if st is _State.THINKING:
            out.thinking += buf
        elif st is _State.CONTENT:
            out.content += buf
        else:
            # a stop may cut the closing tag off; a complete call to a declared tool still counts
            body = buf[: len(buf) - _partial_suffix(buf, CALL_CLOSE)]
            call = parse_call(body, self._tools)
            if call is not None and _complete(call, self._tools):
                out.calls.append(call)
            else:
                out.content += CALL_OPEN + buf


@register("glm-4.6", "glm-4.5")
class GLM46Parser(GLMParser):
    """GLM-4.5/4.6: the model writes ``<think>`` itself when it thinks."""


@register("glm-4.7")
class GLM47Parser(GLMParser):
    """GLM-4.7: the prompt ends with ``<think>`` when thinking is on, so output starts inside it."""

    def __init__(self) -> None:
        super().__init__(prompt_opens_thinking=True)
