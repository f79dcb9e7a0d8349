"""API keys through the official clients, and the refusal to serve a non-loopback address without one."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import ollama
import pytest

from tests.conftest import REPO, Daemon, start_daemon, stop_daemon

KEY = "s3cret-key-for-tests"


@pytest.fixture
def keyed(tmp_path: Path) -> Daemon:
    d = start_daemon(tmp_path / "models", tmp_path / "log", {"CORRAL_API_KEY": KEY})
    yield d  # type: ignore[misc]
    stop_daemon(d)


def test_keys_required_except_open_paths(keyed: Daemon) -> None:
    with httpx.Client(base_url=keyed.url) as h:
        assert h.get("/").status_code == 200
        assert h.get("/api/version").status_code == 200
        r = h.get("/api/tags")
        assert r.status_code == 401 and "API key" in r.json()["error"]
        assert h.get("/api/tags", headers={"Authorization": "Bearer wrong"}).json() == {"error": "invalid API key"}
        assert h.get("/api/tags", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
        assert h.get("/api/tags", headers={"x-api-key": KEY}).status_code == 200
        r = h.get("/v1/models")
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        r = h.post("/v1/messages", json={})
        assert r.status_code == 401 and r.json()["type"] == "error"


def test_ollama_client_with_and_without_key(keyed: Daemon) -> None:
    with pytest.raises(ollama.ResponseError) as e:
        ollama.Client(host=keyed.url).list()
    assert e.value.status_code == 401
    ok = ollama.Client(host=keyed.url, headers={"Authorization": f"Bearer {KEY}"})
    assert ok.list().models == []


def test_cli_sends_the_key(keyed: Daemon) -> None:
    env = dict(keyed.env)
    assert (
        subprocess.run(
            [sys.executable, "-m", "cli", "list"], env=env, cwd=REPO, capture_output=True, text=True
        ).returncode
        == 0
    )
    env.pop("CORRAL_API_KEY")
    r = subprocess.run([sys.executable, "-m", "cli", "list"], env=env, cwd=REPO, capture_output=True, text=True)
    assert r.returncode == 1 and "API key" in r.stderr


def test_key_never_logged(keyed: Daemon) -> None:
    with httpx.Client(base_url=keyed.url) as h:
        h.get("/api/tags", headers={"Authorization": f"Bearer {KEY}"})
        h.get("/api/tags", headers={"Authorization": "Bearer not-the-key-either"})
    log = keyed.log.read_text()
    assert KEY not in log and "not-the-key-either" not in log


def test_non_loopback_without_key_refuses(tmp_path: Path) -> None:
    env = {
        "CORRAL_HOST": "0.0.0.0:0",
        "CORRAL_MODELS": str(tmp_path / "m"),
        "PYTHONPATH": str(REPO),
        "PATH": "/usr/bin:/bin",
    }
    r = subprocess.run(
        [sys.executable, "-m", "cli", "serve"], env=env, cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 1 and "refusing to listen on 0.0.0.0:0 without an API key" in r.stderr
