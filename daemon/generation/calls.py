"""What the generation service takes: one frozen value per call, built once by each dialect from its request (the
Ollama routes from their pydantic bodies, the OpenAI, Responses and Anthropic routes straight from their JSON).
Every field has its final type here: messages and tools as the chat core's values, ``think`` normalised (the strings
"true"/"false" as booleans), ``logit_bias`` parsed into (token id, bias) pairs. ``options`` are the request's Ollama
options as given: :meth:`daemon.generation.inference.Inference.options` merges and checks them against the
model's."""

from __future__ import annotations

from dataclasses import dataclass, field

from daemon.chat import pipeline
from daemon.chat.types import JSONObject, JSONValue, Message, ThinkValue, Tool
from daemon.runners.base import parse_logit_bias
from errors import InvalidRequest

#: A request's keep_alive as given: a duration ("5m", "1h30m"), seconds, or None for the default; the service
#: parses it (``inference.keep_alive_value``) after the model lookup, so that a missing model is still a 404.
KeepAlive = str | int | float | None
#: OpenAI's logit_bias, parsed: (token id, bias in [-100, 100]) pairs sorted by id (``parse_logit_bias``).
LogitBias = tuple[tuple[int, float], ...]


@dataclass(frozen=True, kw_only=True)
class Call:
    """What a chat and a generate call share."""

    model: str  # the name as the client gave it ("" is refused by the service)
    format: JSONValue = None  # "json", a JSON schema (object or its text), or None
    options: JSONObject = field(default_factory=dict)  # Ollama options as given (merged and checked later)
    think: ThinkValue = None  # normalised once (pipeline.normalise_think); None: the model's default
    keep_alive: KeepAlive = None
    truncate: bool = True  # a prompt longer than num_ctx is cut (true, Ollama's default) or refused
    shift: bool = True  # false: no context shift; a generation that fills num_ctx stops there
    logprobs: bool = False
    top_logprobs: int = 0
    logit_bias: LogitBias = ()


@dataclass(frozen=True, kw_only=True)
class ChatCall(Call):
    """A chat: messages (and tools) to render with the model's template or renderer."""

    messages: tuple[Message, ...] = ()
    tools: tuple[Tool, ...] = ()


@dataclass(frozen=True, kw_only=True)
class GenerateCall(Call):
    """A completion of one prompt (Ollama's /api/generate; OpenAI's /v1/completions)."""

    prompt: str = ""
    suffix: str = ""
    system: str | None = None  # None: the model's SYSTEM
    template: str | None = None  # a Go template replacing the model's for this call
    context: tuple[int, ...] = ()  # the deprecated token context of an earlier /api/generate
    raw: bool = False  # the prompt as it is: no template
    images: tuple[str, ...] = ()  # base64


def options_and_bias(options: JSONObject | None) -> tuple[JSONObject, LogitBias]:
    """Ollama options as given, with ``logit_bias`` (OpenAI's, a corral extension in options too) taken out and
    parsed: the one place a request's options' logit_bias is read."""
    opts = dict(options or {})
    raw = opts.pop("logit_bias", None)
    if raw is None:
        return opts, ()
    try:
        return opts, parse_logit_bias(raw)
    except ValueError as exc:
        raise InvalidRequest(f'option "logit_bias" {exc}') from None


def think_value(think: object) -> ThinkValue:
    """A request's ``think`` normalised once: the strings "true"/"false" as booleans, levels and None as they are.
    What is not a boolean, a string or None is refused (the pydantic bodies and the dialects never pass one)."""
    if think is None or isinstance(think, (bool, str)):
        return pipeline.normalise_think(think)
    raise InvalidRequest(f"invalid think value: {think!r}")


@dataclass(frozen=True, kw_only=True)
class EmbedCall:
    """Embeddings of some texts (Ollama's /api/embed; OpenAI's /v1/embeddings)."""

    model: str
    input: JSONValue = None  # a text or a list of texts; the service checks which
    truncate: bool = True  # a text longer than the context is cut (true) or refused
    dimensions: int | None = None  # vectors cut to this many dimensions (and normalised again)
    keep_alive: KeepAlive = None
    options: JSONObject = field(default_factory=dict)
