"""Inferring thinking tags and the tool-call tag from chat templates (Go and Jinja)."""

from __future__ import annotations

import pytest

from daemon.chat.infer import infer_think_tags, infer_think_tags_jinja, infer_tool_tag, infer_tool_tag_jinja

QWEN3_SIMPLE = """{{- range .Messages }}<|im_start|>{{ .Role }}
{{ if .Thinking }}<think>{{ .Thinking }}</think>{{ end }}{{ .Content }}<|im_end|>
{{ end }}<|im_start|>assistant
"""

QWEN3 = """{{- if .Messages }}
{{- if or .System .Tools }}<|im_start|>system
{{- if .System }}
{{ .System }}
{{- end }}
{{- if .Tools }}

# Tools

You may call one or more functions. Function signatures are inside <tools></tools>:
<tools>
{{- range .Tools }}
{"type": "function", "function": {{ .Function }}}
{{- end }}
</tools>

Answer each call with a JSON object inside <tool_call></tool_call> tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call>
{{- end }}<|im_end|>
{{ end }}
{{- range $i, $_ := .Messages }}
{{- $last := eq (len (slice $.Messages $i)) 1 -}}
{{- if eq .Role "user" }}<|im_start|>user
{{ .Content }}<|im_end|>
{{ else if eq .Role "assistant" }}<|im_start|>assistant
{{ if (and $.IsThinkSet (and .Thinking $last)) -}}
<think>{{ .Thinking }}</think>
{{ end -}}
{{ if .Content }}{{ .Content }}
{{- else if .ToolCalls }}<tool_call>
{{ range .ToolCalls }}{"name": "{{ .Function.Name }}", "arguments": {{ .Function.Arguments }}}
{{ end }}</tool_call>
{{- end }}{{ if not $last }}<|im_end|>
{{ end }}
{{- else if eq .Role "tool" }}<|im_start|>user
<tool_response>
{{ .Content }}
</tool_response><|im_end|>
{{ end }}
{{- if and (ne .Role "assistant") $last }}<|im_start|>assistant
{{ end }}
{{- end }}
{{- else }}
{{- if .System }}<|im_start|>system
{{ .System }}<|im_end|>
{{ end }}{{ if .Prompt }}<|im_start|>user
{{ .Prompt }}<|im_end|>
{{ end }}<|im_start|>assistant
{{ end }}{{ .Response }}{{ if .Response }}<|im_end|>{{ end }}"""

DEEPSEEK_R1 = """{{- if .System }}{{ .System }}{{ end }}
{{- range $i, $_ := .Messages }}
{{- $last := eq (len (slice $.Messages $i)) 1}}
{{- if eq .Role "user" }}<｜User｜>{{ .Content }}
{{- else if eq .Role "assistant" }}<｜Assistant｜>
  {{- if and $.IsThinkSet (and $last .Thinking) -}}
<think>
{{ .Thinking }}
</think>
  {{- end }}{{ .Content }}{{- if not $last }}<｜end▁of▁sentence｜>{{- end }}
{{- end }}
{{- if and $last (ne .Role "assistant") }}<｜Assistant｜>
{{- if and $.IsThinkSet (not $.Think) -}}
<think>

</think>

{{ end }}
{{- end -}}
{{- end }}"""

LLAMA31 = """{{- range $i, $_ := .Messages }}
{{- $last := eq (len (slice $.Messages $i)) 1 }}
{{- if eq .Role "user" }}<|start_header_id|>user<|end_header_id|>

{{ .Content }}<|eot_id|>{{ if $last }}<|start_header_id|>assistant<|end_header_id|>

{{ end }}
{{- else if eq .Role "assistant" }}<|start_header_id|>assistant<|end_header_id|>
{{- if .ToolCalls }}
{{ range .ToolCalls }}{"name": "{{ .Function.Name }}", "parameters": {{ .Function.Arguments }}}{{ end }}
{{- else }}

{{ .Content }}
{{- end }}{{ if not $last }}<|eot_id|>{{ end }}
{{- end }}
{{- end }}"""

MISTRAL = """{{- range $index, $_ := .Messages }}
{{- if eq .Role "user" }}[INST] {{ .Content }}[/INST]
{{- else if eq .Role "assistant" }}
{{- if .Content }} {{ .Content }}</s>
{{- else if .ToolCalls }}[TOOL_CALLS] [
{{- range .ToolCalls }}{"name": "{{ .Function.Name }}", "arguments": {{ json .Function.Arguments }}}
{{- end }}]</s>
{{- end }}
{{- end }}
{{- end }}"""


@pytest.mark.parametrize(
    ("template", "tags"),
    [
        (QWEN3_SIMPLE, ("<think>", "</think>")),
        (QWEN3, ("<think>", "</think>")),
        (DEEPSEEK_R1, ("<think>", "</think>")),
        (LLAMA31, ("", "")),
        (MISTRAL, ("", "")),
        ("{{ .Prompt }}", ("", "")),
        ("", ("", "")),
        ("{{ if .Broken", ("", "")),
        # .Thinking outside a range over .Messages does not count
        ("{{ if .Thinking }}<think>{{ .Thinking }}</think>{{ end }}", ("", "")),
        ("{{ range .Tools }}<t>{{ .Thinking }}</t>{{ end }}", ("", "")),
        # custom tags, and the tags are trimmed
        (
            "{{ range .Messages }}{{ if .Thinking }}\n[THINK] {{ .Thinking }} [/THINK]\n{{ end }}{{ end }}",
            ("[THINK]", "[/THINK]"),
        ),
        # a body that does not end in text keeps the closing tag empty
        ("{{ range .Messages }}{{ with .Thinking }}<r>{{ . }}{{ $.Thinking }}{{ end }}{{ end }}", ("", "")),
    ],
)
def test_infer_think_tags(template: str, tags: tuple[str, str]) -> None:
    assert infer_think_tags(template) == tags


def test_later_reference_wins() -> None:
    # The `if` pipe's .Thinking sees the message body (first text "A", no closing text); the inner one overwrites.
    template = "{{ range .Messages }}A{{ if .Thinking }}<x>{{ .Thinking }}</x>{{ end }}{{ end }}"
    assert infer_think_tags(template) == ("<x>", "</x>")
    template = "{{ range .Messages }}A{{ if .Thinking }}{{ .Thinking }}{{ end }}B{{ end }}"
    assert infer_think_tags(template) == ("A", "B")


@pytest.mark.parametrize(
    ("template", "tag"),
    [
        (QWEN3, "<tool_call>"),
        (LLAMA31, "{"),
        (MISTRAL, "[TOOL_CALLS] ["),
        (DEEPSEEK_R1, "{"),
        ("", "{"),
        ("{{ if .Broken", "{"),
        ("{{if .ToolCalls}}{{end}}", "{"),
        ("{{if .ToolCalls}}{{range .ToolCalls}}{{ . }}{{end}}{{end}}", "{"),
        ("{{if .ToolCalls}}```json\n{{end}}", "```json"),
        ("{{if .ToolCalls}}[{{range .ToolCalls}}{{ . }}{{end}}]{{end}}", "["),
        ("{{if .ToolCalls}}\n [ {{range .ToolCalls}}{{ . }}{{end}}]{{end}}", "["),
        ("{{if .ToolCalls}}{{range .ToolCalls}}{{ . }}{{end}}]{{end}}", "{"),
        ('{{if .ToolCalls}}{{range .ToolCalls}}\r\n{"name": "{{ .Function.Name }}"}{{end}}{{end}}', "{"),
        (
            "{{if .ToolCalls}}\n{{range .ToolCalls}}<tool_call>"
            '{"name": "{{ .Function.Name }}"}</tool_call>{{end}}{{end}}',
            "<tool_call>",
        ),
        ("{{if .ToolCalls}}First text{{if .Something}}inner{{end}}Second text{{end}}", "First text"),
        ("{{if .ToolCalls}}{{if .Something}}inner{{end}}outer{{end}}", "inner"),
        ("{{if .ToolCalls}}{{ .Content }}after{{end}}", "{"),
        ("{{if .ToolCalls}}<|python_tag|>{{range .ToolCalls}}{}{{end}}{{end}}", "<|python_tag|>"),
        (
            '{{ range .Messages }}{{ if eq .Role "x" }}{{ else if .ToolCalls }}[TOOL_CALLS]{{ end }}{{ end }}',
            "[TOOL_CALLS]",
        ),
        ("{{ with .ToolCalls }}<tool_call>{{ end }}", "{"),  # Ollama looks at `if` only
    ],
)
def test_infer_tool_tag(template: str, tag: str) -> None:
    assert infer_tool_tag(template) == tag


@pytest.mark.parametrize(
    ("src", "tags"),
    [
        (
            "{%- if message.reasoning_content %}"
            "{{ '<think>\\n' + message.reasoning_content + '\\n</think>' }}{% endif %}",
            ("<think>", "</think>"),
        ),
        ("{%- if enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}{%- endif %}", ("<think>", "</think>")),
        ("{{ '[THINK]' + m.thinking + '[/THINK]' }}", ("[THINK]", "[/THINK]")),
        ("{% for m in messages %}{{ m.content }}{% endfor %}", ("", "")),
        ("{{ content.split('</think>')[-1] }}", ("", "")),
    ],
)
def test_infer_think_tags_jinja(src: str, tags: tuple[str, str]) -> None:
    assert infer_think_tags_jinja(src) == tags


@pytest.mark.parametrize(
    ("src", "tag"),
    [
        ("{{- '<tool_call>\\n' + tool_call | tojson + '\\n</tool_call>' }}", "<tool_call>"),
        ("{{- '[TOOL_CALLS]' + calls | tojson }}", "[TOOL_CALLS]"),
        ("{{- '<|python_tag|>' + call }}", "<|python_tag|>"),
        ("{% for m in messages %}{{ m.content }}{% endfor %}", "{"),
    ],
)
def test_infer_tool_tag_jinja(src: str, tag: str) -> None:
    assert infer_tool_tag_jinja(src) == tag
