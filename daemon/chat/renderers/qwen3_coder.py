"""Qwen3-Coder's prompt format (``RENDERER qwen3-coder``): ChatML turns, tools listed as XML, XML tool calls."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from daemon.chat.renderers import register
from daemon.chat.renderers.base import Message, Tool
from daemon.chat.types import ThinkValue
from errors import InvalidRequest

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
ROLES = ("system", "user", "assistant", "tool")
DEFAULT_SYSTEM = "You are Qwen, a helpful AI assistant that can interact with a computer to solve tasks."

# The calling instructions the published template appends after the tool list (shared with Qwen 3.5).
XML_CALL_INSTRUCTIONS = """

If you choose to call a function ONLY reply in the following format with NO suffix:

<tool_call>
<function=example_function_name>
<parameter=example_parameter_1>
value_1
</parameter>
<parameter=example_parameter_2>
This is the value for the second parameter
that can span
multiple lines
</parameter>
</function>
</tool_call>

<IMPORTANT>
Reminder:
- Function calls MUST follow the specified format: an inner <function=...></function> block must be nested within \
<tool_call></tool_call> XML tags
- Required parameters MUST be specified
- You may provide optional reasoning for your function call in natural language BEFORE the function call, but NOT after
- If there is no function call available, answer the question like normal with your current knowledge and do not tell \
the user about function calls
</IMPORTANT>"""


def compact_json(value: Any) -> str:
    """JSON without spaces, non-ASCII kept as is (what Ollama's renderer writes for nested values)."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def text(message: Message, key: str = "content") -> str:
    """A message's string field, empty when absent or null."""
    value = message.get(key)
    return value if isinstance(value, str) else ""


def check_roles(messages: Sequence[Message], roles: Sequence[str], family: str) -> None:
    """Raise ``InvalidRequest`` for a role the family has no turn for."""
    for m in messages:
        if m.get("role") not in roles:
            raise InvalidRequest(f"the {family} renderer cannot render a message with role {m.get('role')!r}")


def function_of(tool: Tool) -> Mapping[str, Any]:
    """The ``function`` part of an Ollama/OpenAI tool."""
    fn = tool.get("function")
    if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
        raise InvalidRequest("a tool needs a function with a name")
    return fn


def calls_of(message: Message) -> list[tuple[str, Mapping[str, Any]]]:
    """A message's tool calls as (name, arguments) pairs."""
    out: list[tuple[str, Mapping[str, Any]]] = []
    for call in message.get("tool_calls") or ():
        fn = call.get("function") or {}
        args = fn.get("arguments") or {}
        if not isinstance(args, Mapping):
            raise InvalidRequest("tool call arguments must be an object")
        out.append((str(fn.get("name", "")), args))
    return out


def scalar_text(value: Any) -> str:
    """A tool-call argument as a parameter body: strings bare, containers as JSON, scalars as JSON literals."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping):
        return compact_json(dict(value))
    return compact_json(value) if value is None or isinstance(value, bool | int | float | list | tuple) else str(value)


def _extra_keys(obj: Mapping[str, Any], handled: tuple[str, ...]) -> str:
    # Every other schema key becomes its own tag, in the order given (the reference template iterates the dict).
    out = []
    for key, value in obj.items():
        if key in handled or value is None:
            continue
        body = compact_json(value) if isinstance(value, Mapping | list | tuple) else scalar_text(value)
        out.append(f"\n<{key}>{body}</{key}>")
    return "".join(out)


def _type_text(tp: Any) -> str:
    if isinstance(tp, list | tuple):
        return tp[0] if len(tp) == 1 else compact_json(list(tp))
    return str(tp)


def _tool_xml(tool: Tool) -> str:
    fn = function_of(tool)
    parts = ["\n<function>\n<name>" + fn["name"] + "</name>"]
    if fn.get("description"):
        parts.append("\n<description>" + str(fn["description"]) + "</description>")
    parts.append("\n<parameters>")
    params = fn.get("parameters") or {}
    for name, prop in (params.get("properties") or {}).items():
        parts.append("\n<parameter>\n<name>" + name + "</name>")
        if prop.get("type"):
            parts.append("\n<type>" + _type_text(prop["type"]) + "</type>")
        if prop.get("description"):
            parts.append("\n<description>" + str(prop["description"]) + "</description>")
        parts.append(_extra_keys(prop, ("type", "description")))
        parts.append("\n</parameter>")
    parts.append(_extra_keys(params, ("type", "properties")))
    parts.append("\n</parameters>\n</function>")
    return "".join(parts)


def xml_call(name: str, args: Mapping[str, Any]) -> str:
    """One call in the XML form, without surrounding newlines: ``<tool_call>\\n<function=NAME>…</tool_call>``."""
    body = "".join(f"\n<parameter={k}>\n{scalar_text(v)}\n</parameter>" for k, v in args.items())
    return f"<tool_call>\n<function={name}>{body}\n</function>\n</tool_call>"


def tool_response(messages: Sequence[Message], i: int, content: str) -> str:
    """A tool result; consecutive results share one user turn, each in its own ``<tool_response>``."""
    out = ""
    if i == 0 or messages[i - 1].get("role") != "tool":
        out += IM_START + "user"
    out += "\n<tool_response>\n" + content + "\n</tool_response>"
    if i == len(messages) - 1 or messages[i + 1].get("role") != "tool":
        out += IM_END + "\n"
    return out


@register("qwen3-coder")
class Qwen3CoderRenderer:
    """Qwen3-Coder: the first system message wins; with tools and no system message a default one is used."""

    def render(self, messages: Sequence[Message], tools: Sequence[Tool] | None, think: ThinkValue) -> str:
        check_roles(messages, ROLES, "qwen3-coder")
        system = ""
        rest: list[Message] = []
        for m in messages:
            if m.get("role") != "system":
                rest.append(m)
            elif not system:
                system = text(m)
        out: list[str] = []
        if system or tools:
            out.append(IM_START + "system\n" + (system or DEFAULT_SYSTEM))
            if tools:
                out.append("\n\n# Tools\n\nYou have access to the following functions:\n\n<tools>")
                out.extend(_tool_xml(t) for t in tools)
                out.append("\n</tools>" + XML_CALL_INSTRUCTIONS)
            out.append(IM_END + "\n")
        for i, m in enumerate(rest):
            role = m["role"]
            last = i == len(rest) - 1
            prefill = last and role == "assistant"
            content = text(m)
            calls = calls_of(m)
            if role == "assistant" and calls:
                out.append(IM_START + "assistant\n" + (content + "\n" if content else ""))
                out.extend("\n" + xml_call(name, args) for name, args in calls)
                out.append(IM_END + "\n")
            elif role == "assistant":
                out.append(IM_START + "assistant\n" + content + ("" if prefill else IM_END + "\n"))
            elif role == "tool":
                out.append(tool_response(rest, i, content))
            else:
                out.append(IM_START + role + "\n" + content + IM_END + "\n")
            if last and not prefill:
                out.append(IM_START + "assistant\n")
        return "".join(out)
