"""``glm-4.5``, ``glm-4.6`` and ``glm-4.7``: Zhipu's GLM output, thinking in ``<think>`` ... ``</think>`` and tool calls
as ``<tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value>...</tool_call>``, each value typed by the declared
tool's parameter schema (GLM writes strings bare and everything else as JSON)."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

from daemon.chat.parsers.base import register
from daemon.chat.parsers.text import ThinkingFirst, assistant_prefill, give_call, hold_back
from daemon.chat.schema import declared_function, declared_properties
from daemon.chat.types import JSONObject, Message, Parsed, ThinkValue, Tool, ToolCall, think_enabled

CALL_OPEN = "<tool_call>"
CALL_CLOSE = "</tool_call>"
_ARG = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)


def _schema_types(tool: JSONObject | None, key: str) -> set[str]:
    """The JSON types the declared tool allows for argument ``key`` (``anyOf`` included); empty when unknown.

    Not qwen3-coder's ``_types``: GLM adds the property's own ``type`` to its ``anyOf`` branches' (one level)."""
    prop = declared_properties(tool).get(key)
    if not isinstance(prop, dict):
        return set()
    any_of = prop.get("anyOf")
    types: set[str] = set()
    for p in [prop, *(any_of if isinstance(any_of, list) else ())]:
        t = p.get("type") if isinstance(p, dict) else None
        types.update([t] if isinstance(t, str) else (x for x in t if isinstance(x, str)) if isinstance(t, list) else ())
    return types


def typed_value(raw: str, types: set[str]) -> Any:
    """A GLM argument value read as the schema says: strings (and values of unknown type) stay text; other types
    are parsed as JSON, and a value that does not fit stays text rather than being lost. (qwen3-coder's ``convert``
    differs in what ``null`` and a bad boolean become, so the two are not merged.)"""
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
    tool = declared_function(tools, name)
    args = {k.strip(): typed_value(v, _schema_types(tool, k.strip())) for k, v in (p.groups() for p in pairs)}
    return ToolCall(name=name, arguments=args)


def _complete(call: ToolCall, tools: Sequence[Tool] | None) -> bool:
    """Whether a call cut off before ``</tool_call>`` may still be made: only a declared tool with every required
    argument (a truncated value must not become a real call)."""
    tool = declared_function(tools, call.name)
    if tool is None:
        return False
    params = tool.get("parameters") or {}
    required = params.get("required") if isinstance(params, dict) else None
    return all(isinstance(r, str) and r in call.arguments for r in required) if isinstance(required, list) else True


class GLMParser(ThinkingFirst):
    """A streaming state machine over GLM's tags. Whitespace around thinking and calls is trimmed (as Ollama does),
    so trailing whitespace is held back until the next visible character; the result is the same however the text
    is split."""

    has_tools = True
    has_thinking = True

    def __init__(self, prompt_opens_thinking: bool = False) -> None:
        self._prompt_opens = prompt_opens_thinking  # GLM-4.7's prompt ends with <think> when thinking is on
        self._in_call = False
        self._tools: Sequence[Tool] | None = None

    def init(self, tools: Sequence[Tool] | None, last: Message | None, think: ThinkValue) -> Sequence[Tool] | None:
        self._tools, self._in_call = tools, False
        # unset think means on for GLM-4.7, as in its template; the model may write <think> itself in any case
        opened = self._prompt_opens and not assistant_prefill(last) and (think is None or think_enabled(think))
        self._begin(True, opened)
        return tools

    def _step_answer(self, out: Parsed) -> bool:
        if not self._in_call:
            text, tag = self._cut((CALL_OPEN,))
            out.content += text
            if tag:
                self._in_call, self._skip_ws = True, True
            return bool(tag)
        # calls are not streamed, wait for the closing tag
        buf = self._buf
        i = buf.find(CALL_CLOSE)
        if i == -1:
            return False
        call = parse_call(buf[:i], self._tools)
        give_call(out, call, CALL_OPEN + buf[: i + len(CALL_CLOSE)])  # not a call: nothing is lost
        self._buf, self._in_call, self._skip_ws = buf[i + len(CALL_CLOSE) :], False, True
        return True

    def _flush_answer(self, out: Parsed) -> None:
        buf, self._buf = self._buf, ""
        if not self._in_call:
            out.content += buf
            return
        # a stop may cut the closing tag off; a complete call to a declared tool still counts
        call = parse_call(hold_back(buf, (CALL_CLOSE,), trim=False)[0], self._tools)
        if call is not None and not _complete(call, self._tools):
            call = None
        give_call(out, call, CALL_OPEN + buf)


@register("glm-4.6", "glm-4.5")
class GLM46Parser(GLMParser):
    """GLM-4.5/4.6: the model writes ``<think>`` itself when it thinks."""


@register("glm-4.7")
class GLM47Parser(GLMParser):
    """GLM-4.7: the prompt ends with ``<think>`` when thinking is on, so output starts inside it."""

    def __init__(self) -> None:
        super().__init__(prompt_opens_thinking=True)
