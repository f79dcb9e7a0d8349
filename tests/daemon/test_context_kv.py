"""The default context (CORRAL_CONTEXT_LENGTH, automatic by VRAM), flash attention and the KV cache type
(CORRAL_FLASH_ATTENTION, CORRAL_KV_CACHE_TYPE): settings, precedence, the memory estimate, and real daemons on
SmolLM2 (trained context 8192)."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import ollama
import pytest

from daemon.generation.inference import Inference
from daemon.scheduling.memory import estimate
from daemon.settings import GiB, Settings, SettingsError, default_context_length
from tests.conftest import REPO, Daemon, free_port, start_daemon, stop_daemon
from tests.models import smollm2_path, write_tiny_gguf

SMOL = smollm2_path()
needs_smol = pytest.mark.skipif(SMOL is None, reason="SmolLM2 is not cached (run scripts/fetch_smollm2.py)")


# -- settings -------------------------------------------------------------------------------------------------
def test_settings_defaults() -> None:
    s = Settings.from_env({})
    assert (s.context_length, s.flash_attention, s.kv_cache_type) == (0, "auto", "f16")


@pytest.mark.parametrize(
    ("raw", "want"),
    [
        ("1", "on"),
        ("true", "on"),
        ("TRUE", "on"),
        ("t", "on"),
        (" 'on' ", "on"),
        ("0", "off"),
        ("false", "off"),
        ("F", "off"),
        ("", "auto"),
        ("auto", "auto"),
    ],
)
def test_flash_attention_words(raw: str, want: str) -> None:
    assert Settings.from_env({"CORRAL_FLASH_ATTENTION": raw}).flash_attention == want


@pytest.mark.parametrize(
    ("raw", "want"), [("f16", "f16"), ("q8_0", "q8_0"), ("Q4_0", "q4_0"), ('"q8_0"', "q8_0"), ("", "f16")]
)
def test_kv_cache_types(raw: str, want: str) -> None:
    assert Settings.from_env({"CORRAL_KV_CACHE_TYPE": raw}).kv_cache_type == want


@pytest.mark.parametrize(
    ("env", "words"),
    [
        ({"CORRAL_FLASH_ATTENTION": "maybe"}, ["CORRAL_FLASH_ATTENTION", "true", "false"]),
        ({"CORRAL_KV_CACHE_TYPE": "q5_1"}, ["CORRAL_KV_CACHE_TYPE", "f16", "q8_0", "q4_0"]),
        ({"CORRAL_CONTEXT_LENGTH": "lots"}, ["CORRAL_CONTEXT_LENGTH", "number of tokens"]),
        ({"CORRAL_CONTEXT_LENGTH": "-1"}, ["CORRAL_CONTEXT_LENGTH"]),
        ({"CORRAL_CONTEXT_LENGTH": str((1 << 24) + 1)}, ["CORRAL_CONTEXT_LENGTH"]),
        (
            {"CORRAL_KV_CACHE_TYPE": "q8_0", "CORRAL_FLASH_ATTENTION": "false"},
            ["CORRAL_KV_CACHE_TYPE", "CORRAL_FLASH_ATTENTION"],
        ),
    ],
)
def test_invalid_values_name_the_variable(env: dict[str, str], words: list[str]) -> None:
    with pytest.raises(SettingsError) as info:
        Settings.from_env(env)
    assert all(w in str(info.value) for w in words), str(info.value)
    assert "\n" not in str(info.value)


def test_quantized_kv_with_flash_attention_on_or_auto_is_fine() -> None:
    assert Settings.from_env({"CORRAL_KV_CACHE_TYPE": "q4_0", "CORRAL_FLASH_ATTENTION": "1"}).kv_cache_type == "q4_0"
    assert Settings.from_env({"CORRAL_KV_CACHE_TYPE": "q8_0"}).flash_attention == "auto"
    assert Settings.from_env({"CORRAL_KV_CACHE_TYPE": "f16", "CORRAL_FLASH_ATTENTION": "0"}).flash_attention == "off"


def test_context_length_setting_and_automatic_tiers() -> None:
    assert Settings.from_env({"CORRAL_CONTEXT_LENGTH": "8192"}).context_length == 8192
    assert Settings.from_env({"CORRAL_CONTEXT_LENGTH": "0"}).context_length == 0
    assert default_context_length(0) == 4096  # CPU only
    assert default_context_length(16 * GiB) == 4096
    assert default_context_length(23 * GiB - 1) == 4096
    assert default_context_length(23 * GiB) == 32768
    assert default_context_length(47 * GiB - 1) == 32768
    assert default_context_length(47 * GiB) == 262144
    assert default_context_length(80 * GiB, configured=2048) == 2048  # the variable wins over the tier


@pytest.mark.parametrize(
    "env",
    [
        {"CORRAL_FLASH_ATTENTION": "sometimes"},
        {"CORRAL_KV_CACHE_TYPE": "int4"},
        {"CORRAL_CONTEXT_LENGTH": "4k"},
        {"CORRAL_KV_CACHE_TYPE": "q4_0", "CORRAL_FLASH_ATTENTION": "off"},
    ],
)
def test_serve_refuses_invalid_values(tmp_path: Path, env: dict[str, str]) -> None:
    full = {k: v for k, v in os.environ.items() if not k.startswith(("CORRAL_", "OLLAMA_"))}
    full.update(
        {
            "CORRAL_HOST": f"127.0.0.1:{free_port()}",
            "CORRAL_MODELS": str(tmp_path / "models"),
            "PYTHONPATH": str(REPO),
            **env,
        }
    )
    r = subprocess.run(
        [sys.executable, "-m", "cli", "serve"], env=full, cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert r.returncode != 0
    assert "Traceback" not in r.stderr
    first = r.stderr.strip().splitlines()[0]
    assert first.startswith("Error: ") and all(k in first for k in env), r.stderr


# -- precedence and the estimate, without a daemon --------------------------------------------------------------
def _inference(default_num_ctx: int) -> Inference:
    return Inference(None, None, Settings.from_env({}), default_num_ctx=default_num_ctx)  # type: ignore[arg-type]


def test_num_ctx_precedence_request_model_default() -> None:
    inf = _inference(2048)
    plain, with_param = SimpleNamespace(params={}), SimpleNamespace(params={"num_ctx": 1024})
    assert inf.options(plain, {})["num_ctx"] == 2048  # type: ignore[arg-type]
    assert inf.options(plain, {"num_ctx": None})["num_ctx"] == 2048  # type: ignore[arg-type]
    assert inf.options(with_param, {})["num_ctx"] == 1024  # type: ignore[arg-type]
    assert inf.options(with_param, {"num_ctx": 512})["num_ctx"] == 512  # type: ignore[arg-type]
    assert inf.options(plain, {"num_ctx": 8192})["num_ctx"] == 8192  # type: ignore[arg-type]
    assert _inference(262144).options(plain, None)["num_ctx"] == 262144  # type: ignore[arg-type]


def test_estimate_counts_the_kv_type(tmp_path: Path) -> None:
    from registry.gguf import read_gguf_file

    info = read_gguf_file(str(write_tiny_gguf(tmp_path / "t.gguf", n_layer=4, n_embd=128, context_length=4096)))
    f16, q8, q4 = (estimate(info, num_ctx=4096, num_parallel=2, kv_type=t) for t in ("f16", "q8_0", "q4_0"))
    # llama.cpp's blocks: 32 values in 34 bytes (q8_0) or 18 bytes (q4_0), against 64 bytes in f16
    assert q8.kv_per_layer == pytest.approx(f16.kv_per_layer * 34 / 64, rel=1e-6)
    assert q4.kv_per_layer == pytest.approx(f16.kv_per_layer * 18 / 64, rel=1e-6)
    n_layer = len(f16.weights_per_layer)
    assert f16.ram - q8.ram == (f16.kv_per_layer - q8.kv_per_layer) * n_layer
    assert f16.compute_buffer == q8.compute_buffer


def test_load_spec_carries_the_settings(tmp_path: Path) -> None:
    from registry.gguf import read_gguf_file

    path = write_tiny_gguf(tmp_path / "t.gguf", context_length=512)
    settings = Settings.from_env({"CORRAL_KV_CACHE_TYPE": "q8_0", "CORRAL_FLASH_ATTENTION": "true"})
    inf = Inference(None, None, settings, default_num_ctx=32768, ram_budget=1 << 34)  # type: ignore[arg-type]
    ctx: Any = SimpleNamespace(
        params={},
        info=read_gguf_file(str(path)),
        model_path=path,
        adapters=(),
        stored=SimpleNamespace(manifest=SimpleNamespace(first=lambda media: None)),
    )
    spec = inf.load_spec(ctx, inf.options(ctx, {}))
    assert (spec.num_ctx, spec.kv_cache_type, spec.flash_attn) == (512, "q8_0", "on")  # clamped to the trained 512
    assert any(key[-1] == "q8_0" for key in inf._estimates)  # the estimate cache is keyed by the KV type too


# -- real daemons on SmolLM2 ------------------------------------------------------------------------------------
GREEDY = {"temperature": 0, "seed": 42, "num_predict": 24, "repeat_penalty": 1.0, "top_k": 40, "top_p": 0.9}


def _create(client: ollama.Client, name: str, gguf: Path, **kw: object) -> None:
    digest = client.create_blob(gguf)
    client.create(model=name, files={gguf.name: digest}, stream=False, **kw)  # type: ignore[arg-type]


def _daemon(tmp: Path, env: dict[str, str]) -> Daemon:
    assert SMOL is not None
    # one slot, so the two KV types are compared at the same number of cells
    d = start_daemon(tmp / "models", tmp / "daemon.log", {"CORRAL_NUM_PARALLEL": "1", **env})
    client = ollama.Client(host=d.url)
    _create(client, "smol", SMOL)
    _create(client, "smol-ctx", SMOL, parameters={"num_ctx": 2048})
    return d


@pytest.fixture(scope="module")
def auto_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    d = _daemon(tmp_path_factory.mktemp("auto"), {})
    try:
        yield d
    finally:
        stop_daemon(d)


@pytest.fixture(scope="module")
def q8_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    d = _daemon(tmp_path_factory.mktemp("q8"), {"CORRAL_CONTEXT_LENGTH": "100000", "CORRAL_KV_CACHE_TYPE": "q8_0"})
    try:
        yield d
    finally:
        stop_daemon(d)


def _loaded_after(d: Daemon, model: str, options: dict[str, Any] | None = None, **body: Any) -> dict[str, Any]:
    """Generate once, then the one model /api/ps lists."""
    with httpx.Client(base_url=d.url, timeout=120) as h:
        r = h.post(
            "/api/generate",
            json={
                "model": model,
                "prompt": "Hi",
                "stream": False,
                "options": {"num_predict": 2, **(options or {})},
                **body,
            },
        )
        assert r.status_code == 200, r.text
        models = h.get("/api/ps").json()["models"]
    assert len(models) == 1, models
    return dict(models[0])


@pytest.mark.real_model
@needs_smol
def test_gguf_trained_context_is_8192() -> None:
    from registry.gguf import read_gguf_file

    assert read_gguf_file(str(SMOL)).context_length == 8192


@pytest.mark.real_model
@needs_smol
def test_default_context_precedence_on_cpu(auto_daemon: Daemon) -> None:
    """No CORRAL_CONTEXT_LENGTH and no GPU: 4096; a Modelfile PARAMETER beats it; a request beats both."""
    assert "default_num_ctx=4096" in auto_daemon.log.read_text()
    m = _loaded_after(auto_daemon, "smol")
    assert (m["context_length"], m["kv_cache_type"], m["flash_attention"]) == (4096, "f16", "auto")
    assert _loaded_after(auto_daemon, "smol-ctx")["context_length"] == 2048
    assert _loaded_after(auto_daemon, "smol-ctx", {"num_ctx": 1024})["context_length"] == 1024
    assert _loaded_after(auto_daemon, "smol", {"num_ctx": 3000})["context_length"] == 3000
    assert _loaded_after(auto_daemon, "smol", {"num_ctx": 50000})["context_length"] == 8192  # trained context
    shown = ollama.Client(host=auto_daemon.url).show("smol")
    assert "num_ctx" not in (shown.parameters or "")  # the default is not a PARAMETER of the model


@pytest.mark.real_model
@needs_smol
def test_environment_context_is_below_modelfile_and_request(q8_daemon: Daemon) -> None:
    assert "default_num_ctx=100000" in q8_daemon.log.read_text()
    m = _loaded_after(q8_daemon, "smol")
    assert (m["context_length"], m["kv_cache_type"]) == (8192, "q8_0")  # 100000 clamped to the trained 8192
    assert _loaded_after(q8_daemon, "smol-ctx")["context_length"] == 2048
    assert _loaded_after(q8_daemon, "smol-ctx", {"num_ctx": 1024})["context_length"] == 1024
    assert _loaded_after(q8_daemon, "smol", {"num_ctx": 512})["context_length"] == 512


@pytest.mark.real_model
@needs_smol
def test_embeddings_with_a_quantized_kv_cache(q8_daemon: Daemon) -> None:
    """An embedding runner gets flash attention too (llama.cpp refuses a quantized V cache without it)."""
    r = ollama.Client(host=q8_daemon.url).embed(model="smol", input=["hello world"])
    assert len(r.embeddings) == 1 and len(r.embeddings[0]) == 576


@pytest.mark.real_model
@needs_smol
def test_q8_0_kv_is_smaller_and_greedy_equals_in_process(auto_daemon: Daemon, q8_daemon: Daemon) -> None:
    from tests.reference import run_llama

    prompt = "The capital of France is"
    opts = {**GREEDY, "num_ctx": 8192}
    f16 = _loaded_after(auto_daemon, "smol", opts)
    with httpx.Client(base_url=q8_daemon.url, timeout=120) as h:
        r = h.post(
            "/api/generate", json={"model": "smol", "prompt": prompt, "raw": True, "stream": False, "options": opts}
        )
        assert r.status_code == 200, r.text
        body = r.json()
        q8 = h.get("/api/ps").json()["models"][0]
    assert (f16["context_length"], q8["context_length"]) == (8192, 8192)
    assert q8["kv_cache_type"] == "q8_0" and q8["flash_attention"] == "on"  # a quantized cache needs it
    # SmolLM2: 30 layers, 3 KV heads of 64 values for K and V; 8192 cells in f16 is 180 MiB, in q8_0 34/64 of it
    kv_f16 = 30 * 8192 * 3 * (64 + 64) * 2
    saved = f16["size"] - q8["size"]
    assert saved == pytest.approx(kv_f16 * 30 / 64, rel=0.1), (f16["size"], q8["size"])

    out = q8_daemon.cli("ps")
    assert out.returncode == 0 and "8192 q8_0" in out.stdout, out.stdout + out.stderr

    # in a child process, without extra buffer types where they crash (tests/reference.py)
    ref, _ = run_llama(
        dict(
            model_path=str(SMOL), n_ctx=8192, n_batch=512, verbose=False, seed=42, flash_attn=True, type_k=8, type_v=8
        ),  # GGML_TYPE_Q8_0
        dict(prompt=prompt, max_tokens=24, temperature=0, repeat_penalty=1.0, top_k=40, top_p=0.9, seed=42),
    )
    assert ref is not None
    assert body["response"] == ref["choices"][0]["text"]
    # as many tokens as in-process llama.cpp: 24, or fewer where the model ends its answer first (it does on some
    # CPUs, whose kernels round the q8_0 cache's dot products differently: 19 on an AVX2-only Zen 3)
    assert body["eval_count"] == ref["usage"]["completion_tokens"]
    assert body["done_reason"] == ref["choices"][0]["finish_reason"]


@pytest.mark.parametrize(
    ("raw", "want"),
    [("-1", math.inf), ("300", 300.0), ("0", 0.0), ("5m", 300.0), ("-1m", math.inf), ('"24h"', 86400.0), ("", 300.0)],
)
def test_keep_alive_env_reads_as_ollama_does(raw: str, want: float) -> None:
    """OLLAMA_KEEP_ALIVE is a Go duration or else whole seconds: "-1" (forever) is what its FAQ tells users to set."""
    assert Settings.from_env({"CORRAL_KEEP_ALIVE": raw}).keep_alive == want


def test_keep_alive_env_refuses_what_ollama_cannot_read() -> None:
    with pytest.raises(SettingsError, match='CORRAL_KEEP_ALIVE "soon" is not a duration'):
        Settings.from_env({"CORRAL_KEEP_ALIVE": "soon"})
