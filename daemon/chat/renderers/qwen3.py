"""Qwen 3.5 and Qwen3-VL prompt formats (``RENDERER qwen3.5``, ``qwen3-vl-instruct``, ``qwen3-vl-thinking``):
ChatML turns, a JSON ``<tools>`` block in the system turn, ``<think>`` blocks on the assistant turns of the current
query and in the generation prompt."""

from __future__ import annotations

import json
from collections.abc import Sequence

from daemon.chat.renderers.base import check_roles, register
from daemon.chat.renderers.qwen3_coder import (
    IM_END,
    IM_START,
    ROLES,
    XML_CALL_INSTRUCTIONS,
    tool_response,
    xml_call,
)
from daemon.chat.types import JSONValue, Message, ThinkValue, Tool, think_enabled


def spaced_json(value: JSONValue) -> str:
    """JSON with a space after ``:`` and ``,`` (Python's default, which the published templates' ``tojson`` gives)."""
    return json.dumps(value, ensure_ascii=False)


def _last_query_index(messages: Sequence[Message], strip: bool) -> int:
    # The last user turn that is a real query, not a tool result a client sent back as a user message: assistant
    # turns after it belong to the current query and keep their thinking.
    for i in range(len(messages) - 1, -1, -1):
        m = messages[i]
        if m.role == "user":
            content = m.content.strip() if strip else m.content
            if not (content.startswith("<tool_response>") and content.endswith("</tool_response>")):
                return i
    return len(messages) - 1


def _split_reasoning(content: str, thinking: str) -> tuple[str, str]:
    # Thinking comes from the message's own field, or else from a <think>…</think> block left in its content.
    if thinking:
        return thinking.strip(), content
    reasoning = ""
    close = content.find("</think>")
    if close != -1:
        before = content[:close]
        opened = before.rfind("<think>")
        reasoning = before[opened + len("<think>") :] if opened != -1 else before
        content = content[close + len("</think>") :].lstrip("\n")
    return reasoning.strip(), content


@register("qwen3.5")
class Qwen35Renderer:
    """Qwen 3.5: thinks unless ``think`` is false, when the generation prompt carries an empty think block. Tools are
    listed as JSON but called in the XML form Qwen3-Coder uses."""

    def render(self, messages: Sequence[Message], tools: Sequence[Tool] | None, think: ThinkValue) -> str:
        check_roles(messages, ROLES, "qwen3.5")
        thinking = True if think is None else think_enabled(think)
        out: list[str] = []
        has_system = bool(messages) and messages[0].role == "system"
        system = messages[0].content.strip() if has_system else ""
        if tools:
            out.append(IM_START + "system\n# Tools\n\nYou have access to the following functions:\n\n<tools>")
            out.extend("\n" + spaced_json(t.spec) for t in tools)
            out.append("\n</tools>" + XML_CALL_INSTRUCTIONS)
            if system:
                out.append("\n\n" + system)
            out.append(IM_END + "\n")
        elif has_system:
            out.append(IM_START + "system\n" + system + IM_END + "\n")
        last_query = _last_query_index(messages, strip=True)
        for i, m in enumerate(messages):
            role = m.role
            content = m.content.strip()
            last = i == len(messages) - 1
            prefill = last and role == "assistant"
            if role == "user" or (role == "system" and i != 0):
                out.append(IM_START + role + "\n" + content + IM_END + "\n")
            elif role == "assistant":
                keep_think = thinking and i > last_query
                if keep_think:
                    reasoning, content = _split_reasoning(content, m.thinking)
                    out.append(IM_START + "assistant\n<think>\n" + reasoning + "\n</think>\n\n" + content)
                else:
                    _, content = _split_reasoning(content, "")
                    out.append(IM_START + "assistant\n" + content)
                for j, call in enumerate(m.tool_calls):
                    if j > 0:
                        out.append("\n")
                    elif content.strip():
                        out.append("\n\n")
                    out.append(xml_call(call.name, call.arguments))
                if not prefill:
                    out.append(IM_END + "\n")
            elif role == "tool":
                out.append(tool_response(messages, i, content))
            if last and not prefill:
                out.append(IM_START + "assistant\n" + ("<think>\n" if thinking else "<think>\n\n</think>\n\n"))
        return "".join(out)


@register("qwen3-vl-instruct", thinking=False)
@register("qwen3-vl-thinking", thinking=True)
class Qwen3VLRenderer:
    """Qwen3-VL: JSON tool listing and JSON tool calls; the thinking variant opens ``<think>`` for the answer."""

    def __init__(self, thinking: bool) -> None:
        self.thinking = thinking

    def render(self, messages: Sequence[Message], tools: Sequence[Tool] | None, think: ThinkValue) -> str:
        check_roles(messages, ROLES, "qwen3-vl")
        thinking = self.thinking if think is None else think_enabled(think)
        out: list[str] = []
        has_system = bool(messages) and messages[0].role == "system"
        if tools:
            out.append(IM_START + "system\n" + (messages[0].content + "\n\n" if has_system else ""))
            out.append(
                "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
                "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
            )
            out.extend("\n" + spaced_json(t.spec) for t in tools)
            out.append(
                "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
                '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": '
                "<args-json-object>}\n</tool_call>" + IM_END + "\n"
            )
        elif has_system:
            out.append(IM_START + "system\n" + messages[0].content + IM_END + "\n")
        last_query = _last_query_index(messages, strip=False)
        for i, m in enumerate(messages):
            role = m.role
            content = m.content
            last = i == len(messages) - 1
            prefill = last and role == "assistant"
            if role == "user" or (role == "system" and i != 0):
                out.append(IM_START + role + "\n" + content + IM_END + "\n")
            elif role == "assistant":
                reasoning = m.thinking if thinking else ""
                if thinking and i > last_query and (last or reasoning):
                    out.append(IM_START + "assistant\n<think>\n" + reasoning.strip("\n"))
                    # The published template always closes the block; Ollama leaves it open when there is no
                    # content. We close it unless nothing follows (a prefill that continues the thinking).
                    if content or m.tool_calls:
                        out.append("\n</think>\n\n" + content.lstrip("\n"))
                else:
                    out.append(IM_START + "assistant\n" + content)
                for j, call in enumerate(m.tool_calls):
                    if j > 0 or content:
                        out.append("\n")
                    out.append(
                        '<tool_call>\n{"name": "'
                        + call.name
                        + '", "arguments": '
                        + spaced_json(call.arguments)
                        + "}\n</tool_call>"
                    )
                if not prefill:
                    out.append(IM_END + "\n")
            elif role == "tool":
                out.append(tool_response(messages, i, content))
            if last and not prefill:
                out.append(IM_START + "assistant\n" + ("<think>\n" if thinking else ""))
        return "".join(out)
