"""The real Codex CLI (``codex exec "Say hello"``) against a real daemon on an ephemeral loopback port, told about
corral by its base URL alone, in the three ways a user can: the built-in OpenAI provider's ``openai_base_url``, a
custom provider with ``wire_api = "responses"``, and ``--oss`` with the Ollama provider (``CODEX_OSS_BASE_URL``;
without it Codex looks at localhost:11434, corral's own default). Codex sends every request with its full tool list
(functions, a ``namespace`` tool, the hosted ``web_search``), which corral used to refuse with a 400.

The model is SmolLM2-135M with a tool-capable (Hermes-style) template; it says something, which is all this test
asks: Codex exits 0 and prints the model's answer.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import ollama
import pytest

from tests.agent_apps import app_binary, app_env
from tests.compat.conftest import HERMES_TEMPLATE
from tests.conftest import Daemon, start_daemon, stop_daemon
from tests.models import smollm2_path

pytestmark = [pytest.mark.real_model, pytest.mark.slow]

CODEX = app_binary("codex")
SMOL = smollm2_path()
MODEL = "smol-codex"


@pytest.fixture(scope="module")
def corral(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    if CODEX is None:
        pytest.skip("Codex CLI is not installed (scripts/fetch_apps.sh)")
    if SMOL is None:
        pytest.skip("SmolLM2 is not cached (run scripts/fetch_smollm2.py)")
    tmp = tmp_path_factory.mktemp("codex")
    d = start_daemon(tmp / "models", tmp / "daemon.log")
    try:
        client = ollama.Client(host=d.url)
        client.create(
            model=MODEL,
            files={SMOL.name: client.create_blob(SMOL)},
            template=HERMES_TEMPLATE,
            # a turn ends at the end of the model's message or at its first blank line, well before the limit
            # (a reply cut by the limit is response.incomplete, which Codex reports as a failed turn)
            parameters={"num_ctx": 2048, "stop": ["<|im_end|>", "\n\n"], "num_predict": 256},
            stream=False,
        )
        yield d
    finally:
        stop_daemon(d)


def _run(args: list[str], home: Path, config: str, **env: str) -> subprocess.CompletedProcess[str]:
    assert CODEX is not None
    codex_home = home / ".codex"
    codex_home.mkdir(parents=True)
    (codex_home / "config.toml").write_text(config)
    work = home / "work"
    work.mkdir()
    subprocess.run(["git", "init", "-q", str(work)], check=True)  # Codex runs in a repository without a flag
    return subprocess.run(
        [str(CODEX), "exec", *args, "Say hello"],
        cwd=work,
        env=app_env(home, **env),
        stdin=subprocess.DEVNULL,  # else exec waits to read more of the prompt from stdin
        capture_output=True,
        text=True,
        timeout=900,
    )


WAYS = {
    # the built-in OpenAI provider, its base URL changed (Codex tries a WebSocket first, then plain HTTP)
    "openai_base_url": ([], 'model = "{model}"\nopenai_base_url = "{url}/v1"\n', {}),
    "custom_provider": (
        [],
        'model = "{model}"\nmodel_provider = "corral"\n\n[model_providers.corral]\nname = "corral"\n'
        'base_url = "{url}/v1"\nwire_api = "responses"\n',
        {},
    ),
    "oss_ollama": (
        ["--oss", "--local-provider", "ollama", "-m", "{model}:latest"],
        "",
        {"CODEX_OSS_BASE_URL": "{url}/v1"},
    ),
}


@pytest.mark.parametrize("way", list(WAYS))
def test_codex_exec_says_hello(corral: Daemon, tmp_path: Path, way: str) -> None:
    args, config, env = WAYS[way]
    fill = {"model": MODEL, "url": corral.url}
    r = _run(
        [a.format(**fill) for a in args],
        tmp_path / "home",
        config.format(**fill),
        **{k: v.format(**fill) for k, v in env.items()},
    )
    print(f"codex exec ({way}) exit {r.returncode}\nstdout:\n{r.stdout}\nstderr:\n{r.stderr}")
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip(), r.stderr[-3000:]  # the model's answer, Codex's last message
    assert "tokens used" in r.stderr  # a turn that completed, with the usage corral reported
    log = corral.log.read_text()
    assert "/v1/responses" in log
