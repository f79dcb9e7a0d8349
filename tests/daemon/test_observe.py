"""Request logs and /metrics."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

import httpx

from tests.conftest import Daemon


def _create(h: httpx.Client, gguf: Path, name: str) -> None:
    """The model ``name`` from ``gguf``, as a client creates one: the blob, then /api/create."""
    data = gguf.read_bytes()
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    h.post(f"/api/blobs/{digest}", content=data)
    h.post("/api/create", json={"model": name, "files": {f"{name}.gguf": digest}, "stream": False})


def test_metrics_count_tokens_and_log_lines(daemon: Daemon, tiny_gguf: Path) -> None:
    with httpx.Client(base_url=daemon.url, timeout=60) as h:
        _create(h, tiny_gguf, "t")
        r = h.post(
            "/api/generate",
            json={
                "model": "t",
                "prompt": "a b c",
                "raw": True,
                "stream": False,
                "options": {"num_predict": 5, "temperature": 0},
            },
        )
        body = r.json()
        text = h.get("/metrics").text
        assert h.get("/health").json() == {"status": "ok"}
    generated = re.search(r'^corral_generated_tokens_total\{model="t:latest"\} ([\d.]+)$', text, re.M)
    prompt = re.search(r'^corral_prompt_tokens_total\{model="t:latest"\} ([\d.]+)$', text, re.M)
    assert generated and float(generated.group(1)) == body["eval_count"]
    assert prompt and float(prompt.group(1)) == body["prompt_eval_count"]
    assert re.search(r'^corral_requests_total\{endpoint="/api/generate",status="200"\} 1\.0$', text, re.M)
    assert "corral_loaded_models 1.0" in text and "corral_model_loads_total 1.0" in text
    assert "corral_time_to_first_token_seconds_count" in text
    log = daemon.log.read_text()
    line = [ln for ln in log.splitlines() if "path=/api/generate" in ln][0]
    assert "status=200" in line and "model=t:latest" in line and f"eval_count={body['eval_count']}" in line
    assert f"prompt_eval_count={body['prompt_eval_count']} prompt_cached=" in line
    assert re.search(r'^corral_prompt_cached_tokens_total\{model="t:latest"\} [\d.]+$', text, re.M)
    assert "a b c" not in log  # prompts are not logged


def test_n_choices_count_every_choices_tokens(daemon: Daemon, tiny_gguf: Path) -> None:
    """/v1 with n > 1: the log line and corral_generated_tokens_total count the tokens of all choices (not the last
    choice's), and the prompt, evaluated once for all of them, once."""
    with httpx.Client(base_url=daemon.url, timeout=60) as h:
        _create(h, tiny_gguf, "n")
        r = h.post(
            "/v1/completions",
            json={"model": "n", "prompt": "a b c", "n": 3, "max_tokens": 4, "temperature": 0.8, "seed": 5},
        )
        assert r.status_code == 200, r.text
        usage = r.json()["usage"]
        text = h.get("/metrics").text
    generated = re.search(r'^corral_generated_tokens_total\{model="n:latest"\} ([\d.]+)$', text, re.M)
    assert generated and float(generated.group(1)) == usage["completion_tokens"]
    line = [ln for ln in daemon.log.read_text().splitlines() if "path=/v1/completions" in ln][0]
    assert f"eval_count={usage['completion_tokens']}" in line
