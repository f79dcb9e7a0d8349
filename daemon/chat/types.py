"""The typed values of a chat: tool calls, and the events a generation yields (content, thinking, tool calls,
finished with its metrics). Every dialect translates these; none of them sees another dialect's wire shape."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

#: What a request's ``think`` may be: unset, on/off, or a level.
ThinkValue = bool | str | None
THINK_LEVELS = ("low", "medium", "high", "max")


def think_enabled(think: ThinkValue) -> bool:
    """True when ``think`` asks for thinking (``true`` or any level)."""
    if isinstance(think, str):
        return think not in ("", "false")
    return bool(think)


@dataclass(frozen=True)
class ToolCall:
    """One call of a function tool. ``arguments`` is always a JSON object; ``id`` and ``index`` are given by the
    pipeline (a parser leaves them empty)."""

    name: str
    arguments: dict[str, Any]
    id: str = ""
    index: int = 0

    def ollama(self) -> dict[str, Any]:
        """Ollama's wire shape: ``{"id", "function": {"index", "name", "arguments"}}``."""
        out: dict[str, Any] = {"function": {"index": self.index, "name": self.name, "arguments": self.arguments}}
        if self.id:
            out = {"id": self.id, **out}
        return out


@dataclass
class Parsed:
    """What a parser makes of one piece of generated text."""

    content: str = ""
    thinking: str = ""
    calls: list[ToolCall] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.thinking or self.calls)


@dataclass(frozen=True)
class Content:
    """Answer text, with the logprobs of the tokens it came from (Ollama's shape) when asked for."""

    text: str
    logprobs: tuple[dict[str, Any], ...] = ()


@dataclass(frozen=True)
class Thinking:
    """Reasoning text, outside the answer."""

    text: str


@dataclass(frozen=True)
class ToolCalls:
    """Complete tool calls, emitted as soon as the parser has each whole."""

    calls: tuple[ToolCall, ...]


@dataclass(frozen=True)
class Finished:
    """The end of a generation, with Ollama's metrics (nanoseconds) and what other dialects need."""

    done_reason: Literal["stop", "length"] | str
    prompt_eval_count: int = 0
    prompt_eval_duration: int = 0
    eval_count: int = 0
    eval_duration: int = 0
    total_duration: int = 0
    load_duration: int = 0
    prompt_cached: int = 0  # prompt tokens served from the KV cache (OpenAI's cached_tokens)
    stop_sequence: str | None = None  # the user stop string that ended it (Anthropic's stop_sequence)
    context: tuple[int, ...] | None = None  # /api/generate's context, when it has one

    def metrics(self) -> dict[str, int]:
        """Ollama's metric fields."""
        return {
            "total_duration": self.total_duration,
            "load_duration": self.load_duration,
            "prompt_eval_count": self.prompt_eval_count,
            "prompt_eval_duration": self.prompt_eval_duration,
            "eval_count": self.eval_count,
            "eval_duration": self.eval_duration,
        }


Event = Content | Thinking | ToolCalls | Finished
