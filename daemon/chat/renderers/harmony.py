"""gpt-oss's Harmony prompt format (``RENDERER harmony``): ``<|start|>ROLE<|message|>…<|end|>`` messages with
channels (analysis, commentary, final), a system message with the date and reasoning level, and a developer message
with the instructions and the tools as a TypeScript-like ``namespace functions``."""

from __future__ import annotations

import datetime
import json
from collections.abc import Callable, Sequence

from daemon.chat.renderers.base import check_roles, compact_json, function_of, register
from daemon.chat.types import JSONValue, Message, ThinkValue, Tool

ROLES = ("system", "developer", "user", "assistant", "tool")
KNOWLEDGE_CUTOFF = "2024-06"


def today() -> datetime.date:
    """The date the system message gives; tests replace it (or pass ``clock`` to the renderer)."""
    return datetime.date.today()


def reasoning_level(think: ThinkValue) -> str:
    """gpt-oss always reasons; ``think`` only picks how much. Unset, true and false all mean the default, medium."""
    if isinstance(think, str) and think in ("low", "medium", "high"):
        return think
    return "high" if think == "max" else "medium"


def _ts_type(schema: JSONValue) -> str:
    # The TypeScript-like type harmony uses for a JSON-schema property.
    if not isinstance(schema, dict):
        return "any"
    enum = schema.get("enum")
    if enum:
        values = enum if isinstance(enum, list | str | dict) else [enum]  # iterated as given, a malformed one too
        return " | ".join(json.dumps(v, ensure_ascii=False) for v in values)
    any_of = schema.get("anyOf")
    if isinstance(any_of, list):
        return " | ".join(_ts_type(s) for s in any_of)
    tp = schema.get("type")
    if isinstance(tp, list):
        return " | ".join(_ts_type({**schema, "type": t}) for t in tp)
    if tp == "array":
        inner = _ts_type(schema["items"]) if "items" in schema else "any"
        return f"({inner})[]" if " | " in inner else inner + "[]"
    return {"string": "string", "number": "number", "integer": "number", "boolean": "boolean", "null": "null"}.get(
        str(tp), "object" if tp == "object" else "any"
    )


def _tool_ts(tool: Tool) -> str:
    fn = function_of(tool)
    out = f"// {fn['description']}\n" if fn.get("description") else ""
    params = fn.get("parameters")
    props = params.get("properties") if isinstance(params, dict) else None
    if not isinstance(props, dict) or not props:
        return out + f"type {fn['name']} = () => any;\n\n"
    required = params.get("required") if isinstance(params, dict) else None
    names = set(required) if isinstance(required, list) else set()
    out += f"type {fn['name']} = (_: {{\n"
    for name, prop in props.items():
        if isinstance(prop, dict) and prop.get("description"):
            out += f"// {prop['description']}\n"
        line = f"{name}{'' if name in names else '?'}: {_ts_type(prop)},"
        if isinstance(prop, dict) and "default" in prop:
            line += f" // default: {prop['default']}"
        out += line + "\n"
    return out + "}) => any;\n\n"


def _tool_names(messages: Sequence[Message]) -> list[str]:
    # The function each tool result answers: named by the message, by its call id, or else by position after the
    # assistant's calls (clients often send neither).
    names: list[str] = []
    by_id: dict[str, str] = {}
    pending: list[str] = []
    for m in messages:
        if m.role == "assistant":
            pending = []
            for call in m.tool_calls:
                pending.append(call.name)
                if call.id:
                    by_id[call.id] = call.name
            names.append("")
        elif m.role == "tool":
            name = m.tool_name or by_id.get(m.tool_call_id, "") or (pending[0] if pending else "")
            if pending:
                pending.pop(0)
            names.append(name)
        else:
            names.append("")
    return names


@register("harmony")
class HarmonyRenderer:
    """gpt-oss. System and developer messages become the developer message's instructions; thinking is kept for the
    assistant turns after the last user message (earlier chains of thought are dropped, as the format asks)."""

    def __init__(self, clock: Callable[[], datetime.date] | None = None) -> None:
        self.clock = clock

    def render(self, messages: Sequence[Message], tools: Sequence[Tool] | None, think: ThinkValue) -> str:
        check_roles(messages, ROLES, "harmony")
        date = (self.clock or today)()
        out = [
            "<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n"
            f"Knowledge cutoff: {KNOWLEDGE_CUTOFF}\nCurrent date: {date.isoformat()}\n\n"
            f"Reasoning: {reasoning_level(think)}\n\n"
            "# Valid channels: analysis, commentary, final. Channel must be included for every message."
        ]
        if tools:
            out.append("\nCalls to these tools must go to the commentary channel: 'functions'.")
        out.append("<|end|>")
        instructions = "\n\n".join(m.content for m in messages if m.role in ("system", "developer") and m.content)
        if instructions or tools:
            sections = []
            if instructions:
                sections.append("# Instructions\n\n" + instructions)
            if tools:
                body = "".join(_tool_ts(t) for t in tools)
                sections.append(
                    "# Tools\n\n## functions\n\nnamespace functions {\n\n" + body + "} // namespace functions"
                )
            out.append("<|start|>developer<|message|>" + "\n\n".join(sections) + "<|end|>")
        last_user = max((i for i, m in enumerate(messages) if m.role == "user"), default=-1)
        names = _tool_names(messages)
        for i, m in enumerate(messages):
            role = m.role
            last = i == len(messages) - 1
            if role == "user":
                out.append("<|start|>user<|message|>" + m.content + "<|end|>")
            elif role == "tool":
                out.append(
                    f"<|start|>functions.{names[i]} to=assistant<|channel|>commentary<|message|>{m.content}<|end|>"
                )
            elif role == "assistant":
                out.append(self._assistant(m, i > last_user, last))
        tail = messages[-1] if messages else None
        if not (
            tail is not None and tail.role == "assistant" and not tail.tool_calls and (tail.content or tail.thinking)
        ):
            out.append("<|start|>assistant")
        return "".join(out)

    @staticmethod
    def _assistant(m: Message, current: bool, last: bool) -> str:
        thinking, content, calls = m.thinking, m.content, m.tool_calls
        # A last assistant message without calls is a prefill: its last part is left open for the model.
        prefill = last and not calls
        parts: list[tuple[str, str]] = []
        if thinking and (current or prefill):
            parts.append(("<|start|>assistant<|channel|>analysis<|message|>", thinking))
        if content:
            parts.append(("<|start|>assistant<|channel|>final<|message|>", content))
        out = ""
        for k, (head, body) in enumerate(parts):
            out += head + body + ("" if prefill and k == len(parts) - 1 else "<|end|>")
        for call in calls:
            out += (
                f"<|start|>assistant<|channel|>commentary to=functions.{call.name} <|constrain|>json<|message|>"
                f"{compact_json(call.arguments)}<|call|>"
            )
        return out
