"""A model's chat behaviour, pure: which renderer or template makes its prompt, which parser reads its output, what
it can do (thinking, tools), and the step from generated pieces to typed events (content, thinking, tool calls).

The route code (daemon/api/routes/generate.py) holds the runner and the lease; everything here is text in, values out.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import secrets
import string
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from daemon.chat import infer, renderers
from daemon.chat.parsers import parser_for
from daemon.chat.parsers.base import Parser
from daemon.chat.parsers.tools import GenericParser
from daemon.chat.schema import check_arguments
from daemon.chat.types import (
    Content,
    Event,
    JSONObject,
    JSONValue,
    Message,
    Parsed,
    Thinking,
    ThinkValue,
    Tool,
    ToolCall,
    ToolCalls,
    think_enabled,
)
from daemon.templates import prompt as prompts
from errors import InvalidRequest

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ChatModel:
    """What decides a model's chat behaviour: its Go TEMPLATE, the GGUF's Jinja chat template (used when there is
    no Go template), and the Modelfile's RENDERER and PARSER names (empty: none)."""

    template: str | None = None
    chat_template: str | None = None
    renderer: str = ""
    parser: str = ""

    @property
    def think_tags(self) -> tuple[str, str]:
        """The tags around thinking, inferred from the template as Ollama does (("", "") when it cannot think)."""
        return think_tags(self.template, self.chat_template)

    @property
    def parser_name(self) -> str:
        """The Modelfile's PARSER, else the family parser the template's own markers name (as Ollama picks harmony
        for gpt-oss), else "" (the generic parser)."""
        return self.parser or detect_parser(self.template, self.chat_template)

    def builtin_parser(self) -> Parser | None:
        name = self.parser_name
        return parser_for(name) if name else None

    def capabilities(self) -> list[str]:
        """``thinking`` and ``tools`` as this model's template, renderer and parser allow them."""
        caps = []
        builtin = self.builtin_parser()
        if builtin is not None and builtin.has_tools:
            caps.append("tools")
        elif self.template:
            if ".Tools" in self.template:
                caps.append("tools")
        elif self.chat_template and ("tools" in self.chat_template or "tool_call" in self.chat_template):
            caps.append("tools")
        if all(self.think_tags) or (builtin is not None and builtin.has_thinking):
            caps.append("thinking")
        return caps


# Markers in a template that only one family's output format uses, and the parser for it. Formats the generic parser
# reads (``<think>`` thinking, ``<tool_call>{json}``, a bare JSON call) need no entry.
_FAMILY_MARKERS: tuple[tuple[tuple[str, ...], str], ...] = (
    (("<|channel|>", "<|start|>"), "harmony"),  # gpt-oss
    (("<function=", "<parameter="), "qwen3-coder"),
    (("<｜tool▁calls▁begin｜>", "<｜tool▁sep｜>"), "deepseek3"),
    (("<arg_key>", "<arg_value>", "<|assistant|><think>"), "glm-4.7"),
    (("<arg_key>", "<arg_value>"), "glm-4.6"),
    (("[TOOL_CALLS]", "[ARGS]"), "ministral"),
    (("<start_function_call>",), "functiongemma"),
    (("<|python_tag|>",), "llama3"),
)


@functools.lru_cache(maxsize=256)
def detect_parser(template: str | None, chat_template: str | None) -> str:
    """The family parser a template's markers name, or ""."""
    text = template or chat_template or ""
    for markers, name in _FAMILY_MARKERS:
        if all(m in text for m in markers):
            return name
    return ""


@functools.lru_cache(maxsize=256)
def think_tags(template: str | None, chat_template: str | None) -> tuple[str, str]:
    try:
        if template:
            opening, closing = infer.infer_think_tags(template)
        elif chat_template:
            opening, closing = infer.infer_think_tags_jinja(chat_template)
        else:
            return "", ""
    except Exception as exc:  # noqa: BLE001 - a template that does not parse cannot think; it fails when rendered
        log.debug("inferring thinking tags: %s", exc)
        return "", ""
    return (opening, closing) if opening and closing else ("", "")


@functools.lru_cache(maxsize=256)
def tool_tag(template: str | None, chat_template: str | None) -> str:
    try:
        if template:
            return infer.infer_tool_tag(template) or "{"
        if chat_template:
            return infer.infer_tool_tag_jinja(chat_template) or "{"
    except Exception as exc:  # noqa: BLE001
        log.debug("inferring the tool-call tag: %s", exc)
    return "{"


def normalise_think(think: object) -> ThinkValue:
    """A request's ``think``: "true"/"false" strings as booleans, levels as they are (anything else, which the
    request bodies' types do not let through, as its truth)."""
    if think in ("true", "false"):
        return think == "true"
    if think is None or isinstance(think, bool | str):
        return think
    return bool(think)


def render(
    model: ChatModel,
    messages: Sequence[Message],
    tools: Sequence[Tool] | None,
    think: ThinkValue,
) -> str:
    """The prompt for a chat: the model's RENDERER when it names one corral has, else its template."""
    tools = tools or None
    messages = _without_call_ids(messages)
    if model.renderer:
        renderer = renderers.renderer_for(model.renderer)
        if renderer is not None:
            return renderer.render(prompts.tag_images(messages), tools, think)
        log.warning("no renderer named %r; using the model's template", model.renderer)
    return prompts.render_messages(model.template, model.chat_template, messages, tools=tools, think=think)


def _without_call_ids(messages: Sequence[Message]) -> Sequence[Message]:
    """The messages with their tool calls' ids left out: a prompt has never shown them (Ollama's message, as corral
    has always handed it to templates and renderers, carries no call id), so the ids the OpenAI, Anthropic and
    Responses dialects read do not change the prompt. A tool result's ``tool_call_id`` stays."""
    if not any(c.id for m in messages for c in m.tool_calls):
        return messages
    return [
        dataclasses.replace(m, tool_calls=tuple(dataclasses.replace(c, id="") for c in m.tool_calls))
        if m.tool_calls
        else m
        for m in messages
    ]


def strip_past_thinking(model: ChatModel, messages: Sequence[Message]) -> list[Message]:
    """Earlier assistant turns (before the last user message) lose thinking written into their content between the
    model's tags: it only costs context and hurts answers (Ollama does this for qwen3 and deepseek-r1)."""
    opening, closing = model.think_tags
    if not opening:
        return list(messages)
    last_user = max((i for i, m in enumerate(messages) if m.role == "user"), default=-1)
    out = []
    for i, m in enumerate(messages):
        if m.role == "assistant" and i < last_user and opening in m.content:
            splitter = GenericParser((opening, closing), None, False)
            splitter.init(None, None, True)
            m = dataclasses.replace(m, content=splitter.add(m.content, True).content)
        out.append(m)
    return out


def output_parser(
    model: ChatModel,
    *,
    tools: Sequence[Tool] | None,
    last: Message | None,
    think: ThinkValue,
    raw: bool = False,
    forced_call: bool = False,
) -> tuple[Parser, bool, list[Tool] | None]:
    """The parser for one generation, initialised before the prompt is rendered (call :func:`rendered` after), whether
    it splits thinking off, and the tools to render (a parser may rename them, as harmony does). The Modelfile's
    PARSER, or the family's (``ChatModel.parser_name``), when corral has it; else the generic one: thinking between
    the tags inferred from the template (when ``think`` is on), tool calls after the tag the template uses (when
    tools were given). ``raw`` prompts get none of that. ``forced_call``: a grammar makes the answer one bare JSON
    call (tool_choice required or naming a tool), which the generic parser reads whatever the family's format is."""
    given = list(tools) if tools else None
    builtin = None if raw or forced_call else model.builtin_parser()
    if builtin is not None:
        shown = builtin.init(given, last, think)
        return builtin, builtin.has_thinking and think is not False, list(shown or ()) if tools else None
    opening, closing = model.think_tags
    thinks = not raw and think_enabled(think) and bool(opening)
    generic = GenericParser(
        (opening, closing) if thinks else None,
        ("{" if forced_call else tool_tag(model.template, model.chat_template)) if tools and not raw else None,
    )
    generic.init(given, last, think)
    return generic, thinks, given


def rendered(parser: Parser, model: ChatModel, prompt: str) -> None:
    """Tell the generic parser that the prompt ended with the opening thinking tag (the model starts inside its
    thinking), as Ollama checks it."""
    opening = model.think_tags[0]
    if isinstance(parser, GenericParser) and opening and prompt.rstrip().endswith(opening):
        parser.prefill()


def call_schema(tools: Sequence[Tool | Mapping[str, JSONValue]]) -> JSONObject:
    """A JSON schema for one call of one of ``tools`` (Ollama function tools, typed or as the request declared
    them): ``{"name": ..., "arguments": {...}}``, the grammar a dialect sets to force a tool call (tool_choice
    required or naming a tool)."""
    options: list[JSONValue] = []
    for t in tools:
        fn = (t if isinstance(t, Tool) else Tool.of(t)).function
        if fn is None:
            raise KeyError("function")  # as indexing the declaration did: dialects pass function tools only
        given = fn.get("parameters")
        params: JSONObject = given if isinstance(given, dict) else {"type": "object"}
        options.append(
            {
                "type": "object",
                "properties": {"name": {"const": fn["name"]}, "arguments": params},
                "required": ["name", "arguments"],
            }
        )
    if len(options) == 1 and isinstance(options[0], dict):
        return options[0]
    return {"anyOf": options}


def is_call_schema(fmt: object) -> bool:
    """Whether ``fmt`` is the grammar :func:`call_schema` builds."""
    if not isinstance(fmt, Mapping):
        return False
    any_of = fmt.get("anyOf")
    options: list[object] = any_of if isinstance(any_of, list) else [fmt]
    return all(
        isinstance(o, Mapping)
        and isinstance(o.get("properties"), Mapping)
        and set(o["properties"]) == {"name", "arguments"}
        and isinstance(o["properties"]["name"], Mapping)
        and "const" in o["properties"]["name"]
        for o in options
    )


def answer_after_thinking(model: ChatModel) -> str:
    """What a prompt continued after the model's finished thinking needs before the answer (thinking, then an answer
    under a format): the family parser's ``answer_after_thinking``, "" for most families (their templates close
    the thinking themselves)."""
    builtin = model.builtin_parser()
    return builtin.answer_after_thinking if builtin is not None else ""


def call_id() -> str:
    return "call_" + "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))


class EventStream:
    """Generated pieces → events, through one parser. A tool call is checked against the request's tools: a call
    of a tool that was not declared, or with arguments that do not match the tool's schema, is not a tool call; its
    text stays in the answer as content, so nothing is lost."""

    def __init__(self, parser: Parser, tools: Sequence[Tool] | None) -> None:
        self.parser = parser
        self.schemas: dict[str, JSONObject | None] = {}
        for t in tools or ():
            if t.name:
                self.schemas[t.name] = t.parameters
        self.calls = 0

    def add(self, text: str, logprobs: Iterable[JSONObject] = (), *, done: bool = False) -> list[Event]:
        try:
            parsed = self.parser.add(text, done)
        except Exception as exc:  # a parser bug must not lose the answer
            log.exception("output parser %s failed: %s", type(self.parser).__name__, exc)
            parsed = Parsed(content=text)
        return self._events(parsed, tuple(logprobs))

    def _events(self, parsed: Parsed, logprobs: tuple[JSONObject, ...]) -> list[Event]:
        out: list[Event] = []
        if parsed.thinking:
            out.append(Thinking(parsed.thinking))
        content = parsed.content
        calls: list[ToolCall] = []
        for call in parsed.calls:
            checked, problem = self._check(call)
            if checked is None:
                log.info("model output not taken as a tool call: %s", problem)
                content += json.dumps({"name": call.name, "arguments": call.arguments}, ensure_ascii=False)
                continue
            calls.append(checked)
        if content or logprobs:
            out.append(Content(content, logprobs))
        if calls:
            out.append(ToolCalls(tuple(calls)))
        return out

    def _check(self, call: ToolCall) -> tuple[ToolCall | None, str]:
        if call.name not in self.schemas:
            return None, f"{call.name!r} is not among the request's tools"
        arguments, problem = check_arguments(dict(call.arguments), self.schemas[call.name])
        if problem is not None:
            return None, f"arguments of {call.name!r} do not match its schema: {problem}"
        checked = ToolCall(name=call.name, arguments=arguments, id=call_id(), index=self.calls)
        self.calls += 1
        return checked, ""


def check_think(capabilities: Sequence[str], raw_name: str, think: object) -> None:
    """Ollama's checks of ``think``: a known value, and a model that can think when it is on."""
    if think in (None, False, "false"):
        return
    if isinstance(think, str) and think not in ("true", "low", "medium", "high", "max"):
        raise InvalidRequest(f'invalid think value: "{think}" (must be true, false, "low", "medium", "high" or "max")')
    if "thinking" not in capabilities:
        raise InvalidRequest(f'"{raw_name}" does not support thinking')
