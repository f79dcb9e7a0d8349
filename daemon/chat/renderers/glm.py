"""GLM-4.6 and GLM-4.7 prompt formats (``RENDERER glm-4.6``, ``glm-4.7``): ``[gMASK]<sop>``, role tokens without
end markers, JSON tool listing, ``<tool_call>NAME<arg_key>…</arg_key><arg_value>…</arg_value></tool_call>`` calls."""

from __future__ import annotations

import json
from collections.abc import Sequence

from daemon.chat.renderers.base import check_roles, compact_json, register
from daemon.chat.types import JSONValue, Message, ThinkValue, Tool, think_enabled

ROLES = ("system", "user", "assistant", "tool")
_INTRO = (
    "<|system|>\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
)


def _arg_value(value: JSONValue) -> str:
    # Strings go in bare; everything else as compact JSON.
    if isinstance(value, str):
        return value
    return compact_json(value)


def _is_prefill(messages: Sequence[Message]) -> bool:
    return bool(messages) and messages[-1].role == "assistant" and not messages[-1].tool_calls


@register("glm-4.7")
class GLM47Renderer:
    """GLM-4.7: thinks unless ``think`` is false; past thinking is kept in every assistant turn."""

    def render(self, messages: Sequence[Message], tools: Sequence[Tool] | None, think: ThinkValue) -> str:
        check_roles(messages, ROLES, "glm-4.7")
        out = ["[gMASK]<sop>"]
        if tools:
            out.append(_INTRO)
            out.extend(json.dumps(t.spec, ensure_ascii=False) + "\n" for t in tools)
            out.append(
                "</tools>\n\nFor each function call, output the function name and arguments within the following "
                "XML format:\n<tool_call>{function-name}<arg_key>{arg-key-1}</arg_key><arg_value>{arg-value-1}"
                "</arg_value><arg_key>{arg-key-2}</arg_key><arg_value>{arg-value-2}</arg_value>...</tool_call>"
            )
        for i, m in enumerate(messages):
            role = m.role
            if role == "assistant":
                thinking = m.thinking
                out.append("<|assistant|>" + (f"<think>{thinking}</think>" if thinking else "</think>") + m.content)
                for call in m.tool_calls:
                    body = "".join(
                        f"<arg_key>{k}</arg_key><arg_value>{_arg_value(v)}</arg_value>"
                        for k, v in call.arguments.items()
                    )
                    out.append(f"<tool_call>{call.name}{body}</tool_call>")
            elif role == "tool":
                if i == 0 or messages[i - 1].role != "tool":
                    out.append("<|observation|>")
                out.append("<tool_response>" + m.content + "</tool_response>")
            else:
                out.append(f"<|{role}|>" + m.content)
        if not _is_prefill(messages):
            out.append("<|assistant|>" + ("</think>" if think is not None and not think_enabled(think) else "<think>"))
        return "".join(out)


@register("glm-4.6")
class GLM46Renderer:
    """GLM-4.6: thinks by default; ``think`` false appends ``/nothink`` to user turns and closes an empty think block
    in the generation prompt. Thinking is kept only on the turns after the last user message."""

    def render(self, messages: Sequence[Message], tools: Sequence[Tool] | None, think: ThinkValue) -> str:
        check_roles(messages, ROLES, "glm-4.6")
        no_think = think is not None and not think_enabled(think)
        out = ["[gMASK]<sop>"]
        if tools:
            out.append(_INTRO)
            out.extend(compact_json(t.spec) + "\n" for t in tools)
            out.append(
                "</tools>\n\nFor each function call, output the function name and arguments within the following "
                "XML format:\n<tool_call>{function-name}\n<arg_key>{arg-key-1}</arg_key>\n<arg_value>{arg-value-1}"
                "</arg_value>\n<arg_key>{arg-key-2}</arg_key>\n<arg_value>{arg-value-2}</arg_value>\n...\n</tool_call>"
            )
        last_user = max((i for i, m in enumerate(messages) if m.role == "user"), default=0)
        for i, m in enumerate(messages):
            role = m.role
            content = m.content
            if role == "user":
                suffix = "/nothink" if no_think and not content.endswith("/nothink") else ""
                out.append("<|user|>\n" + content + suffix)
            elif role == "assistant":
                out.append("<|assistant|>")
                if i > last_user:
                    out.append("\n<think>" + m.thinking + "</think>")
                if content:
                    out.append("\n" + content)
                for call in m.tool_calls:
                    body = "".join(
                        f"<arg_key>{k}</arg_key>\n<arg_value>{_arg_value(v)}</arg_value>\n"
                        for k, v in call.arguments.items()
                    )
                    out.append(f"\n<tool_call>{call.name}\n{body}</tool_call>")
            elif role == "tool":
                if i == 0 or messages[i - 1].role != "tool":
                    out.append("<|observation|>")
                out.append("\n<tool_response>\n" + content + "\n</tool_response>")
            else:
                out.append("<|system|>\n" + content)
        if not _is_prefill(messages):
            out.append("<|assistant|>" + ("\n<think></think>\n" if no_think else ""))
        return "".join(out)
