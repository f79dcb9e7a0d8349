"""``GET /slots`` and ``POST /slots/{id}?action=save|restore|erase`` (llama-server's API for apps that manage their
own sessions) on a real daemon with tiny random GGUFs: a conversation's slot saved, erased and restored gives the
cold run's greedy answer with its prompt counted as cached, after an unload (the restore loads the model) and after
a daemon restart; a bad filename, a missing file, another model's file, a busy or unknown slot, an unknown action
and an unnamed model are refused with llama-server's statuses and words that say what to do; `corral prune` keeps a
model's saved slots while the model exists; and the routes are behind CORRAL_API_KEY."""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import Daemon, start_daemon, stop_daemon
from tests.models import write_tiny_gguf

TEMPLATE = "{{ if .System }}<|system|>{{ .System }}{{ end }}<|user|>{{ .Prompt }}<|assistant|>"
GREEDY = {"temperature": 0, "seed": 42, "max_tokens": 8}
ENV = {"CORRAL_KV_DISK": "256MiB", "CORRAL_NUM_PARALLEL": "2"}
QUESTION = "Tell me about the garden, the river and the old mill by the bridge."


def create(d: Daemon, tmp: Path, name: str, seed: int) -> None:
    gguf = write_tiny_gguf(tmp / f"{name}.gguf", seed=seed, context_length=1024)
    mf = tmp / f"{name}.Modelfile"
    mf.write_text(f'FROM {gguf}\nTEMPLATE """{TEMPLATE}"""\nPARAMETER num_ctx 512\n')
    made = d.cli("create", name, "-f", str(mf))
    assert made.returncode == 0, made.stderr


def chat(d: Daemon, model: str = "tiny") -> tuple[str, int, int]:
    """The greedy answer; prompt tokens and how many of them were cached."""
    r = httpx.post(
        d.url + "/v1/chat/completions",
        timeout=120,
        json={"model": model, "messages": [{"role": "user", "content": QUESTION}], **GREEDY},
    )
    assert r.status_code == 200, r.text
    body = r.json()
    usage = body["usage"]
    return (
        body["choices"][0]["message"]["content"],
        usage["prompt_tokens"],
        usage["prompt_tokens_details"]["cached_tokens"],
    )


def slots(d: Daemon, **params: str) -> list[dict[str, Any]]:
    r = httpx.get(d.url + "/slots", params=params, timeout=60)
    assert r.status_code == 200, r.text
    got: list[dict[str, Any]] = r.json()
    return got


def action(d: Daemon, slot: int | str, act: str, body: dict[str, Any] | None = None, **params: str) -> httpx.Response:
    return httpx.post(d.url + f"/slots/{slot}", params={"action": act, **params}, json=body, timeout=120)


def ok(r: httpx.Response) -> dict[str, Any]:
    assert r.status_code == 200, r.text
    got: dict[str, Any] = r.json()
    return got


def refused(r: httpx.Response, status: int, words: str) -> None:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert words in error["message"], error


def unload(d: Daemon) -> None:
    for m in httpx.get(d.url + "/api/ps", timeout=30).json()["models"]:
        httpx.post(d.url + "/api/generate", json={"model": m["name"], "keep_alive": 0}, timeout=60)
    deadline = time.monotonic() + 60
    while httpx.get(d.url + "/api/ps", timeout=30).json()["models"]:
        assert time.monotonic() < deadline, "the model was not unloaded"
        time.sleep(0.2)


def test_saved_slot_restored_after_erase_unload_and_restart_gives_the_cold_answer(tmp_path: Path) -> None:
    d = start_daemon(tmp_path / "models", tmp_path / "daemon.log", ENV)
    kv = tmp_path / "kv-models"
    try:
        create(d, tmp_path, "tiny", seed=0)
        cold, n_prompt, cached = chat(d)
        assert cold and cached == 0 and n_prompt + GREEDY["max_tokens"] < 256  # under a block: only a slot holds it
        (held,) = [s for s in slots(d, model="tiny") if s["cached_tokens"]]
        assert held["model"] == "tiny:latest" and held["n_ctx"] == 512 and held["is_processing"] is False
        n = held["cached_tokens"]

        # one model loaded: it may go unnamed
        saved = ok(action(d, held["id"], "save", {"filename": "conv-1.bin"}))
        assert saved["id_slot"] == held["id"] and saved["filename"] == "conv-1.bin" and saved["model"] == "tiny:latest"
        assert saved["n_saved"] == n and saved["n_written"] > 0 and saved["timings"]["save_ms"] >= 0
        (path,) = kv.glob("*/slots/conv-1.bin")
        assert path.stat().st_size == saved["n_written"]

        erased = ok(action(d, held["id"], "erase", model="tiny"))
        assert erased == {"id_slot": held["id"], "model": "tiny:latest", "n_erased": n}
        assert all(s["cached_tokens"] == 0 for s in slots(d))

        other = 1 - held["id"]  # restored into the other slot: the next request finds it by its prefix
        restored = ok(action(d, other, "restore", {"filename": "conv-1.bin", "model": "tiny"}))
        assert restored["id_slot"] == other and restored["n_restored"] == n
        assert restored["n_read"] == saved["n_written"] and restored["timings"]["restore_ms"] >= 0
        again, _, cached = chat(d)
        assert again == cold and cached == n_prompt - 1, (again, cold, cached)

        # after an unload: the restore loads the model
        unload(d)
        refused(action(d, 0, "restore", {"filename": "conv-1.bin"}), 400, "'model' is required: no model is loaded")
        ok(action(d, 0, "restore", {"filename": "conv-1.bin", "model": "tiny"}))
        again, _, cached = chat(d)
        assert again == cold and cached == n_prompt - 1, (again, cold, cached)

        # `corral prune` keeps the saved slots of a model that exists
        pruned = d.cli("prune")
        assert pruned.returncode == 0, pruned.stderr
        assert path.is_file()
    finally:
        stop_daemon(d)

    d = start_daemon(tmp_path / "models", tmp_path / "daemon2.log", ENV)
    try:
        ok(action(d, 1, "restore", {"filename": "conv-1.bin"}, model="tiny"))
        again, _, cached = chat(d)
        assert again == cold and cached == n_prompt - 1, (again, cold, cached)

        # the model's saved slots, listed and removed (they count against CORRAL_KV_DISK and nothing evicts them)
        listed = ok(httpx.get(d.url + "/slots/saved", params={"model": "tiny"}, timeout=30))
        assert listed["model"] == "tiny:latest"
        assert [(f["filename"], f["bytes"]) for f in listed["saved"]] == [("conv-1.bin", saved["n_written"])]
        assert listed["saved"][0]["modified_at"].endswith("Z")
        assert ok(httpx.get(d.url + "/slots/saved", timeout=30))["saved"] == listed["saved"]  # one model loaded
        refused(httpx.delete(d.url + "/slots/saved/.hidden", params={"model": "tiny"}, timeout=30), 400, "not allowed")
        gone = ok(httpx.delete(d.url + "/slots/saved/conv-1.bin", params={"model": "tiny"}, timeout=30))
        assert gone == {"model": "tiny:latest", "filename": "conv-1.bin", "bytes_freed": saved["n_written"]}
        assert not path.exists() and path.parent.is_dir()
        again = httpx.delete(d.url + "/slots/saved/conv-1.bin", params={"model": "tiny"}, timeout=30)
        refused(again, 404, "no saved slot named 'conv-1.bin' for model 'tiny:latest'")
        refused(action(d, 0, "restore", {"filename": "conv-1.bin"}), 404, "save one first")
        assert ok(httpx.get(d.url + "/slots/saved", params={"model": "tiny"}, timeout=30))["saved"] == []
    finally:
        stop_daemon(d)


def test_bad_requests_missing_and_foreign_files_are_refused(tmp_path: Path) -> None:
    d = start_daemon(tmp_path / "models", tmp_path / "daemon.log", ENV)
    kv = tmp_path / "kv-models"
    try:
        create(d, tmp_path, "tiny", seed=0)
        create(d, tmp_path, "other", seed=1)
        refused(action(d, 0, "save", {"filename": "x.bin"}), 400, "'model' is required: no model is loaded")
        refused(action(d, 0, "save", {"filename": "x.bin", "model": "tiny"}), 400, "is not loaded")
        chat(d)
        chat(d, "other")
        refused(action(d, 0, "save", {"filename": "x.bin"}), 400, "2 models are loaded (other:latest, tiny:latest)")

        for bad in ("../escape.bin", "a/b", ".hidden", "x" * 129, "", "/etc/passwd"):
            r = action(d, 0, "save", {"filename": bad, "model": "tiny"})
            refused(r, 400, "letters, digits, '_', '-' and '.'")
        refused(action(d, 0, "save", {"model": "tiny"}), 400, "filename is missing")
        refused(action(d, 0, "save", {"filename": 7, "model": "tiny"}), 400, "filename is missing")
        assert not list(tmp_path.rglob("escape.bin"))
        refused(action(d, 0, "launch", {"filename": "x.bin", "model": "tiny"}), 400, "must be one of save, restore")
        refused(action(d, "first", "save", {"filename": "x.bin", "model": "tiny"}), 400, "invalid slot id 'first'")
        refused(action(d, 5, "save", {"filename": "x.bin", "model": "tiny"}), 400, "there is no slot 5")
        refused(action(d, 0, "save", {"filename": "x.bin", "model": "nope"}), 404, "not found")
        refused(action(d, 0, "save", {"filename": "x.bin", "model": "tiny"}, model="other"), 400, "name one")
        r = httpx.post(d.url + "/slots/0?action=save", content=b"[1]", timeout=30)
        refused(r, 400, "must be a JSON object")

        refused(action(d, 0, "restore", {"filename": "never.bin", "model": "tiny"}), 404, "no saved slot named")
        (s,) = [s for s in slots(d, model="tiny") if s["cached_tokens"]]
        ok(action(d, s["id"], "save", {"filename": "mine.bin", "model": "tiny"}))
        # another model does not find it, and a copy of it in that model's folder is refused
        refused(
            action(d, 0, "restore", {"filename": "mine.bin", "model": "other"}),
            404,
            "saved by another model or another llama.cpp build",
        )
        (s2,) = [s for s in slots(d, model="other") if s["cached_tokens"]]
        ok(action(d, s2["id"], "save", {"filename": "theirs.bin", "model": "other"}))
        (mine,) = kv.glob("*/slots/mine.bin")
        (theirs,) = kv.glob("*/slots/theirs.bin")
        shutil.copy(mine, theirs.parent / "copied.bin")
        before = slots(d, model="other")
        refused(
            action(d, 0, "restore", {"filename": "copied.bin", "model": "other"}),
            400,
            "was saved by another model or another llama.cpp build",
        )
        data = bytearray(theirs.read_bytes())
        data[-20] ^= 0xFF
        (theirs.parent / "flipped.bin").write_bytes(bytes(data))
        refused(action(d, 0, "restore", {"filename": "flipped.bin", "model": "other"}), 400, "checksum mismatch")
        assert slots(d, model="other") == before  # nothing changed

        # the list: every loaded model's slots, or the named one's
        everything = slots(d)
        assert {s["model"] for s in everything} == {"tiny:latest", "other:latest"} and len(everything) == 4
        assert len(slots(d, model="other")) == 2

        # `corral rm` then prune: the model's saved slots go with its cache folder
        assert d.cli("rm", "other").returncode == 0
        unload(d)
        assert d.cli("prune").returncode == 0
        assert not theirs.exists() and mine.is_file()
    finally:
        stop_daemon(d)


@pytest.mark.parametrize("path", ["/slots", "/slots/0?action=save"])
def test_the_routes_are_behind_the_api_key(tmp_path: Path, path: str) -> None:
    d = start_daemon(tmp_path / "models", tmp_path / "daemon.log", {**ENV, "CORRAL_API_KEY": "s3cret"})
    try:
        send = httpx.get if path == "/slots" else lambda url, **kw: httpx.post(url, json={"filename": "x"}, **kw)
        r = send(d.url + path, timeout=30)
        assert r.status_code == 401 and "an API key is required" in r.text
        r = send(d.url + path, timeout=30, headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401
        r = send(d.url + path, timeout=30, headers={"Authorization": "Bearer s3cret"})
        assert r.status_code != 401
        if path == "/slots":
            assert r.status_code == 200 and r.json() == []
        else:
            assert r.status_code == 400 and "'model' is required" in r.text
    finally:
        stop_daemon(d)
