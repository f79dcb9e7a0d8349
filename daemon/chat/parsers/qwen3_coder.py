"""``qwen3-coder`` and ``qwen3.5``: Qwen's XML tool calls,

    <tool_call>
    <function=NAME>
    <parameter=KEY>
    VALUE
    </parameter>
    </function>
    </tool_call>

with each value converted by the type the request's tool declares for it (strings stay strings; integers, numbers,
booleans, arrays and objects are parsed, falling back to the text when they do not parse). ``qwen3.5`` is the
same call format behind Qwen3's ``<think>…</think>`` reasoning, which its template opens by default."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

from daemon.chat.parsers.base import register
from daemon.chat.parsers.qwen3 import Qwen3Parser
from daemon.chat.schema import declared_function, declared_properties
from daemon.chat.types import Tool, ToolCall

_FUNCTION = re.compile(r"<function=([^>]+)>")
_PARAMETER = re.compile(r"<parameter=([^>]+)>")
_PARAMETER_CLOSE = "</parameter>"
_FUNCTION_CLOSE = "</function>"
_INTEGER = re.compile(r"[+-]?[0-9]+")
_NUMBER = re.compile(r"[+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")


class Qwen3CoderParser(Qwen3Parser):
    """Qwen3's scanning with XML call bodies."""

    def parse_call(self, body: str) -> ToolCall | None:
        return xml_call(body, self._tools)


def xml_call(body: str, tools: Sequence[Tool]) -> ToolCall | None:
    """Parse ``<function=NAME><parameter=KEY>VALUE</parameter>…</function>``; None when there is no function.

    Lenient where models slip: a parameter missing its ``</parameter>`` ends at the next parameter or at
    ``</function>``; text outside the parameters is ignored."""
    found = _FUNCTION.search(body)
    if found is None:
        return None
    name = found.group(1).strip()
    if not name:
        return None
    rest = body[found.end() :]
    end = rest.rfind(_FUNCTION_CLOSE)
    if end != -1:
        rest = rest[:end]
    properties = declared_properties(declared_function(tools, name))
    args: dict[str, Any] = {}
    pos = 0
    while (param := _PARAMETER.search(rest, pos)) is not None:
        start = param.end()
        close = rest.find(_PARAMETER_CLOSE, start)
        following = _PARAMETER.search(rest, start)
        if close == -1 or (following is not None and following.start() < close):
            stop = following.start() if following is not None else len(rest)
            pos = stop
        else:
            stop = close
            pos = close + len(_PARAMETER_CLOSE)
        key = param.group(1).strip()
        # the template puts the value on its own lines: one newline on each side is layout, nothing more
        value = rest[start:stop].removeprefix("\n").removesuffix("\n")
        args[key] = convert(value, _types(properties.get(key)))
    return ToolCall(name=name, arguments=args)


def _types(schema: Any) -> list[str]:
    """The JSON types a property allows (a type, a list of types, or the union of an ``anyOf``)."""
    if not isinstance(schema, Mapping):
        return []
    if isinstance(schema.get("anyOf"), list):
        out: list[str] = []
        for alt in schema["anyOf"]:
            out.extend(_types(alt))
        return out
    kind = schema.get("type")
    if isinstance(kind, str):
        return [kind]
    if isinstance(kind, list):
        return [k for k in kind if isinstance(k, str)]
    return []


def convert(raw: str, types: list[str]) -> Any:
    """Convert a parameter's text by its declared types, trying the most specific first (boolean, integer, number,
    array, object, then string). ``null`` is None whatever the type. When the only declared type does not parse, the
    text is kept, except a lone boolean type, which reads as false (Ollama does the same).

    GLM's ``typed_value`` looks alike but is not the same rule and is kept apart: there ``null`` is text for a
    string field, a lone boolean type keeps text that is not true/false, and numbers are read as JSON."""
    if raw.lower() == "null":
        return None
    if not types:
        return raw
    only = len(types) == 1
    if "boolean" in types:
        if raw.lower() in ("true", "false"):
            return raw.lower() == "true"
        if only:
            return False
    if "integer" in types:
        if _INTEGER.fullmatch(raw):
            return int(raw)
        if only:
            return raw
    if "number" in types:
        if _NUMBER.fullmatch(raw):
            number = float(raw)
            if math.isfinite(number):
                return int(number) if number.is_integer() else number
        if only:
            return raw
    for kind, shape in (("array", list), ("object", dict)):
        if kind in types:
            value: Any
            try:
                value = json.loads(raw)
            except (ValueError, RecursionError):
                value = None
            if isinstance(value, shape):
                return value
            if only:
                return raw
    return raw


register("qwen3-coder")(Qwen3CoderParser)
register("qwen3.5", has_thinking=True, default_thinking=True)(Qwen3CoderParser)
