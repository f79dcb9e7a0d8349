"""The chat pipeline without a model: which parser a model gets, its capabilities, and how parsed output becomes
events (undeclared tools and arguments that break the schema stay content)."""

from __future__ import annotations

import pytest

from daemon.chat import parsers, pipeline, renderers
from daemon.chat.parsers.tools import GenericParser
from daemon.chat.pipeline import ChatModel, EventStream
from daemon.chat.types import Content, Message, Parsed, Thinking, Tool, ToolCall, ToolCalls

QWEN3 = """{{- range .Messages }}<|im_start|>{{ .Role }}
{{ if .Thinking }}<think>{{ .Thinking }}</think>{{ end }}{{ if .ToolCalls }}<tool_call>
{{ range .ToolCalls }}{"name": "{{ .Function.Name }}", "arguments": {{ .Function.Arguments }}}
{{ end }}</tool_call>{{ else }}{{ .Content }}{{ end }}<|im_end|>
{{ end }}{{ if .Tools }}{{ end }}<|im_start|>assistant
{{ if .Think }}<think>{{ end }}"""
PLAIN = "{{ .Prompt }}"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


def test_capabilities_follow_template_and_parser() -> None:
    assert ChatModel(template=QWEN3).capabilities() == ["tools", "thinking"]
    assert ChatModel(template=PLAIN).capabilities() == []
    assert ChatModel(template=PLAIN, parser="qwen3-thinking").capabilities() == ["tools", "thinking"]
    assert "thinking" in ChatModel(template=PLAIN, parser="harmony").capabilities()
    assert ChatModel(chat_template="{% if enable_thinking %}<think>{% endif %}</think>").capabilities() == ["thinking"]


def test_family_detected_from_template_markers() -> None:
    assert pipeline.detect_parser("<|start|>assistant<|channel|>final<|message|>", None) == "harmony"
    assert pipeline.detect_parser(None, "<function=x>\n<parameter=y>") == "qwen3-coder"
    assert pipeline.detect_parser("<｜tool▁calls▁begin｜><｜tool▁sep｜>", None) == "deepseek3"
    assert pipeline.detect_parser("<arg_key>k</arg_key><arg_value>v</arg_value><|assistant|><think>", None) == "glm-4.7"
    assert pipeline.detect_parser("<arg_key>k</arg_key><arg_value>v</arg_value>", None) == "glm-4.6"
    assert pipeline.detect_parser("[TOOL_CALLS]name[ARGS]{}", None) == "ministral"
    assert pipeline.detect_parser(QWEN3, None) == ""  # the generic parser reads <think> and <tool_call>
    for name in ("harmony", "qwen3-coder", "deepseek3", "glm-4.7", "glm-4.6", "ministral", "functiongemma", "llama3"):
        assert parsers.parser_for(name) is not None, name
    assert ChatModel(template="<|start|>x<|channel|>", parser="passthrough").parser_name == "passthrough"


def test_generic_parser_with_inferred_tags_and_prefill() -> None:
    model = ChatModel(template=QWEN3)
    parser, thinks, tools = pipeline.output_parser(model, tools=[Tool.of(WEATHER)], last=None, think=True)
    assert thinks and tools == [Tool.of(WEATHER)] and isinstance(parser, GenericParser)
    pipeline.rendered(parser, model, "<|im_start|>assistant\n<think>")
    stream = EventStream(parser, tools)
    events = []
    for piece in [
        "I should",
        " look.</th",
        "ink>\n\n<tool_",
        'call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
    ]:
        events += stream.add(piece)
    events += stream.add("", done=True)
    thinking = "".join(e.text for e in events if isinstance(e, Thinking))
    calls = [c for e in events if isinstance(e, ToolCalls) for c in e.calls]
    assert thinking == "I should look."
    assert [(c.name, c.arguments, c.index) for c in calls] == [("get_weather", {"city": "Paris"}, 0)]
    assert calls[0].id.startswith("call_") and len(calls[0].id) == 13
    assert "".join(e.text for e in events if isinstance(e, Content)) == ""

    off, thinks, _ = pipeline.output_parser(model, tools=None, last=None, think=False)
    assert not thinks and off.add("<think>x</think>y", True).content == "<think>x</think>y"
    raw, thinks, _ = pipeline.output_parser(model, tools=[Tool.of(WEATHER)], last=None, think=True, raw=True)
    assert not thinks and raw.add("<think>x", True).content == "<think>x"


class _Fixed:
    """A parser that returns what it is given to return."""

    has_tools = has_thinking = True

    def __init__(self, out: Parsed) -> None:
        self.out = out

    def init(self, tools: object, last: object, think: object) -> None:
        return None

    def add(self, text: str, done: bool) -> Parsed:
        return self.out


def test_calls_are_checked_against_the_request() -> None:
    undeclared = Parsed(calls=[ToolCall("rm_rf", {"path": "/"})])
    events = EventStream(_Fixed(undeclared), [Tool.of(WEATHER)]).add("x")
    assert events == [Content('{"name": "rm_rf", "arguments": {"path": "/"}}')]
    missing = Parsed(calls=[ToolCall("get_weather", {"town": "Paris"})])
    events = EventStream(_Fixed(missing), [Tool.of(WEATHER)]).add("x")
    assert len(events) == 1 and isinstance(events[0], Content) and "get_weather" in events[0].text
    coerced = Parsed(
        content="ok ", calls=[ToolCall("get_weather", {"city": "Paris"}), ToolCall("get_weather", {"city": "Rome"})]
    )
    events = EventStream(_Fixed(coerced), [Tool.of(WEATHER)]).add("x")
    assert events[0] == Content("ok ") and isinstance(events[1], ToolCalls)
    assert [c.index for c in events[1].calls] == [0, 1] and len({c.id for c in events[1].calls}) == 2
    assert EventStream(_Fixed(Parsed()), None).add("x", ({"token": "x"},)) == [Content("", ({"token": "x"},))]


def test_a_failing_parser_loses_nothing() -> None:
    class Broken(_Fixed):
        def add(self, text: str, done: bool) -> Parsed:
            raise RuntimeError("bug")

    assert EventStream(Broken(Parsed()), None).add("text") == [Content("text")]


def test_forced_call_schema_is_read_as_bare_json() -> None:
    call_schema = pipeline.call_schema
    assert pipeline.is_call_schema(call_schema([WEATHER])) and pipeline.is_call_schema(call_schema([WEATHER, WEATHER]))
    assert not pipeline.is_call_schema({"type": "object"}) and not pipeline.is_call_schema("json")
    parser, _, _ = pipeline.output_parser(
        ChatModel(template=QWEN3), tools=[Tool.of(WEATHER)], last=None, think=False, forced_call=True
    )
    out = parser.add('{"name": "get_weather", "arguments": {"city": "Oslo"}}', True)
    assert [c.arguments for c in out.calls] == [{"city": "Oslo"}]


def test_past_thinking_is_dropped_from_earlier_turns() -> None:
    msgs = [
        Message(role="user", content="a"),
        Message(role="assistant", content="<think>long</think>answer"),
        Message(role="user", content="b"),
    ]
    out = pipeline.strip_past_thinking(ChatModel(template=QWEN3), msgs)
    assert out[1].content == "answer" and msgs[1].content.startswith("<think>")
    assert pipeline.strip_past_thinking(ChatModel(template=PLAIN), msgs) == msgs


def test_renderer_named_in_the_modelfile_is_used() -> None:
    model = ChatModel(template=PLAIN, renderer="qwen3-coder")
    text = pipeline.render(model, [Message(role="user", content="hi")], None, None)
    assert text.endswith("<|im_start|>assistant\n") and "hi" in text
    assert renderers.renderer_for("no-such") is None
    unknown = ChatModel(template="{{ range .Messages }}<<{{ .Content }}>>{{ end }}", renderer="no-such")
    assert pipeline.render(unknown, [Message(role="user", content="hi")], None, None) == "<<hi>>"


def test_typed_chat_reaches_renderer_and_template_alike() -> None:
    """The same typed chat (an image, a call with arguments out of order, its result) through a renderer and
    through a Go template: images tagged in the text, arguments as given (renderer) or sorted as Go maps are. The
    call's id is not shown (prompts never had it; the template layer shows one given to it directly)."""
    chat = [
        Message(role="user", content="Weather here? [img]", images=("AAAA",)),
        Message(
            role="assistant",
            thinking="Need weather.",
            tool_calls=(ToolCall("get_weather", {"unit": "c", "city": "Paris"}, id="call_1", index=0),),
        ),
        Message(role="tool", content="18C", tool_call_id="call_1"),
    ]
    rendered = pipeline.render(ChatModel(renderer="qwen3-vl-instruct"), chat, [Tool.of(WEATHER)], None)
    assert "<|im_start|>user\nWeather here? [img-0]<|im_end|>\n" in rendered and "call_1" not in rendered
    assert '{"name": "get_weather", "arguments": {"unit": "c", "city": "Paris"}}' in rendered
    tmpl = (
        "{{ range .Messages }}{{ .Role }}:{{ .Content }}{{ range .ToolCalls }}{{ .ID }}#{{ .Function.Index }} "
        "{{ .Function.Name }}{{ .Function.Arguments }}{{ end }}{{ .ToolCallID }};{{ end }}"
        "{{ range .Tools }}{{ .Function.Name }}{{ end }}"
    )
    assert pipeline.render(ChatModel(template=tmpl), chat, [Tool.of(WEATHER)], None) == (
        'user:Weather here? [img-0];assistant:#0 get_weather{"city":"Paris","unit":"c"};tool:18Ccall_1;get_weather'
    )


def test_message_wire_shape_round_trips() -> None:
    m = Message(
        role="assistant",
        content="x",
        thinking="t",
        images=("AAAA",),
        tool_calls=(ToolCall("f", {"a": [1, {"b": None}]}, index=2), ToolCall("g", {})),
        tool_name="n",
        tool_call_id="c",
    )
    assert Message.of(m.wire()) == m
    assert Message.of({"role": "USER", "content": 5, "tool_calls": [{"function": "bad"}]}) == Message(role="user")


def test_answer_after_thinking_is_the_parsers() -> None:
    harmony = ChatModel(parser="harmony")
    assert pipeline.answer_after_thinking(harmony) == "<|end|><|start|>assistant<|channel|>final<|message|>"
    assert pipeline.answer_after_thinking(ChatModel(template=QWEN3)) == ""
    for name in parsers.names():
        made = parsers.parser_for(name)
        assert made is not None and isinstance(made.answer_after_thinking, str), name


def test_one_registry_refuses_a_name_twice() -> None:
    from daemon.chat.parsers.base import PARSERS
    from daemon.chat.renderers.base import RENDERERS

    assert parsers.names() == PARSERS.names() and renderers.names() == RENDERERS.names()
    with pytest.raises(ValueError, match="parser 'harmony' registered twice"):
        PARSERS.register("harmony")(type(parsers.parser_for("harmony")))
    assert parsers.parser_for("harmony") is not parsers.parser_for("harmony")  # a fresh parser each time
