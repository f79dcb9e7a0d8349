"""Prompt building (daemon/templates/prompt.py): Ollama library templates, legacy templates, tools, Jinja, fallbacks.

The chats below are written in Ollama's wire shape, as Ollama's own template tests write them; the wrappers turn them
into the chat core's typed values (``Message.of``, ``Tool.of``) on the way in."""

from __future__ import annotations

import glob
import os
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest

from daemon.chat.types import Message, Tool
from daemon.templates import gotemplate, prompt
from daemon.templates.prompt import DEFAULT_TEMPLATE, TemplateError, collate, parse_template, tag_images

Wire = dict[str, Any]


def typed(messages: Iterable[Wire]) -> list[Message]:
    return [Message.of(m) for m in messages]


def render_messages(
    go: str | None, jinja_template: str | None, messages: Iterable[Wire], *, tools: list[Wire] | None = None, **kw: Any
) -> str:
    tools_typed = [Tool.of(t) for t in tools] if tools is not None else None
    return prompt.render_messages(go, jinja_template, typed(messages), tools=tools_typed, **kw)


def render_jinja(template: str, messages: Iterable[Wire], *, tools: list[Wire] | None = None, **kw: Any) -> str:
    tools_typed = [Tool.of(t) for t in tools] if tools is not None else None
    return prompt.render_jinja(template, typed(messages), tools=tools_typed, **kw)


def render_generate(
    go: str | None, jinja_template: str | None, *, messages_history: Iterable[Wire] = (), **kw: Any
) -> str:
    return prompt.render_generate(go, jinja_template, messages_history=typed(messages_history), **kw)


SYSTEM = {"role": "system", "content": "You are a helpful assistant."}
USER1 = {"role": "user", "content": "Hello, how are you?"}
ASSISTANT = {"role": "assistant", "content": "I'm doing great. How can I help you today?"}
USER2 = {"role": "user", "content": "I'd like to show off how chat templating works!"}
CHAT = [SYSTEM, USER1, ASSISTANT, USER2]

# ------------------------------------------------------------------------------------ Ollama's library templates

LLAMA3_INSTRUCT = r"""{{- range .Messages }}<|start_header_id|>{{ .Role }}<|end_header_id|>

{{ .Content }}<|eot_id|>
{{- end }}<|start_header_id|>assistant<|end_header_id|>

"""

CHATML = r"""{{- range .Messages }}<|im_start|>{{ .Role }}
{{ .Content }}<|im_end|>
{{ end }}<|im_start|>assistant
"""

MISTRAL_INSTRUCT = r"""[INST] {{ range $index, $_ := .Messages }}
{{- if eq .Role "system" }}{{ .Content }}

{{ else if eq .Role "user" }}{{ .Content }}[/INST]
{{- else if eq .Role "assistant" }} {{ .Content }}</s>[INST] {{ end }}
{{- end }}"""

GEMMA_INSTRUCT = r"""{{- $system := "" }}
{{- range .Messages }}
{{- if eq .Role "system" }}
{{- if not $system }}{{ $system = .Content }}
{{- else }}{{ $system = printf "%s\n\n%s" $system .Content }}
{{- end }}
{{- continue }}
{{- else if eq .Role "user" }}<start_of_turn>user
{{- if $system }}
{{ $system }}
{{- $system = "" }}
{{- end }}
{{- else if eq .Role "assistant" }}<start_of_turn>model
{{- end }}
{{ .Content }}<end_of_turn>
{{ end }}<start_of_turn>model
"""

PHI3 = r"""{{- range .Messages }}<|{{ .Role }}|>
{{ .Content }}<|end|>
{{ end }}<|assistant|>
"""

VICUNA = r"""{{- $system := "" }}
{{- range .Messages }}
{{- if eq .Role "system" }}
{{- if not $system }}{{ $system = .Content }}
{{- else }}{{ $system = printf "%s\n\n%s" $system .Content }}
{{- end }}
{{- else if eq .Role "user" }}
{{- if $system }}{{ $system }}

{{ $system = "" }}
{{- end }}USER: {{ .Content }}
{{ else if eq .Role "assistant" }}ASSISTANT: {{ .Content }}</s>
{{ end }}
{{- end }}ASSISTANT:"""

# The same families before Ollama moved them to .Messages: legacy .System/.Prompt/.Response templates.
LEGACY_ALPACA = r"""{{ if .System }}{{ .System }}

{{ end }}{{ if .Prompt }}### Instruction:
{{ .Prompt }}

{{ end }}### Response:
{{ .Response }}

"""

LEGACY_VICUNA = r"""{{ if .System }}{{ .System }}

{{ end }}{{ if .Prompt }}USER: {{ .Prompt }}
{{ end }}ASSISTANT: {{ .Response }}</s>
"""

LEGACY_CHATML = r"""{{ if .System }}<|im_start|>system
{{ .System }}<|im_end|>
{{ end }}{{ if .Prompt }}<|im_start|>user
{{ .Prompt }}<|im_end|>
{{ end }}<|im_start|>assistant
{{ .Response }}<|im_end|>
"""

LEGACY_LLAMA3 = r"""{{ if .System }}<|start_header_id|>system<|end_header_id|>

{{ .System }}<|eot_id|>{{ end }}{{ if .Prompt }}<|start_header_id|>user<|end_header_id|>

{{ .Prompt }}<|eot_id|>{{ end }}<|start_header_id|>assistant<|end_header_id|>

{{ .Response }}<|eot_id|>"""

EXPECTED = {
    "llama3": (
        "<|start_header_id|>system<|end_header_id|>\n\nYou are a helpful assistant.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHello, how are you?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nI'm doing great. How can I help you today?<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nI'd like to show off how chat templating works!<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    ),
    "chatml": (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nHello, how are you?<|im_end|>\n"
        "<|im_start|>assistant\nI'm doing great. How can I help you today?<|im_end|>\n"
        "<|im_start|>user\nI'd like to show off how chat templating works!<|im_end|>\n"
        "<|im_start|>assistant\n"
    ),
    "mistral": (
        "[INST] You are a helpful assistant.\n\nHello, how are you?[/INST] I'm doing great. How can I help you "
        "today?</s>[INST] I'd like to show off how chat templating works![/INST]"
    ),
    "gemma": (
        "<start_of_turn>user\nYou are a helpful assistant.\nHello, how are you?<end_of_turn>\n"
        "<start_of_turn>model\nI'm doing great. How can I help you today?<end_of_turn>\n"
        "<start_of_turn>user\nI'd like to show off how chat templating works!<end_of_turn>\n"
        "<start_of_turn>model\n"
    ),
    "phi3": (
        "<|system|>\nYou are a helpful assistant.<|end|>\n<|user|>\nHello, how are you?<|end|>\n"
        "<|assistant|>\nI'm doing great. How can I help you today?<|end|>\n"
        "<|user|>\nI'd like to show off how chat templating works!<|end|>\n<|assistant|>\n"
    ),
    "vicuna": (
        "You are a helpful assistant.\n\nUSER: Hello, how are you?\n"
        "ASSISTANT: I'm doing great. How can I help you today?</s>\n"
        "USER: I'd like to show off how chat templating works!\nASSISTANT:"
    ),
    "alpaca": (
        "You are a helpful assistant.\n\n### Instruction:\nHello, how are you?\n\n"
        "### Response:\nI'm doing great. How can I help you today?\n\n"
        "### Instruction:\nI'd like to show off how chat templating works!\n\n### Response:\n"
    ),
}


@pytest.mark.parametrize(
    ("template", "expected"),
    [
        (LLAMA3_INSTRUCT, EXPECTED["llama3"]),
        (CHATML, EXPECTED["chatml"]),
        (MISTRAL_INSTRUCT, EXPECTED["mistral"]),
        (GEMMA_INSTRUCT, EXPECTED["gemma"]),
        (PHI3, EXPECTED["phi3"]),
        (VICUNA, EXPECTED["vicuna"]),
        # legacy templates: one execution per turn, the last cut after .Response
        (LEGACY_ALPACA, EXPECTED["alpaca"]),
        (LEGACY_VICUNA, EXPECTED["vicuna"] + " "),
        (LEGACY_CHATML, EXPECTED["chatml"]),
        (LEGACY_LLAMA3, EXPECTED["llama3"]),
    ],
    ids=[
        "llama3",
        "chatml",
        "mistral",
        "gemma",
        "phi3",
        "vicuna",
        "legacy-alpaca",
        "legacy-vicuna",
        "legacy-chatml",
        "legacy-llama3",
    ],
)
def test_library_templates(template: str, expected: str) -> None:
    assert render_messages(template, None, CHAT) == expected


@pytest.mark.parametrize("template", [LLAMA3_INSTRUCT, CHATML, GEMMA_INSTRUCT, PHI3, LEGACY_CHATML, LEGACY_LLAMA3])
def test_legacy_and_modern_forms_agree_without_system(template: str) -> None:
    modern = {LEGACY_CHATML: CHATML, LEGACY_LLAMA3: LLAMA3_INSTRUCT}.get(template, template)
    assert render_messages(template, None, [USER1]) == render_messages(modern, None, [USER1])
    assert render_messages(template, None, [USER1, ASSISTANT, USER2]) == render_messages(
        modern, None, [USER1, ASSISTANT, USER2]
    )


MISTRAL_LEGACY = "[INST] {{ if .System }}{{ .System }}\n\n{{ end }}{{ .Prompt }}[/INST] "


@pytest.mark.parametrize(
    "template",
    [
        MISTRAL_LEGACY,  # no .Response: the parse-time fix-up appends one
        MISTRAL_LEGACY + "{{ .Response }}",
        '[INST] {{ if .System }}{{ .System }}\n\n{{ end }}\n{{- range .Messages }}\n{{- if eq .Role "user" }}'
        '{{ .Content }}[/INST] {{ else if eq .Role "assistant" }}{{ .Content }}[INST] {{ end }}\n{{- end }}',
    ],
)
def test_modern_and_legacy_execution_match(template: str) -> None:
    msgs = [
        {"role": "user", "content": "Hello friend!"},
        {"role": "assistant", "content": "Hello human!"},
        {"role": "user", "content": "What is your name?"},
    ]
    assert (
        render_messages(template, None, msgs)
        == "[INST] Hello friend![/INST] Hello human![INST] What is your name?[/INST] "
    )
    assert (
        render_messages(template, None, [{"role": "system", "content": "Be kind."}, *msgs])
        == "[INST] Be kind.\n\nHello friend![/INST] Hello human![INST] What is your name?[/INST] "
    )


def test_legacy_last_assistant_message_is_continued() -> None:
    msgs = [
        {"role": "user", "content": "Hello friend!"},
        {"role": "assistant", "content": "Hello human!"},
        {"role": "user", "content": "What is your name?"},
        {"role": "assistant", "content": "My name is Ollama and I"},
    ]
    expected = "[INST] Hello friend![/INST] Hello human!</s>[INST] What is your name?[/INST] My name is Ollama and I"
    assert render_messages("[INST] {{ .Prompt }}[/INST] {{ .Response }}</s>", None, msgs) == expected


def test_parse_time_fixup_appends_response() -> None:
    assert parse_template("{{ .System }} {{ .Prompt }}").uses("Response")
    assert not parse_template("{{ range .Messages }}{{ end }}").uses("Response")
    msgs = [USER1, ASSISTANT, USER2]
    assert (
        render_messages("{{ .Prompt }}", None, msgs)
        == "Hello, how are you?I'm doing great. How can I help you today?I'd like to show off how chat templating works!"
    )


def test_collate_merges_consecutive_roles_except_tools() -> None:
    msgs = [
        {"role": "system", "content": "You are helpful"},
        {"role": "system", "content": "Be brief"},
        {"role": "user", "content": "Hello"},
        {"role": "user", "content": "How are you?"},
        {"role": "tool", "content": "sunny", "tool_name": "get_weather"},
        {"role": "tool", "content": "72F", "tool_name": "get_temperature"},
    ]
    given = typed(msgs)
    system, out = collate(given)
    assert system == "You are helpful\n\nBe brief"
    assert [(m.role, m.content) for m in out] == [
        ("system", "You are helpful\n\nBe brief"),
        ("user", "Hello\n\nHow are you?"),
        ("tool", "sunny"),
        ("tool", "72F"),
    ]
    assert out[3].tool_name == "get_temperature"
    assert given[2].content == "Hello"  # input untouched (the values are frozen)
    # roles reach Go templates lowercased, and a merged message keeps the first one's other fields
    _, shouted = collate([Message(role="USER", content="a", thinking="t"), Message(role="user", content="b")])
    assert shouted == [Message(role="user", content="a\n\nb", thinking="t")]
    tmpl = (
        "{{ .System }}|{{ range .Messages }}{{ .Role }}:{{ .Content }}{{ with .ToolName }}({{ . }}){{ end }};{{ end }}"
    )
    assert render_messages(tmpl, None, msgs) == (
        "You are helpful\n\nBe brief|system:You are helpful\n\nBe brief;user:Hello\n\nHow are you?;"
        "tool:sunny(get_weather);tool:72F(get_temperature);"
    )


# ------------------------------------------------------------------------------------ tools

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the weather <now>",
        "parameters": {
            "type": "object",
            "required": ["city"],
            "properties": {
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"], "default": "celsius"},
                "city": {"type": "string", "description": "The city"},
            },
        },
    },
}
TOOL_JSON = (
    '{"type":"function","function":{"name":"get_weather","description":"Get the weather \\u003cnow\\u003e",'
    '"parameters":{"type":"object","required":["city"],"properties":{"city":{"type":"string",'
    '"description":"The city"},"unit":{"type":"string","enum":["celsius","fahrenheit"]}}}}}'
)
CALL = {
    "role": "assistant",
    "content": "",
    "tool_calls": [{"function": {"name": "get_weather", "arguments": {"unit": "celsius", "city": "Paris"}}}],
}
TOOL_RESULT = {"role": "tool", "content": "22 degrees", "tool_name": "get_weather"}

# ollama.com's mistral (v0.3) template
MISTRAL_TOOLS = r"""{{- if .Messages }}
{{- range $index, $_ := .Messages }}
{{- if eq .Role "user" }}
{{- if and (eq (len (slice $.Messages $index)) 1) $.Tools }}[AVAILABLE_TOOLS] {{ $.Tools }}[/AVAILABLE_TOOLS]
{{- end }}[INST] {{ if and $.System (eq (len (slice $.Messages $index)) 1) }}{{ $.System }}

{{ end }}{{ .Content }}[/INST]
{{- else if eq .Role "assistant" }}
{{- if .Content }} {{ .Content }}
{{- else if .ToolCalls }}[TOOL_CALLS] [
{{- range .ToolCalls }}{"name": "{{ .Function.Name }}", "arguments": {{ .Function.Arguments }}}
{{- end }}]
{{- end }}</s>
{{- else if eq .Role "tool" }}[TOOL_RESULTS] {"content": {{ .Content }}} [/TOOL_RESULTS]
{{- end }}
{{- end }}
{{- else }}[INST] {{ if .System }}{{ .System }}

{{ end }}{{ .Prompt }}[/INST]
{{- end }} {{ .Response }}
{{- if .Response }}</s>
{{- end }}"""

# ollama.com's llama3.1 template
LLAMA31_TOOLS = r"""{{- if or .System .Tools }}<|start_header_id|>system<|end_header_id|>
{{- if .System }}

{{ .System }}
{{- end }}
{{- if .Tools }}

Cutting Knowledge Date: December 2023

When you receive a tool call response, use the output to format an answer to the orginal user question.

You are a helpful assistant with tool calling capabilities.
{{- end }}<|eot_id|>
{{- end }}
{{- range $i, $_ := .Messages }}
{{- $last := eq (len (slice $.Messages $i)) 1 }}
{{- if eq .Role "user" }}<|start_header_id|>user<|end_header_id|>
{{- if and $.Tools $last }}

Given the following functions, please respond with a JSON for a function call with its proper arguments that best answers the given prompt.

Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}. Do not use variables.

{{ range $.Tools }}
{{- . }}
{{ end }}
Question: {{ .Content }}<|eot_id|>
{{- else }}

{{ .Content }}<|eot_id|>
{{- end }}{{ if $last }}<|start_header_id|>assistant<|end_header_id|>

{{ end }}
{{- else if eq .Role "assistant" }}<|start_header_id|>assistant<|end_header_id|>
{{- if .ToolCalls }}

{{ range .ToolCalls }}
{"name": "{{ .Function.Name }}", "parameters": {{ .Function.Arguments }}}{{ end }}
{{- else }}

{{ .Content }}
{{- end }}{{ if not $last }}<|eot_id|>{{ end }}
{{- else if eq .Role "tool" }}<|start_header_id|>ipython<|end_header_id|>

{{ .Content }}<|eot_id|>{{ if $last }}<|start_header_id|>assistant<|end_header_id|>

{{ end }}
{{- end }}
{{- end }}"""

LLAMA31_SYSTEM = (
    "<|start_header_id|>system<|end_header_id|>\n\nYou are a bot.\n\nCutting Knowledge Date: December 2023\n\n"
    "When you receive a tool call response, use the output to format an answer to the orginal user question.\n\n"
    "You are a helpful assistant with tool calling capabilities.<|eot_id|>"
)


def test_mistral_tools_template() -> None:
    msgs = [
        {"role": "system", "content": "You are a bot."},
        {"role": "user", "content": "Weather in Paris?"},
        CALL,
        TOOL_RESULT,
        {"role": "user", "content": "And in Tokyo?"},
    ]
    assert render_messages(MISTRAL_TOOLS, None, msgs, tools=[WEATHER_TOOL]) == (
        "[INST] Weather in Paris?[/INST]"
        '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city":"Paris","unit":"celsius"}}]</s>'
        '[TOOL_RESULTS] {"content": 22 degrees} [/TOOL_RESULTS]'
        f"[AVAILABLE_TOOLS] [{TOOL_JSON}][/AVAILABLE_TOOLS]"
        "[INST] You are a bot.\n\nAnd in Tokyo?[/INST] "
    )
    # /api/generate against the same template (legacy .Prompt branch is not taken: .Messages is used)
    assert render_generate(MISTRAL_TOOLS, None, prompt="Hi", system="Sys") == "[INST] Sys\n\nHi[/INST] "


def test_llama31_tools_template() -> None:
    question = [{"role": "system", "content": "You are a bot."}, {"role": "user", "content": "Weather in Paris?"}]
    assert render_messages(LLAMA31_TOOLS, None, question, tools=[WEATHER_TOOL]) == (
        LLAMA31_SYSTEM + "<|start_header_id|>user<|end_header_id|>\n\n"
        "Given the following functions, please respond with a JSON for a function call with its proper arguments "
        'that best answers the given prompt.\n\nRespond in the format {"name": function name, "parameters": '
        "dictionary of argument name and its value}. Do not use variables.\n\n"
        f"{TOOL_JSON}\n\nQuestion: Weather in Paris?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    result = [*question, CALL, {**TOOL_RESULT, "content": "22C"}]
    assert render_messages(LLAMA31_TOOLS, None, result, tools=[WEATHER_TOOL]) == (
        LLAMA31_SYSTEM + "<|start_header_id|>user<|end_header_id|>\n\nWeather in Paris?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n\n"
        '{"name": "get_weather", "parameters": {"city":"Paris","unit":"celsius"}}<|eot_id|>'
        "<|start_header_id|>ipython<|end_header_id|>\n\n22C<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    # without tools the tools-only parts disappear
    assert (
        render_messages(LLAMA31_TOOLS, None, [{"role": "user", "content": "Hi"}])
        == "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
    )


def test_tool_fields_seen_by_templates() -> None:
    tmpl = (
        "{{ range .Tools }}{{ .Type }} {{ .Function.Name }}: {{ .Function.Description }} "
        "{{ .Function.Parameters.Required }} {{ range $name, $p := .Function.Parameters.Properties }}"
        "{{ $name }}:{{ $p.Type }}/{{ toTypeScriptType $p }} {{ end }}| {{ json .Function }}{{ end }}"
        "{{ range .Messages }}{{ range .ToolCalls }} {{ .Function.Index }}{{ .Function.Name }}"
        "{{ range $k, $v := .Function.Arguments }} {{ $k }}={{ $v }}{{ end }}{{ end }}{{ end }}"
    )
    function_json = TOOL_JSON[len('{"type":"function","function":') : -1]
    assert render_messages(tmpl, None, [CALL], tools=[WEATHER_TOOL]) == (
        "function get_weather: Get the weather <now> [city] city:string/string unit:string/string | "
        f"{function_json} 0get_weather city=Paris unit=celsius"
    )
    # qwen2.5-style `{{ .Function }}` prints the function as JSON
    assert (
        render_messages(
            "{{ range .Messages }}{{ end }}{{ range .Tools }}{{ .Function }}{{ end }}",
            None,
            [USER1],
            tools=[WEATHER_TOOL],
        )
        == function_json
    )
    assert (
        render_messages("{{ range .Messages }}{{ end }}{{ if .Tools }}yes{{ else }}no{{ end }}", None, [USER1]) == "no"
    )


def test_think_fields() -> None:
    tmpl = "{{ range .Messages }}{{ end }}{{ .Think }}|{{ .ThinkLevel }}|{{ .IsThinkSet }}"
    assert render_messages(tmpl, None, [USER1]) == "false||false"
    assert render_messages(tmpl, None, [USER1], think=True) == "true|medium|true"
    assert render_messages(tmpl, None, [USER1], think=False) == "false||true"
    assert render_messages(tmpl, None, [USER1], think="high") == "true|high|true"


def test_thinking_and_tool_call_ids_reach_messages() -> None:
    msg = {
        "role": "assistant",
        "content": "4",
        "thinking": "2+2",
        "tool_calls": [{"id": "call_abc", "function": {"index": 3, "name": "f", "arguments": {"x": 1}}}],
    }
    tmpl = (
        "{{ range .Messages }}<think>{{ .Thinking }}</think>{{ range .ToolCalls }}{{ .ID }}#{{ .Function.Index }}"
        "{{ .Function.Arguments }}{{ end }}{{ .Content }}{{ end }}"
    )
    assert render_messages(tmpl, None, [msg]) == '<think>2+2</think>call_abc#3{"x":1}4'


def test_images_become_tags() -> None:
    msgs = [
        {"role": "user", "content": "what is this?", "images": ["AAAA"]},
        {"role": "assistant", "content": "a cat"},
        {"role": "user", "content": "compare [img] with this", "images": ["BBBB", "CCCC"]},
    ]
    tagged = tag_images(typed(msgs))
    assert [m.content for m in tagged] == ["[img-0]what is this?", "a cat", "[img-2]compare [img-1] with this"]
    assert [m.images for m in tagged] == [("AAAA",), (), ("BBBB", "CCCC")]  # the images stay with their message
    tmpl = "{{ range .Messages }}{{ .Content }}{{ if .Images }}({{ len .Images }}){{ end }};{{ end }}"
    assert render_messages(tmpl, None, msgs) == "[img-0]what is this?(1);a cat;[img-2]compare [img-1] with this(2);"
    assert (
        render_generate(CHATML, None, prompt="describe", images=["AAAA"])
        == "<|im_start|>user\n[img-0]describe<|im_end|>\n<|im_start|>assistant\n"
    )


# ------------------------------------------------------------------------------------ /api/generate


def test_generate_builds_system_history_prompt() -> None:
    history = [{"role": "user", "content": "Hello, how are you?"}, ASSISTANT]
    assert (
        render_generate(CHATML, None, prompt=USER2["content"], system=SYSTEM["content"], messages_history=history)
        == EXPECTED["chatml"]
    )
    assert (
        render_generate(
            LEGACY_ALPACA, None, prompt=USER2["content"], system=SYSTEM["content"], messages_history=history
        )
        == EXPECTED["alpaca"]
    )
    assert render_generate("{{ .System }} {{ .Prompt }}", None, prompt="p", system="s") == "s p"


def test_generate_without_any_template_is_the_raw_prompt() -> None:
    assert DEFAULT_TEMPLATE == "{{ .Prompt }}"
    assert (
        render_generate(None, None, prompt="The capital of France is", system="ignored") == "The capital of France is"
    )


def test_generate_with_suffix() -> None:
    tmpl = "{{- if .Suffix }}<PRE> {{ .Prompt }} <SUF>{{ .Suffix }} <MID>\n{{- else }}{{ .Prompt }}\n{{- end }}"
    assert render_generate(tmpl, None, prompt="def add(", suffix="return x") == "<PRE> def add( <SUF>return x <MID>"
    assert render_generate(tmpl, None, prompt="hello") == "hello"
    assert render_messages(tmpl, None, [{"role": "user", "content": "hello"}]) == "hello"


def test_plain_fallback() -> None:
    assert render_messages(None, None, CHAT) == (
        "system: You are a helpful assistant.\nuser: Hello, how are you?\n"
        "assistant: I'm doing great. How can I help you today?\n"
        "user: I'd like to show off how chat templating works!\nassistant: "
    )


def test_legacy_turns_share_one_step_budget() -> None:
    turns = [{"role": r, "content": "x"} for _ in range(400) for r in ("user", "assistant")]
    slow = "{{ range 5000 }}{{ end }}{{ .Prompt }}{{ .Response }}"
    # one turn (5000 steps and a few) is far inside the budget, and so is each of the 400: only their sum passes it
    assert 5000 * 2 < gotemplate.MAX_STEPS < 5000 * 400
    assert render_messages(slow, None, turns[:2]) == "xx"
    with pytest.raises(TemplateError, match="steps"):
        render_messages(slow, None, turns)


def test_template_errors() -> None:
    with pytest.raises(TemplateError, match=r"template: 1:\d+: unexpected EOF"):
        render_messages("{{ range .Messages }}", None, CHAT)
    with pytest.raises(TemplateError, match="index out of range"):
        render_messages("{{ range .Messages }}{{ index $.Messages 99 }}{{ end }}", None, CHAT)


# ------------------------------------------------------------------------------------ Jinja (GGUF chat templates)

# SmolLM2-Instruct's tokenizer.chat_template (used when no GGUF is cached locally)
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _smollm2_gguf() -> Path | None:
    try:
        from tests.models import smollm2_path  # type: ignore[attr-defined]

        path = smollm2_path()
        return Path(path) if path and Path(path).exists() else None
    except Exception:  # noqa: BLE001 - the helper may not exist or may not have the file
        pass
    cache = os.environ.get("CORRAL_TEST_CACHE") or os.path.expanduser("~/.cache/corral-test")
    found = sorted(p for p in glob.glob(os.path.join(cache, "*.gguf")) if "smollm" in p.lower())
    return Path(found[0]) if found else None


def _llama_cpp_render(template: str, messages: list[dict[str, Any]], bos: str = "", eos: str = "") -> str:
    formatter = pytest.importorskip("llama_cpp.llama_chat_format")
    return str(formatter.Jinja2ChatFormatter(template, eos_token=eos, bos_token=bos)(messages=messages).prompt)


@pytest.mark.parametrize("messages", [CHAT, [USER1], [USER1, ASSISTANT, USER2]], ids=["system", "user", "turns"])
def test_jinja_smollm2_matches_llama_cpp(messages: list[dict[str, Any]]) -> None:
    ours = render_messages(None, SMOLLM2_TEMPLATE, messages, bos_token="<|im_start|>", eos_token="<|im_end|>")
    assert ours == _llama_cpp_render(SMOLLM2_TEMPLATE, messages, "<|im_start|>", "<|im_end|>")
    if messages is CHAT:
        assert ours == EXPECTED["chatml"]
    else:
        assert ours.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")


@pytest.mark.real_model
def test_jinja_template_from_the_smollm2_gguf() -> None:
    path = _smollm2_gguf()
    if path is None:
        pytest.skip("SmolLM2 GGUF not cached (scripts/fetch_smollm2.py)")
    gguf = pytest.importorskip("gguf")
    field = gguf.GGUFReader(str(path)).fields["tokenizer.chat_template"]
    template = bytes(field.parts[field.data[0]]).decode("utf-8")
    for messages in (CHAT, [USER1]):
        assert render_messages(None, template, messages) == _llama_cpp_render(template, messages)


def test_jinja_features() -> None:
    tmpl = (
        "{{ bos_token }}{% for m in messages %}{% if m.role == 'assistant' and m.tool_calls %}"
        "{{ m.tool_calls[0].function.name }}{{ m.tool_calls[0].function.arguments | tojson }}"
        "{% elif m.role == 'tool' %}[{{ m.name }}:{{ m.content }}]{% else %}{{ m.content }}{% endif %}"
        "{% endfor %}{% if tools %}{{ tools | length }} tools{% endif %}"
        "{% if enable_thinking is defined %} think={{ enable_thinking }}{% endif %}{{ eos_token }}"
    )
    out = render_messages(
        None, tmpl, [USER1, CALL, TOOL_RESULT], tools=[WEATHER_TOOL], think=True, bos_token="<s>", eos_token="</s>"
    )
    assert (
        out == '<s>Hello, how are you?get_weather{"city": "Paris", "unit": "celsius"}'
        "[get_weather:22 degrees]1 tools think=True</s>"
    )
    assert (
        render_messages(
            None,
            "{% generation %}x{% endgeneration %}{% for i in range(3) %}{% if i == 1 %}"
            "{% break %}{% endif %}{{ i }}{% endfor %}",
            [USER1],
        )
        == "x0"
    )


@pytest.mark.parametrize(
    ("template", "message"),
    [
        ("{% for %}", "chat template: line 1"),
        ("{{ raise_exception('Conversation roles must alternate') }}", "Conversation roles must alternate"),
        ("{{ messages.__class__.__mro__ }}", "chat template"),
        ("{{ 'x' * 10**10 }}", "repetition too large"),
        ("{{ 2 ** 100000000 }}", "exponent too large"),
        ("{{ messages.append(1) }}", "chat template"),
    ],
)
def test_jinja_errors(template: str, message: str) -> None:
    with pytest.raises(TemplateError, match=message):
        render_messages(None, template, [USER1])


def test_jinja_runaway_templates_are_stopped() -> None:
    # A range past the sandbox's limit is refused before the loop starts.
    with pytest.raises(TemplateError, match="Range too big"):
        render_messages(None, "{% for i in range(10**12) %}x{% endfor %}", [USER1])
    # A loop that writes 10 KB a turn passes the output bound (8M characters) at its 839th turn, in a few ms and
    # long before any deadline: a size check.
    with pytest.raises(TemplateError, match="output too large"):
        render_jinja("{% for i in range(100000) %}{{ 'x' * 10000 }}{% endfor %}", [USER1])
    # A loop that writes nothing is stopped by the deadline alone, which is a time: the message names it, and the
    # render returns near it (the sandbox waits the deadline plus 1 s at most; the bound is generous for a busy CI).
    spin = (
        "{% for i in range(100000) %}{% for j in range(100000) %}{% if i == j - 1 %}{% endif %}{% endfor %}{% endfor %}"
    )
    start = time.monotonic()
    with pytest.raises(TemplateError, match="longer than 0.5s"):
        render_jinja(spin, [USER1], timeout=0.5)
    assert time.monotonic() - start < 0.5 + 1.0 + 3.0


def test_jinja_renders_reuse_their_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    """A render runs on a thread kept for renders, not on one started for it (~0.3 ms of every chat's time to its
    first token on 2 cores); a render stuck past its deadline retires that pool, and renders go on."""
    import threading

    started: list[str] = []
    original = threading.Thread.start

    def counting(self: threading.Thread) -> None:
        started.append(self.name)
        original(self)

    monkeypatch.setattr(threading.Thread, "start", counting)
    for _ in range(20):
        assert render_jinja("{% for m in messages %}[{{ m.content }}]{% endfor %}", [USER1]).startswith("[")
    assert len([n for n in started if n.startswith("corral-chat-template")]) <= 1
