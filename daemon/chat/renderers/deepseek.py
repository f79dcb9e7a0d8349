"""DeepSeek V3.1's prompt format (``RENDERER deepseek3.1``, also ``deepseek3``): full-width special tokens, tools
described in the system text, ``</think>``/``<think>`` after each ``<｜Assistant｜>`` to switch thinking."""

from __future__ import annotations

from collections.abc import Sequence

from daemon.chat.parsers.deepseek import (  # the family's tokens, one definition for both directions
    CALL_BEGIN,
    CALL_END,
    CALLS_BEGIN,
    CALLS_END,
    OUTPUT_BEGIN,
    OUTPUT_END,
    SEP,
)
from daemon.chat.renderers.base import check_roles, compact_json, function_of, register
from daemon.chat.types import Message, ThinkValue, Tool, think_enabled

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"

_TOOL_RULES = (
    "\nIMPORTANT: ALWAYS adhere to this exact format for tool use:\n"
    f"{CALLS_BEGIN}{CALL_BEGIN}tool_call_name{SEP}tool_call_arguments{CALL_END}{{{{additional_tool_calls}}}}"
    f"{CALLS_END}\n\n"
    "Where:\n\n"
    "- `tool_call_name` must be an exact match to one of the available tools\n"
    "- `tool_call_arguments` must be valid JSON that strictly follows the tool's Parameters Schema\n"
    "- For multiple tool calls, chain them directly without separators or spaces\n"
)


@register("deepseek3.1", "deepseek3")
class DeepSeek3Renderer:
    """DeepSeek V3.1: thinks only when ``think`` asks for it. All system messages are joined at the top; past
    thinking is dropped."""

    def render(self, messages: Sequence[Message], tools: Sequence[Tool] | None, think: ThinkValue) -> str:
        check_roles(messages, ("system", "user", "assistant", "tool"), "deepseek3.1")
        thinking = think_enabled(think)
        out = [BOS, "\n\n".join(m.content for m in messages if m.role == "system")]
        if tools:
            out.append("\n\n## Tools\nYou have access to the following tools:\n")
            for tool in tools:
                fn = function_of(tool)
                out.append(f"\n### {fn['name']}\nDescription: {fn.get('description') or ''}")
                out.append("\n\nParameters: " + compact_json(fn.get("parameters") or {}) + "\n")
            out.append(_TOOL_RULES)
        last_user = max((i for i, m in enumerate(messages) if m.role == "user"), default=-1)
        after_user = after_tool = False
        for i, m in enumerate(messages):
            role = m.role
            content = m.content
            if role == "user":
                after_user, after_tool = True, False
                out.append(USER + content)
            elif role == "tool":
                after_user, after_tool = False, True
                out.append(OUTPUT_BEGIN + content + OUTPUT_END)
            elif role == "assistant":
                calls = m.tool_calls
                if after_user:
                    # Only the answer to the newest query may open with <think>; earlier answers close it at once.
                    opens = not calls and thinking and i > last_user and bool(m.thinking)
                    out.append(ASSISTANT + ("<think>" if opens else "</think>"))
                if calls:
                    out.append(content + CALLS_BEGIN)
                    out.extend(CALL_BEGIN + c.name + SEP + compact_json(c.arguments) + CALL_END for c in calls)
                    out.append(CALLS_END + EOS)
                else:
                    if not after_tool and "</think>" in content:
                        content = content.split("</think>", 1)[1]
                    # A last assistant message is a prefill: left open for the model to continue.
                    out.append(content + ("" if i == len(messages) - 1 else EOS))
                after_user = after_tool = False
        if after_user:
            out.append(ASSISTANT + ("<think>" if thinking else "</think>"))
        return "".join(out)
