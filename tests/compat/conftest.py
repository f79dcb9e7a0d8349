"""One daemon for the /v1 tests, with SmolLM2 as "smol", a tool-capable variant as "smol-tools", a thinking one as
"smol-think" and one with Qwen-style ``<tool_call>`` tags as "smol-hermes"."""

from __future__ import annotations

from collections.abc import Iterator

import ollama
import pytest

from tests.conftest import Daemon, start_daemon, stop_daemon
from tests.models import smollm2_path

SMOL = smollm2_path()

# A ChatML template that offers tools and renders tool calls and results (SmolLM2's own has no tools).
TOOLS_TEMPLATE = """{{- if or .System .Tools }}<|im_start|>system
{{ if .System }}{{ .System }}
{{ end }}{{ if .Tools }}You can call these tools. To call one, answer only with JSON {"name": ..., "arguments": {...}}.
{{ range .Tools }}{{ json . }}
{{ end }}{{ end }}<|im_end|>
{{ end }}{{ range .Messages }}{{ if eq .Role "tool" }}<|im_start|>user
The tool answered: {{ .Content }}<|im_end|>
{{ else if .ToolCalls }}<|im_start|>assistant
{{ range .ToolCalls }}{"name": "{{ .Function.Name }}", "arguments": {{ json .Function.Arguments }}}{{ end }}<|im_end|>
{{ else }}<|im_start|>{{ .Role }}
{{ .Content }}<|im_end|>
{{ end }}{{ end }}<|im_start|>assistant
"""


# ChatML with thinking as Qwen3's Ollama template writes it: past thinking inside <think>...</think> in the range
# over .Messages (so the tags are inferred), and a generation prompt that opens <think> when think is on.
THINK_TEMPLATE = """{{- if .System }}<|im_start|>system
{{ .System }}<|im_end|>
{{ end }}{{- range .Messages }}<|im_start|>{{ .Role }}
{{ if .Thinking }}<think>{{ .Thinking }}</think>{{ end }}{{ .Content }}<|im_end|>
{{ end }}<|im_start|>assistant
{{ if .Think }}<think>{{ end }}"""

# ChatML with tools as Qwen/Hermes templates write them: a call is <tool_call>{json}</tool_call>, the tag inferred
# from the text that opens the ``if .ToolCalls`` branch.
HERMES_TEMPLATE = """<|im_start|>system
{{ if .System }}{{ .System }}{{ end }}{{ if .Tools }}
You may call tools. Tools: {{ range .Tools }}{{ json .Function }}{{ end }}
To call a tool answer <tool_call>{"name": ..., "arguments": {...}}</tool_call>{{ end }}<|im_end|>
{{ range .Messages }}{{ if eq .Role "tool" }}<|im_start|>user
<tool_response>{{ .Content }}</tool_response><|im_end|>
{{ else }}<|im_start|>{{ .Role }}
{{ if .ToolCalls }}<tool_call>{{ range .ToolCalls }}{"name": "{{ .Function.Name }}", "arguments": \
{{ json .Function.Arguments }}}{{ end }}</tool_call>{{ else }}{{ .Content }}{{ end }}<|im_end|>
{{ end }}{{ end }}<|im_start|>assistant
"""


@pytest.fixture(scope="package")
def v1_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    if SMOL is None:
        pytest.skip("SmolLM2 is not cached (run scripts/fetch_smollm2.py)")
    tmp = tmp_path_factory.mktemp("v1")
    d = start_daemon(tmp / "models", tmp / "daemon.log")
    client = ollama.Client(host=d.url)
    digest = client.create_blob(SMOL)
    client.create(model="smol", files={SMOL.name: digest}, parameters={"num_ctx": 2048}, stream=False)
    client.create(
        model="smol-tools",
        files={SMOL.name: digest},
        template=TOOLS_TEMPLATE,
        parameters={"num_ctx": 2048, "stop": ["<|im_end|>"]},
        stream=False,
    )
    for name, template in (("smol-think", THINK_TEMPLATE), ("smol-hermes", HERMES_TEMPLATE)):
        client.create(
            model=name,
            files={SMOL.name: digest},
            template=template,
            parameters={"num_ctx": 2048, "stop": ["<|im_end|>"]},
            stream=False,
        )
    try:
        yield d
    finally:
        stop_daemon(d)
