"""Gemma 4's prompt format (``RENDERER gemma4``, ``gemma4-small``, ``gemma4-large``): ``<|turn>ROLE … <turn|>`` turns,
tools declared in the system turn in Gemma's own object notation with ``<|"|>`` string quotes, calls and their
results folded into the model turn."""

from __future__ import annotations

from collections.abc import Sequence

from daemon.chat.renderers.base import check_roles, function_of, register
from daemon.chat.types import JSONObject, JSONValue, Message, ThinkValue, Tool, ToolCall, think_enabled

Q = '<|"|>'  # Gemma 4's string delimiter
ROLES = ("system", "developer", "user", "assistant", "tool")
_STANDARD_KEYS = ("description", "type", "properties", "required", "nullable")


def _number(value: int | float) -> str:
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return repr(value)


def arg_value(value: JSONValue) -> str:
    """An argument value in Gemma's notation: quoted strings, bare keys in sorted order."""
    if value is None:
        return "null"
    if isinstance(value, str):
        return Q + value + Q
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return _number(value)
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{arg_value(value[k])}" for k in sorted(value)) + "}"
    if isinstance(value, list):
        return "[" + ",".join(arg_value(v) for v in value) + "]"
    return str(value)


def _schema_value(value: JSONValue) -> str:
    # Like arg_value, but object keys are quoted too (how the template writes leftover schema keywords).
    if isinstance(value, dict):
        return "{" + ",".join(f"{Q}{k}{Q}:{_schema_value(value[k])}" for k in sorted(value)) + "}"
    if isinstance(value, list):
        return "[" + ",".join(_schema_value(v) for v in value) + "]"
    return arg_value(value)


def _type_names(value: JSONValue) -> list[str]:
    if isinstance(value, str):
        return [value.upper()]
    if isinstance(value, list):
        return [v.upper() for v in value if isinstance(v, str)]
    return []


def _quoted_list(items: JSONValue | Sequence[str]) -> str:
    return "[" + ",".join(Q + str(v) + Q for v in (items if isinstance(items, list | str | dict) else ())) + "]"


def _type_field(names: list[str]) -> str:
    return "type:" + (Q + names[0] + Q if len(names) == 1 else _quoted_list(names))


def _top_level(prop: JSONObject) -> JSONObject:
    # The template stringifies a multi-type union of a declared property as a Python list of upper-case names;
    # Ollama matches that, and so do we.
    out = dict(prop)
    tp = prop.get("type")
    if isinstance(tp, list):
        out["type"] = tp[0] if len(tp) == 1 else "[" + ", ".join(f"'{str(t).upper()}'" for t in tp) + "]"
    props = prop.get("properties")
    if isinstance(props, dict):
        out["properties"] = {k: _top_level(v) if isinstance(v, dict) else v for k, v in props.items()}
    return out


def _items_spec(items: JSONObject) -> str:
    parts = []
    for key in sorted(items):
        value = items[key]
        if value is None:
            continue
        if key == "properties":
            parts.append("properties:{" + (_properties(value) if isinstance(value, dict) else "") + "}")
        elif key == "required":
            wanted = value if isinstance(value, list | str | dict) else ()
            parts.append("required:" + _quoted_list([v for v in wanted if isinstance(v, str)]))
        elif key == "type":
            names = _type_names(value)
            if names:
                parts.append(_type_field(names))
        else:
            parts.append(key + ":" + _schema_value(value))
    return ",".join(parts)


def _properties(props: JSONObject) -> str:
    entries = []
    for name in sorted(props):
        prop = props[name]
        if name in _STANDARD_KEYS or not isinstance(prop, dict):
            continue
        fields = []
        description = prop.get("description")
        if isinstance(description, str) and description:
            fields.append("description:" + Q + description + Q)
        names = _type_names(prop.get("type"))
        first = names[0] if names else ""
        items = prop.get("items")
        if first == "STRING" and prop.get("enum"):
            fields.append("enum:" + _quoted_list(prop["enum"]))
        elif first == "ARRAY" and isinstance(items, dict) and items:
            fields.append("items:{" + _items_spec(items) + "}")
        if prop.get("nullable") is True:
            fields.append("nullable:true")
        if first == "OBJECT":
            nested = prop.get("properties")
            fields.append("properties:{" + _properties(nested if isinstance(nested, dict) else prop) + "}")
            given = prop.get("required")
            required = [v for v in (given if isinstance(given, list | str | dict) else ()) if isinstance(v, str)]
            if required:
                fields.append("required:" + _quoted_list(required))
        if names:
            fields.append(_type_field(names))
        entries.append(name + ":{" + ",".join(fields) + "}")
    return ",".join(entries)


def declaration(tool: Tool) -> str:
    """One tool as ``<|tool>declaration:NAME{description:…,parameters:{…}}<tool|>``."""
    fn = function_of(tool)
    out = f"<|tool>declaration:{fn['name']}{{description:{Q}{fn.get('description') or ''}{Q}"
    params = fn.get("parameters")
    if isinstance(params, dict) and ("properties" in params or params.get("type")):
        fields = []
        props = params.get("properties")
        if isinstance(props, dict) and props:
            tops: JSONObject = {k: _top_level(v) if isinstance(v, dict) else v for k, v in props.items()}
            fields.append("properties:{" + _properties(tops) + "}")
        if params.get("required"):
            fields.append("required:" + _quoted_list(params["required"]))
        if params.get("type"):
            fields.append("type:" + Q + str(params["type"]).upper() + Q)
        out += ",parameters:{" + ",".join(fields) + "}"
    return out + "}<tool|>"


def _strip_thinking(content: str) -> str:
    # Thought blocks left in a past answer's content are not shown back to the model.
    out = []
    while True:
        start = content.find("<|channel>")
        if start == -1:
            out.append(content)
            break
        out.append(content[:start])
        end = content.find("<channel|>", start)
        if end == -1:
            break
        content = content[end + len("<channel|>") :]
    return "".join(out).strip()


def _response_name(message: Message, calls: Sequence[ToolCall]) -> str:
    name = message.tool_name or "unknown"
    call_id = message.tool_call_id
    for call in calls:
        if call_id and call.id == call_id:
            return call.name
    return name


@register("gemma4", "gemma4-small")
@register("gemma4-large", empty_block_on_nothink=True)
class Gemma4Renderer:
    """Gemma 4: ``think`` adds ``<|think|>`` to the system turn; tool results follow their call in the model turn."""

    def __init__(self, empty_block_on_nothink: bool = False) -> None:
        self.empty_block_on_nothink = empty_block_on_nothink

    def render(self, messages: Sequence[Message], tools: Sequence[Tool] | None, think: ThinkValue) -> str:
        check_roles(messages, ROLES, "gemma4")
        thinking = think_enabled(think)
        out = ["<bos>"]
        has_system = bool(messages) and messages[0].role in ("system", "developer")
        loop = list(messages[1:] if has_system else messages)
        if has_system or tools or thinking:
            out.append("<|turn>system\n" + ("<|think|>\n" if thinking else ""))
            out.append(messages[0].content.strip() if has_system else "")
            out.extend(declaration(t) for t in tools or ())
            out.append("<turn|>\n")
        last_user = max((i for i, m in enumerate(loop) if m.role == "user"), default=-1)
        prev_type = ""
        prev_role = ""
        for i, m in enumerate(loop):
            role = m.role
            if role == "tool":
                continue
            prev_type = ""
            turn = "model" if role == "assistant" else role
            if not (role == "assistant" and prev_role == "assistant"):
                out.append(f"<|turn>{turn}\n")
            if role == "assistant" and m.thinking and i > last_user:
                out.append("<|channel>thought\n" + m.thinking + "\n<channel|>")
            calls = m.tool_calls
            for call in calls:
                args = call.arguments
                body = ",".join(f"{k}:{arg_value(args[k])}" for k in sorted(args))
                out.append(f"<|tool_call>call:{call.name}{{{body}}}<tool_call|>")
                prev_type = "tool_call"
            answered = False
            if calls:
                k = i + 1
                while k < len(loop) and loop[k].role == "tool":
                    name = _response_name(loop[k], calls)
                    out.append(f"<|tool_response>response:{name}{{value:{arg_value(loop[k].content)}}}<tool_response|>")
                    answered = True
                    prev_type = "tool_response"
                    k += 1
            content = m.content
            if role == "assistant":
                content = _strip_thinking(content) if content else ""
            else:
                content = content.strip()
            out.append(content)
            nxt = next((n.role for n in loop[i + 1 :] if n.role != "tool"), "")
            if role == "assistant" and not calls and not nxt:
                # A last plain assistant message is a prefill: left open for the model to continue.
                return "".join(out)
            continues = role == "assistant" and nxt == "assistant" and (not calls or answered)
            if prev_type == "tool_call" and not answered:
                out.append("<|tool_response>")
            elif not continues and not (answered and not content.strip() and nxt == ""):
                out.append("<turn|>\n")
            prev_role = role
        if prev_type not in ("tool_response", "tool_call"):
            out.append("<|turn>model\n")
            if self.empty_block_on_nothink and not thinking:
                out.append("<|channel>thought\n<channel|>")
        elif prev_type == "tool_response" and thinking:
            out.append("<|channel>thought\n")
        return "".join(out)
