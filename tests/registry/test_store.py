from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest

from errors import DigestMismatch, ModelNotFound, StoreLocked
from registry.digest import Digest
from registry.manifest import CONFIG_MEDIA_TYPE, MEDIA_MODEL, MEDIA_SYSTEM, Layer, Manifest
from registry.names import ModelName
from registry.store import Store


def make_model(store: Store, name: str, payload: bytes, system: bytes = b"sys") -> Manifest:
    model = store.put_bytes(payload)
    sysd = store.put_bytes(system)
    cfg = store.put_bytes(b'{"model_format":"gguf"}')
    manifest = Manifest.build(
        Layer(CONFIG_MEDIA_TYPE, cfg, 23),
        [Layer(MEDIA_MODEL, model, len(payload)), Layer(MEDIA_SYSTEM, sysd, len(system))],
    )
    store.write_manifest(ModelName.parse(name), manifest)
    return manifest


def test_layout_is_ollamas(tmp_path: Path) -> None:
    store = Store(tmp_path)
    m = make_model(store, "mario", b"weights")
    assert (tmp_path / "manifests/registry.ollama.ai/library/mario/latest").read_bytes() == m.raw
    assert (tmp_path / f"blobs/sha256-{Digest.of_bytes(b'weights').hex}").read_bytes() == b"weights"
    assert [e.name.short() for e in store.list_models()] == ["mario:latest"]


def test_blob_writer_verifies_and_leaves_nothing_on_mismatch(tmp_path: Path) -> None:
    store = Store(tmp_path)
    w = store.writer()
    w.write(b"hello")
    with pytest.raises(DigestMismatch):
        w.commit(Digest.of_bytes(b"other"))
    assert os.listdir(store.blobs_dir) == []


def test_delete_keeps_shared_blobs(tmp_path: Path) -> None:
    store = Store(tmp_path)
    make_model(store, "a", b"shared", b"sys-a")
    make_model(store, "b", b"shared", b"sys-b")
    store.delete(ModelName.parse("a"))
    assert store.has_blob(Digest.of_bytes(b"shared"))
    assert not store.has_blob(Digest.of_bytes(b"sys-a"))
    assert not (tmp_path / "manifests/registry.ollama.ai/library/a").exists()
    with pytest.raises(ModelNotFound):
        store.read_manifest(ModelName.parse("a"))


def test_canonical_case(tmp_path: Path) -> None:
    store = Store(tmp_path)
    make_model(store, "MyModel:V1", b"x")
    found = store.resolve(ModelName.parse("mymodel:v1"))
    assert found.model == "MyModel" and found.tag == "V1"


def test_prune_plan_respects_grace_and_refs(tmp_path: Path) -> None:
    store = Store(tmp_path)
    make_model(store, "m", b"kept")
    orphan = store.put_bytes(b"orphan")
    fresh = store.put_bytes(b"fresh orphan")
    old = time.time() - 7200
    os.utime(store.blob_path(orphan), (old, old))
    for p in store.iter_blob_files():
        if p.name != store.blob_path(fresh).name:
            os.utime(p, (old, old))
    plan = store.plan_prune()
    assert [p.name for p in plan.blobs] == [orphan.filename]
    assert store.prune(plan) == len(b"orphan")
    assert store.has_blob(Digest.of_bytes(b"kept")) and store.has_blob(fresh)


def test_prune_skipped_when_a_manifest_is_corrupt(tmp_path: Path) -> None:
    store = Store(tmp_path)
    make_model(store, "m", b"kept")
    bad = tmp_path / "manifests/registry.ollama.ai/library/bad/latest"
    bad.parent.mkdir(parents=True)
    bad.write_text("{not json")
    assert store.plan_prune(grace_seconds=0).skipped_reason


def test_lock_names_holder(tmp_path: Path) -> None:
    a = Store(tmp_path)
    a.lock()
    b = Store(tmp_path)
    with pytest.raises(StoreLocked, match=f"pid {os.getpid()}"):
        b.lock()
    a.unlock()
    b.lock()
    b.unlock()


def test_reads_an_ollama_store_copy(tmp_path: Path) -> None:
    """A store written by Ollama (colon-free blob names, raw manifest bytes) lists as is."""
    src = Store(tmp_path / "ollama")
    make_model(src, "registry.ollama.ai/library/llama3.2:1b", b"w")
    shutil.copytree(tmp_path / "ollama", tmp_path / "copy")
    models = Store(tmp_path / "copy").list_models()
    assert [m.name.short() for m in models] == ["llama3.2:1b"]
