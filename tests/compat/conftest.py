"""One daemon for the /v1 tests, with SmolLM2 as "smol" and a tool-capable variant as "smol-tools"."""

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
    try:
        yield d
    finally:
        stop_daemon(d)
