"""Shared fixtures: a clean environment per test, and a real daemon on an ephemeral port."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.models import write_tiny_gguf

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def clean_environ(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for key in list(os.environ):
        if key.startswith(("CORRAL_", "OLLAMA_")) and key != "CORRAL_TEST_CACHE":
            monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("NO_COLOR", "1")
    monkeypatch.setenv("COLUMNS", "120")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Daemon:
    url: str
    host: str
    models: Path
    env: dict[str, str]
    proc: subprocess.Popen[bytes]
    log: Path

    def client(self, **kw: object) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=60, **kw)  # type: ignore[arg-type]

    def cli(self, *args: str, input: str | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        """Run the corral CLI against this daemon."""
        return subprocess.run(
            [sys.executable, "-m", "cli", *args],
            env=self.env,
            cwd=REPO,
            input=input,
            capture_output=True,
            text=True,
            timeout=timeout,
        )


def start_daemon(models: Path, log: Path, extra_env: dict[str, str] | None = None) -> Daemon:
    port = free_port()
    host = f"127.0.0.1:{port}"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CORRAL_", "OLLAMA_"))}
    env.update({"CORRAL_HOST": host, "CORRAL_MODELS": str(models), "PYTHONPATH": str(REPO)})
    # the prompt cache on disk beside the store, never the user's: each test's daemons their own (a daemon started
    # again on the same store finds what the one before it wrote, as after a real restart)
    env["CORRAL_KV_DISK_DIR"] = str(models.parent / f"kv-{models.name}")
    env.update(extra_env or {})
    logf = open(log, "wb")  # noqa: SIM115
    proc = subprocess.Popen([sys.executable, "-m", "cli", "serve"], env=env, cwd=REPO, stdout=logf, stderr=logf)
    url = f"http://{host}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"daemon exited with {proc.returncode}:\n{log.read_text()}")
        try:
            if httpx.get(url + "/api/version", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.1)
    else:
        proc.kill()
        raise RuntimeError(f"daemon did not start:\n{log.read_text()}")
    return Daemon(url=url, host=host, models=models, env=env, proc=proc, log=log)


def stop_daemon(d: Daemon) -> None:
    if d.proc.poll() is None:
        d.proc.terminate()
        try:
            d.proc.wait(15)
        except subprocess.TimeoutExpired:
            d.proc.kill()
            d.proc.wait(5)


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[Daemon]:
    """A real `corral serve` on an ephemeral loopback port with an empty store in tmp_path/models."""
    d = start_daemon(tmp_path / "models", tmp_path / "daemon.log")
    try:
        yield d
    finally:
        stop_daemon(d)


@pytest.fixture
def tiny_gguf(tmp_path: Path) -> Path:
    """A tiny random-weight llama GGUF that llama.cpp can load."""
    return write_tiny_gguf(tmp_path / "tiny.gguf")


@pytest.fixture
def anyio_backend() -> str:
    """Async tests (marked ``anyio``) run on asyncio, the loop the daemon uses."""
    return "asyncio"
