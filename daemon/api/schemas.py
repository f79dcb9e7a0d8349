"""Wire models for the Ollama-native model-management API (pydantic; unknown fields ignored like Go's decoder)."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

from daemon.generation.calls import EmbedCall

#: A token id as llama.cpp holds one (llama_token is an int32; ids are never negative). Larger numbers are refused
#: here rather than wrapped around on their way into a batch; the runner checks each id against the vocabulary.
TokenId = Annotated[StrictInt, Field(ge=0, le=2**31 - 1)]


class Wire(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)


class NamedRequest(Wire):
    model: StrictStr | None = None
    name: StrictStr | None = None  # deprecated alias of model

    @property
    def model_name(self) -> str:
        return self.model or self.name or ""


class ShowRequest(NamedRequest):
    verbose: StrictBool = False
    system: StrictStr | None = None
    options: dict[str, Any] | None = None


class DeleteRequest(NamedRequest):
    pass


class CopyRequest(Wire):
    source: StrictStr = ""
    destination: StrictStr = ""


class Message(Wire):
    role: StrictStr
    content: StrictStr = ""


class CreateRequest(NamedRequest):
    from_: StrictStr | None = Field(default=None, alias="from")
    files: dict[StrictStr, StrictStr] | None = None
    adapters: dict[StrictStr, StrictStr] | None = None
    template: StrictStr | None = None
    system: StrictStr | None = None
    license: StrictStr | list[StrictStr] | None = None
    parameters: dict[str, Any] | None = None
    messages: list[Message] | None = None
    quantize: StrictStr | None = None
    quantization: StrictStr | None = None
    requires: StrictStr | None = None  # REQUIRES: the minimum Ollama version the model needs
    renderer: StrictStr | None = None  # RENDERER: the built-in prompt renderer named in the config
    parser: StrictStr | None = None  # PARSER: the built-in output parser named in the config
    stream: StrictBool = True


class ToolCallFunction(Wire):
    name: StrictStr
    arguments: dict[str, Any] = Field(default_factory=dict)
    index: int | None = None


class ToolCall(Wire):
    id: StrictStr | None = None
    function: ToolCallFunction


class ChatMessage(Wire):
    role: StrictStr
    content: StrictStr = ""
    thinking: StrictStr | None = None
    images: list[StrictStr] | None = None
    tool_calls: list[ToolCall] | None = None
    tool_name: StrictStr | None = None
    tool_call_id: StrictStr | None = None


class KeepAliveField(Wire):
    """A ``keep_alive`` alone, checked as the bodies below check it (the OpenAI-style dialects read the rest of
    their JSON by hand)."""

    keep_alive: StrictStr | int | float | None = None


class InferenceRequest(NamedRequest):
    stream: StrictBool = True
    format: Any = None
    keep_alive: StrictStr | int | float | None = None
    options: dict[str, Any] | None = None
    think: StrictBool | StrictStr | None = None
    # A prompt longer than num_ctx: true (Ollama's default) drops the oldest chat messages, then cuts what is still
    # too long to its first num_keep tokens and its end, and logs each cut at INFO; false answers 400 "the prompt is
    # longer than the context length ..." with the sizes instead (as does shift false, as in Ollama's runner).
    truncate: StrictBool = True
    shift: StrictBool = True  # false: no context shift; a generation that fills num_ctx stops there
    logprobs: StrictBool = False
    top_logprobs: int = 0


class GenerateRequestBody(InferenceRequest):
    prompt: StrictStr = ""
    suffix: StrictStr = ""
    system: StrictStr | None = None
    template: StrictStr | None = None
    context: list[TokenId] | None = None
    raw: StrictBool = False
    images: list[StrictStr] | None = None


class ChatRequestBody(InferenceRequest):
    messages: list[ChatMessage] = Field(default_factory=list)
    tools: list[dict[str, Any]] | None = None


class EmbedRequestBody(NamedRequest):
    input: Any = None
    truncate: StrictBool = True
    dimensions: int | None = None
    keep_alive: StrictStr | int | float | None = None
    options: dict[str, Any] | None = None

    def call(self) -> EmbedCall:
        """The generation service's call for this body."""
        return EmbedCall(
            model=self.model_name,
            input=self.input,
            truncate=self.truncate,
            dimensions=self.dimensions,
            keep_alive=self.keep_alive,
            options=dict(self.options or {}),
        )


class EmbeddingsRequestBody(NamedRequest):
    prompt: StrictStr = ""
    keep_alive: StrictStr | int | float | None = None
    options: dict[str, Any] | None = None
