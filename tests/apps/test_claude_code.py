"""The real Claude Code (2.1.197, from npm: scripts/fetch_apps.sh) against a real daemon, pointed at it by
``ANTHROPIC_BASE_URL`` alone: ``claude -p "Say hello" --model M`` exits 0 and prints an answer.

Claude Code's first request is ~76 kB: its system prompt, a ``role: "system"`` message inside ``messages``, 24
tools, ``thinking: {"type": "adaptive"}``, ``output_config.effort``, ``max_tokens`` 32000, ``?beta=true``. The
model is SmolLM2-135M under a template that offers tools by name only, so that the whole prompt (a few thousand
tokens) fits the context given here and is evaluated in seconds on two cores; the answer ends at its first line
(a ``stop`` of the model), since ``max_tokens`` 32000 is no bound worth waiting for on a 135M model.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import ollama
import pytest

from tests.agent_apps import app_binary, app_env
from tests.conftest import Daemon, start_daemon, stop_daemon
from tests.models import smollm2_path

pytestmark = [pytest.mark.real_model, pytest.mark.slow]
CLAUDE = app_binary("claude")
SMOL = smollm2_path()
CONTEXT = 8192

# ChatML that lists the tools by name (Claude Code's full schemas are ~17,000 tokens) and renders calls and results.
TEMPLATE = """{{- if or .System .Tools }}<|im_start|>system
{{ if .System }}{{ .System }}
{{ end }}{{ if .Tools }}Tools you may call, answering only with JSON {"name": ..., "arguments": {...}}:
{{ range .Tools }}{{ .Function.Name }} {{ end }}
{{ end }}<|im_end|>
{{ end }}{{ range .Messages }}{{ if eq .Role "system" }}{{ else if eq .Role "tool" }}<|im_start|>user
The tool answered: {{ .Content }}<|im_end|>
{{ else if .ToolCalls }}<|im_start|>assistant
{{ range .ToolCalls }}{"name": "{{ .Function.Name }}", "arguments": {{ json .Function.Arguments }}}{{ end }}<|im_end|>
{{ else }}<|im_start|>{{ .Role }}
{{ .Content }}<|im_end|>
{{ end }}{{ end }}<|im_start|>assistant
"""


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    if CLAUDE is None:
        pytest.skip("Claude Code is not installed (scripts/fetch_apps.sh needs node and npm)")
    if SMOL is None:
        pytest.skip("SmolLM2 is not cached (run scripts/fetch_smollm2.py)")
    tmp = tmp_path_factory.mktemp("claude")
    d = start_daemon(tmp / "models", tmp / "daemon.log")
    client = ollama.Client(host=d.url)
    client.create(
        model="smol-agent",
        files={SMOL.name: client.create_blob(SMOL)},
        template=TEMPLATE,
        parameters={"num_ctx": CONTEXT, "temperature": 0, "stop": ["<|im_end|>", "\n"]},
        stream=False,
    )
    try:
        yield d
    finally:
        stop_daemon(d)


def test_claude_says_hello_through_corral(daemon: Daemon, tmp_path: Path) -> None:
    assert CLAUDE is not None
    work = tmp_path / "work"
    work.mkdir()
    env = app_env(tmp_path / "home", ANTHROPIC_BASE_URL=daemon.url, ANTHROPIC_API_KEY="sk-anything")
    done = subprocess.run(
        [str(CLAUDE), "-p", "Say hello", "--model", "smol-agent"],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        stdin=subprocess.DEVNULL,
    )
    log = daemon.log.read_text(errors="replace")
    assert done.returncode == 0, f"stdout:\n{done.stdout}\nstderr:\n{done.stderr}\ndaemon log:\n{log[-4000:]}"
    assert done.stdout.strip(), f"no answer printed; stderr:\n{done.stderr}"
    assert "POST /v1/messages" in log or "path=/v1/messages" in log  # it was corral that answered
    assert "status=400" not in log and "status=500" not in log, log[-4000:]
