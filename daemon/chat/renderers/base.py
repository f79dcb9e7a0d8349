"""What a renderer is: a family's prompt format written in code (as Ollama's RENDERER), used instead of a template;
the table the family modules register their renderers in; and the helpers the families share."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Protocol

from daemon.chat.registry import Registry
from daemon.chat.types import JSONObject, JSONValue, Message, ThinkValue, Tool
from errors import InvalidRequest


class Renderer(Protocol):
    """Render a whole chat to the prompt text, ending where the model's answer begins (the generation prompt), or
    continuing the last message when it is an assistant prefill. ``messages`` have their images already written
    into the content as ``[img-N]`` markers. Pure; raises ``InvalidRequest`` for input the family cannot express."""

    def render(self, messages: Sequence[Message], tools: Sequence[Tool] | None, think: ThinkValue) -> str: ...


RENDERERS: Registry[Renderer] = Registry("renderer")
register = RENDERERS.register


def compact_json(value: JSONValue) -> str:
    """JSON without spaces, non-ASCII kept as is (what Ollama's renderer writes for nested values)."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def check_roles(messages: Sequence[Message], roles: Sequence[str], family: str) -> None:
    """Raise ``InvalidRequest`` for a role the family has no turn for."""
    for m in messages:
        if m.role not in roles:
            raise InvalidRequest(f"the {family} renderer cannot render a message with role {m.role!r}")


def function_of(tool: Tool) -> JSONObject:
    """The ``function`` part of an Ollama/OpenAI tool, which must have a name (a renderer prints it)."""
    fn = tool.function
    if fn is None or not isinstance(fn.get("name"), str):
        raise InvalidRequest("a tool needs a function with a name")
    return fn
