"""The typed values of a chat: the messages and tools a request brings, tool calls, and the events a generation
yields (content, thinking, tool calls, finished with its metrics). Every dialect translates to and from these; none
of them sees another dialect's wire shape, and nothing in the chat core takes or returns wire dicts."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal, TypeAlias

#: A JSON value as json.loads gives it (tool arguments, tool schemas).
JSONValue: TypeAlias = "str | int | float | bool | None | list[JSONValue] | dict[str, JSONValue]"
JSONObject: TypeAlias = "dict[str, JSONValue]"

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
    arguments: JSONObject
    id: str = ""
    index: int | None = None  # None: not given (a call in a request's message may lack it)

    def ollama(self) -> JSONObject:
        """Ollama's wire shape: ``{"id", "function": {"index", "name", "arguments"}}``."""
        index = self.index if self.index is not None else 0
        out: JSONObject = {"function": {"index": index, "name": self.name, "arguments": self.arguments}}
        if self.id:
            out = {"id": self.id, **out}
        return out


@dataclass(frozen=True)
class Tool:
    """A function the model may call, as the request declared it. ``spec`` is the whole declaration in Ollama's shape
    (``{"type": "function", "function": {"name", "description", "parameters"}}``), kept as given because templates
    print it (a Jinja template sees it as JSON, key order and unknown keys included)."""

    name: str
    spec: JSONObject

    @classmethod
    def of(cls, spec: Mapping[str, JSONValue]) -> Tool:
        """A tool from its declaration (Ollama/OpenAI ``{"function": {"name", ...}}``, or a bare ``{"name", ...}``)."""
        fn = spec.get("function")
        name = fn.get("name") if isinstance(fn, dict) else spec.get("name")
        return cls(name=name if isinstance(name, str) else "", spec=dict(spec))

    @property
    def function(self) -> JSONObject | None:
        """The declaration's ``function`` object (name, description, parameters), when it has one."""
        fn = self.spec.get("function")
        return fn if isinstance(fn, dict) else None

    @property
    def parameters(self) -> JSONObject | None:
        """The JSON schema of the arguments, when the declaration has one."""
        params = (self.function or self.spec).get("parameters")
        return params if isinstance(params, dict) else None


@dataclass(frozen=True)
class Message:
    """One message of a chat, in the chat core's terms (Ollama's message: role, content, thinking, images as
    base64, tool calls, the tool's name and call id for a tool result). ``role`` is lowercase."""

    role: str
    content: str = ""
    thinking: str = ""
    images: tuple[str, ...] = ()
    tool_calls: tuple[ToolCall, ...] = ()
    tool_name: str = ""
    tool_call_id: str = ""

    @classmethod
    def of(cls, data: Mapping[str, JSONValue]) -> Message:
        """A message from Ollama's wire shape (the inverse of :meth:`wire`; a call's ``id`` is kept). Fields of the
        wrong type count as absent; ``role`` is lowercased."""

        def string(value: JSONValue | None) -> str:
            return value if isinstance(value, str) else ""

        calls = []
        raw_calls = data.get("tool_calls")
        for raw in raw_calls if isinstance(raw_calls, list) else ():
            fn = raw.get("function") if isinstance(raw, dict) else None
            if not isinstance(raw, dict) or not isinstance(fn, dict):
                continue
            arguments, index = fn.get("arguments"), fn.get("index")
            calls.append(
                ToolCall(
                    name=string(fn.get("name")),
                    arguments=arguments if isinstance(arguments, dict) else {},
                    id=string(raw.get("id")),
                    index=index if isinstance(index, int) and not isinstance(index, bool) else None,
                )
            )
        images = data.get("images")
        return cls(
            role=string(data.get("role")).lower(),
            content=string(data.get("content")),
            thinking=string(data.get("thinking")),
            images=tuple(i for i in images if isinstance(i, str)) if isinstance(images, list) else (),
            tool_calls=tuple(calls),
            tool_name=string(data.get("tool_name")),
            tool_call_id=string(data.get("tool_call_id")),
        )

    def wire(self) -> JSONObject:
        """Ollama's wire shape (fields left out when empty; a call's ``id`` is not part of it, as in Ollama's
        ``api.ToolCall`` that templates range over)."""
        out: JSONObject = {"role": self.role, "content": self.content}
        if self.thinking:
            out["thinking"] = self.thinking
        if self.images:
            out["images"] = list[JSONValue](self.images)
        if self.tool_calls:
            out["tool_calls"] = [
                {
                    "function": {
                        "name": c.name,
                        "arguments": c.arguments,
                        **({"index": c.index} if c.index is not None else {}),
                    }
                }
                for c in self.tool_calls
            ]
        if self.tool_name:
            out["tool_name"] = self.tool_name
        if self.tool_call_id:
            out["tool_call_id"] = self.tool_call_id
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
    logprobs: tuple[JSONObject, ...] = ()


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
    # speculative decoding (llama-server's timings names): tokens drafted and, of them, accepted; None when the
    # request did not ask for speculation and nothing was drafted (then no dialect shows them)
    draft_n: int | None = None
    draft_n_accepted: int | None = None

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

    def drafts(self) -> dict[str, int]:
        """``draft_n`` and ``draft_n_accepted`` when speculation was asked for (or drafted anything), else {}."""
        if self.draft_n is None:
            return {}
        return {"draft_n": self.draft_n, "draft_n_accepted": self.draft_n_accepted or 0}


Event = Content | Thinking | ToolCalls | Finished
