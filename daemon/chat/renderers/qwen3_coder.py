"""Qwen3-Coder's prompt format (``RENDERER qwen3-coder``): ChatML turns, tools listed as XML, XML tool calls."""

from __future__ import annotations

from collections.abc import Sequence

from daemon.chat.renderers.base import check_roles, compact_json, function_of, register
from daemon.chat.types import JSONObject, JSONValue, Message, ThinkValue, Tool

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


def scalar_text(value: JSONValue) -> str:
    """A tool-call argument as a parameter body: strings bare, containers as JSON, scalars as JSON literals."""
    if isinstance(value, str):
        return value
    return compact_json(value)


def _extra_keys(obj: JSONObject, handled: tuple[str, ...]) -> str:
    # Every other schema key becomes its own tag, in the order given (the reference template iterates the dict).
    out = []
    for key, value in obj.items():
        if key in handled or value is None:
            continue
        body = compact_json(value) if isinstance(value, dict | list) else scalar_text(value)
        out.append(f"\n<{key}>{body}</{key}>")
    return "".join(out)


def _type_text(tp: JSONValue) -> str:
    if isinstance(tp, list):
        return str(tp[0]) if len(tp) == 1 else compact_json(tp)
    return str(tp)


def _object(value: JSONValue | None) -> JSONObject:
    return value if isinstance(value, dict) else {}


def _tool_xml(tool: Tool) -> str:
    fn = function_of(tool)
    parts = ["\n<function>\n<name>" + str(fn["name"]) + "</name>"]
    if fn.get("description"):
        parts.append("\n<description>" + str(fn["description"]) + "</description>")
    parts.append("\n<parameters>")
    params = _object(fn.get("parameters"))
    for name, value in _object(params.get("properties")).items():
        prop = _object(value)
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


def xml_call(name: str, args: JSONObject) -> str:
    """One call in the XML form, without surrounding newlines: ``<tool_call>\\n<function=NAME>…</tool_call>``."""
    body = "".join(f"\n<parameter={k}>\n{scalar_text(v)}\n</parameter>" for k, v in args.items())
    return f"<tool_call>\n<function={name}>{body}\n</function>\n</tool_call>"


def tool_response(messages: Sequence[Message], i: int, content: str) -> str:
    """A tool result; consecutive results share one user turn, each in its own ``<tool_response>``."""
    out = ""
    if i == 0 or messages[i - 1].role != "tool":
        out += IM_START + "user"
    out += "\n<tool_response>\n" + content + "\n</tool_response>"
    if i == len(messages) - 1 or messages[i + 1].role != "tool":
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
            if m.role != "system":
                rest.append(m)
            elif not system:
                system = m.content
        out: list[str] = []
        if system or tools:
            out.append(IM_START + "system\n" + (system or DEFAULT_SYSTEM))
            if tools:
                out.append("\n\n# Tools\n\nYou have access to the following functions:\n\n<tools>")
                out.extend(_tool_xml(t) for t in tools)
                out.append("\n</tools>" + XML_CALL_INSTRUCTIONS)
            out.append(IM_END + "\n")
        for i, m in enumerate(rest):
            role = m.role
            last = i == len(rest) - 1
            prefill = last and role == "assistant"
            content = m.content
            if role == "assistant" and m.tool_calls:
                out.append(IM_START + "assistant\n" + (content + "\n" if content else ""))
                out.extend("\n" + xml_call(c.name, c.arguments) for c in m.tool_calls)
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
