"""What a renderer is: a family's prompt format written in code (as Ollama's RENDERER), used instead of a template."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from daemon.chat.types import ThinkValue

Tool = Mapping[str, Any]
Message = Mapping[str, Any]  # Ollama shape: role, content, thinking, tool_calls [{"function": {"name", "arguments"}}],
# tool_name, tool_call_id, images (already replaced by "[img-N]" markers in content)


class Renderer(Protocol):
    """Render a whole chat to the prompt text, ending where the model's answer begins (the generation prompt), or
    continuing the last message when it is an assistant prefill. Pure; raises ``InvalidRequest`` for input the
    family cannot express."""

    def render(self, messages: Sequence[Message], tools: Sequence[Tool] | None, think: ThinkValue) -> str: ...
