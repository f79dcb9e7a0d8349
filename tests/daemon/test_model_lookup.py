"""Inference.lookup: a model looked up before comes from memory while its manifest is unchanged (issue 19: every
request paid a worker-thread hop and a few store reads before it reached the runner), and never once it changed:
a create or copy over the name, a delete, or a manifest replaced behind the daemon's back."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from daemon.generation.inference import Inference
from daemon.models.catalog import Catalog
from daemon.settings import Settings
from errors import ModelNotFound
from registry.manifest import CONFIG_MEDIA_TYPE, MEDIA_MODEL, MEDIA_SYSTEM, Layer, Manifest
from registry.names import ModelName
from registry.store import Store
from tests.models import write_tiny_gguf

pytestmark = pytest.mark.anyio


def manifest(store: Store, gguf: bytes, system: str) -> Manifest:
    digest = store.put_bytes(gguf)
    config = json.dumps(
        {"model_format": "gguf", "model_family": "llama", "rootfs": {"type": "layers", "diff_ids": [str(digest)]}}
    ).encode()
    sys_digest = store.put_bytes(system.encode())
    return Manifest.build(
        Layer(CONFIG_MEDIA_TYPE, store.put_bytes(config), len(config)),
        [Layer(MEDIA_MODEL, digest, len(gguf)), Layer(MEDIA_SYSTEM, sys_digest, len(system.encode()))],
    )


@pytest.fixture
def setup(tmp_path: Path) -> tuple[Store, Inference, bytes]:
    store = Store(tmp_path / "models")
    inf = Inference(Catalog(store), None, Settings.from_env({}))  # type: ignore[arg-type]
    gguf = write_tiny_gguf(tmp_path / "tiny.gguf").read_bytes()
    store.write_manifest(ModelName.parse("m"), manifest(store, gguf, "first"))
    return store, inf, gguf


async def test_a_second_lookup_comes_from_memory(setup: tuple[Store, Inference, bytes]) -> None:
    _, inf, _ = setup
    first = await inf.lookup("m")
    assert first.system == "first"
    assert await inf.lookup("m") is first


async def test_a_new_manifest_under_the_name_is_seen(setup: tuple[Store, Inference, bytes]) -> None:
    store, inf, gguf = setup
    assert (await inf.lookup("m")).system == "first"
    store.write_manifest(ModelName.parse("m"), manifest(store, gguf, "second"))  # what create does
    assert (await inf.lookup("m")).system == "second"
    store.write_manifest(ModelName.parse("other"), manifest(store, gguf, "third"))
    store.copy(ModelName.parse("other"), ModelName.parse("m"))
    assert (await inf.lookup("m")).system == "third"


async def test_a_manifest_replaced_behind_the_daemon_is_seen(setup: tuple[Store, Inference, bytes]) -> None:
    store, inf, gguf = setup
    assert (await inf.lookup("m")).system == "first"
    generation = store.generation
    path = store.manifest_path(ModelName.parse("m"))
    new = manifest(store, gguf, "edited")
    tmp = path.with_name("edited")
    tmp.write_bytes(new.raw or new.to_bytes())
    os.replace(tmp, path)  # another process's write: the store's generation does not move, the file does
    assert store.generation == generation
    assert (await inf.lookup("m")).system == "edited"


async def test_a_deleted_model_is_not_found(setup: tuple[Store, Inference, bytes]) -> None:
    store, inf, _ = setup
    await inf.lookup("m")
    store.delete(ModelName.parse("m"))
    with pytest.raises(ModelNotFound):
        await inf.lookup("m")


async def test_removed_behind_the_daemon_is_not_found(setup: tuple[Store, Inference, bytes]) -> None:
    store, inf, _ = setup
    await inf.lookup("m")
    store.manifest_path(ModelName.parse("m")).unlink()
    with pytest.raises(ModelNotFound):
        await inf.lookup("m")
