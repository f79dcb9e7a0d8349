"""Quantize on create (issue 18): ``quantize`` in ``/api/create`` and ``corral create -q``, through a real daemon,
a real llama.cpp quantize worker and real random-weight GGUF models."""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import httpx
import psutil
import pytest

from daemon.runners.quantize import SOURCE_ERROR, parse_quant_type
from errors import InvalidRequest
from registry.gguf import read_gguf_file
from tests.conftest import Daemon
from tests.models import write_tiny_gguf

UNSUPPORTED = "unsupported quantization type {} - supported types are F32, F16, Q4_K_S, Q4_K_M, Q8_0"


@pytest.fixture(scope="module")
def f32_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random-weight F32 llama whose rows are multiples of 256, so the k-quants apply to every matrix."""
    return write_tiny_gguf(tmp_path_factory.mktemp("q") / "f32.gguf", n_embd=256, n_ff=512, n_vocab=600)


def client(d: Daemon) -> httpx.Client:
    return httpx.Client(base_url=d.url, timeout=300)


def upload(h: httpx.Client, path: Path) -> str:
    digest = "sha256:" + hashlib.sha256(path.read_bytes()).hexdigest()
    r = h.post(f"/api/blobs/{digest}", content=path.read_bytes())
    assert r.status_code in (200, 201), r.text
    return digest


def create(h: httpx.Client, body: dict) -> list[dict]:
    with h.stream("POST", "/api/create", json=body) as r:
        assert r.status_code == 200, r.read()
        return [json.loads(line) for line in r.iter_lines() if line]


def blobs(d: Daemon) -> list[str]:
    return sorted(p.name for p in (d.models / "blobs").iterdir())


def model_blob(h: httpx.Client, name: str, d: Daemon) -> Path:
    shown = h.post("/api/show", json={"model": name}).json()
    line = next(x for x in shown["modelfile"].splitlines() if x.startswith("FROM "))
    return Path(line[5:])


def generate(h: httpx.Client, name: str) -> dict:
    r = h.post(
        "/api/generate",
        json={
            "model": name,
            "prompt": "hello there",
            "stream": False,
            "keep_alive": 0,
            "options": {"num_predict": 4, "temperature": 0, "num_ctx": 256},
        },
    )
    assert r.status_code == 200, r.text
    return r.json()


def test_parse_quant_type() -> None:
    assert parse_quant_type("q4_k_m") == ("Q4_K_M", 15)
    assert parse_quant_type("q4_K") == ("Q4_K", 15)
    assert parse_quant_type("Q8_0") == ("Q8_0", 7)
    assert parse_quant_type("q4_K_S") == ("Q4_K_S", 14)
    assert parse_quant_type("bf16") == ("BF16", 32)
    with pytest.raises(InvalidRequest, match="^" + UNSUPPORTED.format("Q5_K_M") + "$"):
        parse_quant_type("q5_K_M")


def test_quantize_through_the_api_then_run(daemon: Daemon, f32_model: Path) -> None:
    src_size = f32_model.stat().st_size
    with client(daemon) as h:
        digest = upload(h, f32_model)
        for requested, level in (("q8_0", "Q8_0"), ("q4_K_M", "Q4_K_M")):
            name = f"api-{level.lower()}"
            events = create(h, {"model": name, "files": {"f32.gguf": digest}, "quantize": requested})
            statuses = [e.get("status") for e in events]
            assert "error" not in events[-1], events[-1]
            status = f"quantizing F32 model to {level}"
            progress = [e for e in events if e.get("status") == status]
            assert progress and progress[0]["completed"] == 0
            assert all(e["total"] == src_size and e["digest"] == "0000000000000000000" for e in progress)
            assert progress[-1]["completed"] == src_size
            assert [e["completed"] for e in progress] == sorted(e["completed"] for e in progress)
            after = statuses[statuses.index("verifying conversion") + 1 :]
            assert after[0].startswith("creating new layer sha256:")
            assert after[-2:] == ["writing manifest", "success"]

            shown = h.post("/api/show", json={"model": name}).json()
            assert shown["details"]["quantization_level"] == level
            assert shown["model_info"]["general.file_type"] == {"Q8_0": 7, "Q4_K_M": 15}[level]
            tags = {m["name"]: m for m in h.get("/api/tags").json()["models"]}
            assert tags[f"{name}:latest"]["details"]["quantization_level"] == level
            blob = model_blob(h, name, daemon)
            assert blob.parent == daemon.models / "blobs" and blob.stat().st_size < src_size
            assert read_gguf_file(blob).file_type_name == level
            assert "sha256-" + hashlib.sha256(blob.read_bytes()).hexdigest() == blob.name
            out = generate(h, name)
            assert out["eval_count"] > 0 and out["done"]
        # the source type itself: nothing to do, the layer is reused as it is
        events = create(h, {"model": "same", "files": {"f32.gguf": digest}, "quantize": "f32"})
        assert events[-1] == {"status": "success"}
        assert not any("quantizing" in str(e.get("status")) for e in events)
        assert h.post("/api/show", json={"model": "same"}).json()["details"]["quantization_level"] == "F32"
    assert not [b for b in blobs(daemon) if "tmp" in b or "partial" in b]


def test_quantize_through_the_cli(daemon: Daemon, f32_model: Path, tmp_path: Path) -> None:
    src = tmp_path / "src.gguf"
    src.write_bytes(f32_model.read_bytes())
    mf = tmp_path / "Modelfile"
    mf.write_text("FROM ./src.gguf\nPARAMETER num_ctx 256\n")
    for flag, requested, level in (("-q", "q4_K_M", "Q4_K_M"), ("--quantize", "Q8_0", "Q8_0")):
        name = f"cli-{level.lower()}"
        r = daemon.cli("create", flag, requested, name, "-f", str(mf), timeout=300)
        assert r.returncode == 0, r.stderr + r.stdout
        assert "success" in r.stdout + r.stderr
        with client(daemon) as h:
            shown = h.post("/api/show", json={"model": name}).json()
            assert shown["details"]["quantization_level"] == level
            assert model_blob(h, name, daemon).stat().st_size < src.stat().st_size
            assert generate(h, name)["eval_count"] > 0
        r = daemon.cli("show", name)
        assert r.returncode == 0 and level in r.stdout, r.stdout
    r = daemon.cli("create", "-q", "q2_K", "bad", "-f", str(mf))
    assert r.returncode != 0 and UNSUPPORTED.format("Q2_K") in r.stderr + r.stdout


def test_quantized_source_and_unknown_type_are_400(daemon: Daemon, f32_model: Path) -> None:
    with client(daemon) as h:
        digest = upload(h, f32_model)
        done = create(h, {"model": "q8", "files": {"f32.gguf": digest}, "quantize": "q8_0"})
        assert done[-1] == {"status": "success"}
        before = blobs(daemon)
        manifests = sorted(p for p in (daemon.models / "manifests").rglob("*") if p.is_file())
        # from an existing, already quantized model
        r = h.post("/api/create", json={"model": "again", "from": "q8", "quantize": "q4_K_M"})
        assert r.status_code == 400 and r.json() == {"error": SOURCE_ERROR}
        # a quantized GGUF uploaded as a file
        q8_blob = model_blob(h, "q8", daemon)
        d8 = "sha256:" + q8_blob.name.removeprefix("sha256-")
        r = h.post(
            "/api/create", json={"model": "again", "files": {"q8.gguf": d8}, "quantize": "q4_K_S", "stream": False}
        )
        assert r.status_code == 400 and r.json() == {"error": SOURCE_ERROR}
        # an unknown type, upper-cased as Ollama does, listing the types
        for bad in ("q5_K_M", "iq2_xs", "nonsense"):
            r = h.post("/api/create", json={"model": "again", "files": {"f32.gguf": digest}, "quantize": bad})
            assert r.status_code == 400 and r.json() == {"error": UNSUPPORTED.format(bad.upper())}, r.text
        # "quantization" is Ollama's older spelling of the field
        r = h.post("/api/create", json={"model": "again", "files": {"f32.gguf": digest}, "quantization": "q3_K"})
        assert r.status_code == 400 and r.json() == {"error": UNSUPPORTED.format("Q3_K")}
        assert blobs(daemon) == before
        assert sorted(p for p in (daemon.models / "manifests").rglob("*") if p.is_file()) == manifests


def _worker(d: Daemon) -> psutil.Process | None:
    for p in psutil.Process(d.proc.pid).children(recursive=True):
        try:
            if "daemon.llama.quantize" in " ".join(p.cmdline()):
                return p
        except psutil.NoSuchProcess:
            continue
    return None


def test_worker_killed_mid_way_leaves_nothing(daemon: Daemon, tmp_path: Path) -> None:
    # big enough (~90 MB F32) that Q4_K_M takes a good second on two cores: the kill lands mid-way
    big = write_tiny_gguf(tmp_path / "big.gguf", n_embd=512, n_ff=1536, n_layer=6, n_vocab=4000)
    with client(daemon) as h:
        digest = upload(h, big)
        before = blobs(daemon)
        killed = False
        lines = []
        with h.stream(
            "POST", "/api/create", json={"model": "big-q4", "files": {"big.gguf": digest}, "quantize": "q4_K_M"}
        ) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if not line:
                    continue
                event = json.loads(line)
                lines.append(event)
                if not killed and event.get("completed", 0) > 0:
                    worker = _worker(daemon)
                    assert worker is not None
                    assert any(b.startswith("sha256-tmp-") for b in blobs(daemon))  # it was writing
                    worker.kill()
                    killed = True
        assert killed, lines
        assert lines[-1] == {"error": "quantization failed: the quantize worker stopped (killed by SIGKILL)"}
        assert not any(e.get("status") == "success" for e in lines)
        assert blobs(daemon) == before
        assert h.get("/api/tags").json() == {"models": []}
        assert _worker(daemon) is None
        # the daemon is fine and the next create works
        assert create(h, {"model": "big-q8", "files": {"big.gguf": digest}, "quantize": "q8_0"})[-1] == {
            "status": "success"
        }


def test_client_gone_kills_the_worker(daemon: Daemon, tmp_path: Path) -> None:
    big = write_tiny_gguf(tmp_path / "big.gguf", n_embd=512, n_ff=1536, n_layer=6, n_vocab=4000)
    with client(daemon) as h:
        digest = upload(h, big)
        before = blobs(daemon)
        with h.stream(
            "POST", "/api/create", json={"model": "gone", "files": {"big.gguf": digest}, "quantize": "q4_K_M"}
        ) as r:
            for line in r.iter_lines():
                if line and json.loads(line).get("completed", 0) > 0:
                    break  # hang up mid-way
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and (_worker(daemon) is not None or blobs(daemon) != before):
            time.sleep(0.1)
        assert _worker(daemon) is None
        assert blobs(daemon) == before
        assert h.get("/api/tags").json() == {"models": []}
