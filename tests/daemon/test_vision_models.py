"""Vision models in the store: a projector (mmproj) GGUF becomes the model's projector layer at create (two FROM
lines, a directory of GGUF files, or a model name plus a projector file); ``/api/show`` and ``corral show`` report
it; copied, derived and pulled models keep it; a create with two models, two projectors or only a projector is a
clear 400 that leaves the store as it was."""

from __future__ import annotations

import hashlib
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from cli.commands.create import build_request
from cli.commands.show import projector_rows, summary
from cli.errors import LocalFileError
from cli.modelfile_files import ModelfileSource
from cli.output import format_count
from daemon.models.catalog import Catalog
from daemon.models.create import media_type_for
from registry.digest import Digest
from registry.download import Downloads
from registry.gguf import GGUFInfo, read_gguf_file
from registry.manifest import MEDIA_ADAPTER, MEDIA_MODEL, MEDIA_PROJECTOR, Manifest
from registry.names import ModelName
from registry.pull import Puller
from registry.store import Store
from tests.conftest import Daemon, start_daemon, stop_daemon
from tests.models import write_tiny_gguf
from tests.registry_pull.fake_registry import FakeRegistry, Holder, ServerThread
from tests.vision import projector_path, write_projector


# -- fixtures ------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def vdaemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    """One daemon for the module: every test uses its own model names."""
    root = tmp_path_factory.mktemp("vision-daemon")
    d = start_daemon(root / "models", root / "daemon.log")
    try:
        yield d
    finally:
        stop_daemon(d)


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("vision-files")
    proj = root / "mmproj.gguf"
    shutil.copyfile(projector_path(), proj)
    return {
        "model": write_tiny_gguf(root / "model.gguf"),
        "other": write_tiny_gguf(root / "other.gguf", seed=1),
        "proj": proj,
        "proj2": write_projector(root / "mmproj-2.gguf", seed=7),
    }


def digest(path: Path) -> str:
    return "sha256:" + hashlib.sha256(path.read_bytes()).hexdigest()


def upload(h: httpx.Client, path: Path) -> str:
    d = digest(path)
    r = h.post(f"/api/blobs/{d}", content=path.read_bytes())
    assert r.status_code in (200, 201), r.text
    return d


def create(h: httpx.Client, body: dict[str, Any]) -> httpx.Response:
    return h.post("/api/create", json={**body, "stream": False})


def manifest_of(d: Daemon, name: str) -> Manifest:
    return Store(d.models).get(ModelName.parse(name)).manifest


def layer_types(d: Daemon, name: str) -> list[tuple[str, str]]:
    return [(la.media_type, str(la.digest)) for la in manifest_of(d, name).layers]


def snapshot(models: Path) -> dict[str, str]:
    return {
        str(p.relative_to(models)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(models.rglob("*"))
        if p.is_file() and p.name != ".corral.lock"
    }


def from_lines(modelfile: str) -> list[str]:
    return [ln for ln in modelfile.splitlines() if ln.startswith("FROM ")]


# -- create and show through the API -------------------------------------------------------------------------------
def test_model_and_projector_files_make_a_vision_model(vdaemon: Daemon, files: dict[str, Path]) -> None:
    with vdaemon.client() as h:
        # the projector named first: the daemon tells them apart by their headers, not by order or name
        body = {
            "model": "vis",
            "files": {"mmproj.gguf": upload(h, files["proj"]), "model.gguf": upload(h, files["model"])},
        }
        r = create(h, body)
        assert r.status_code == 200, r.text
        assert layer_types(vdaemon, "vis") == [
            (MEDIA_MODEL, digest(files["model"])),
            (MEDIA_PROJECTOR, digest(files["proj"])),
        ]
        assert manifest_of(vdaemon, "vis").first(MEDIA_PROJECTOR).from_ == "mmproj.gguf"  # type: ignore[union-attr]

        shown = h.post("/api/show", json={"model": "vis"}).json()
        assert "vision" in shown["capabilities"] and "completion" in shown["capabilities"]
        assert shown["details"]["family"] == "llama" and shown["details"]["families"] == ["llama"]
        assert shown["model_info"]["general.architecture"] == "llama"
        header = read_gguf_file(files["proj"])
        pi = shown["projector_info"]
        assert list(pi) == sorted(pi)  # the shape of model_info: sorted keys
        assert pi["general.architecture"] == "clip"
        assert pi["general.name"] == header.metadata["general.name"]  # Ollama keeps every key of the projector
        assert pi["clip.vision.projection_dim"] == 576
        assert pi["clip.vision.image_mean"] == [0.5, 0.5, 0.5]  # short arrays are kept
        assert pi["general.parameter_count"] == header.parameter_count
        assert set(pi) == set(header.metadata) | {"general.parameter_count"}
        # the keys come in the order Ollama's ShowResponse has them
        keys = list(shown)
        assert keys.index("model_info") < keys.index("projector_info") < keys.index("capabilities")

        blobs = vdaemon.models / "blobs"
        assert from_lines(shown["modelfile"]) == [
            f"FROM {blobs / ('sha256-' + digest(files['model'])[7:])}",
            f"FROM {blobs / ('sha256-' + digest(files['proj'])[7:])}",
        ]
        verbose = h.post("/api/show", json={"model": "vis", "verbose": True}).json()
        assert verbose["projector_info"]["general.architecture"] == "clip"

        tags = {m["name"]: m for m in h.get("/api/tags").json()["models"]}
        assert "vision" in tags["vis:latest"]["capabilities"]

        # a text-only model has neither
        assert create(h, {"model": "text", "files": {"model.gguf": digest(files["model"])}}).status_code == 200
        plain = h.post("/api/show", json={"model": "text"}).json()
        assert "projector_info" not in plain and "vision" not in plain["capabilities"]
        assert len(from_lines(plain["modelfile"])) == 1


def test_copied_and_derived_models_keep_the_projector(vdaemon: Daemon, files: dict[str, Path]) -> None:
    with vdaemon.client() as h:
        body = {"model": "vis-base", "files": {"m.gguf": upload(h, files["model"]), "p.gguf": upload(h, files["proj"])}}
        assert create(h, body).status_code == 200
        r = create(h, {"model": "vis-mario", "from": "vis-base", "system": "You are Mario", "parameters": {"top_k": 5}})
        assert r.status_code == 200, r.text
        assert h.post("/api/copy", json={"source": "vis-mario", "destination": "vis-copy"}).status_code == 200
        for name in ("vis-mario", "vis-copy"):
            kinds = [m for m, _ in layer_types(vdaemon, name)]
            assert kinds.count(MEDIA_PROJECTOR) == 1 and kinds[:2] == [MEDIA_MODEL, MEDIA_PROJECTOR]
            shown = h.post("/api/show", json={"model": name}).json()
            assert "vision" in shown["capabilities"]
            assert shown["projector_info"]["general.architecture"] == "clip"
            assert shown["details"]["parent_model"] == "vis-base:latest"
        # quantizing a derived vision model keeps the projector as it is (only the model layer is quantized)
        r = create(h, {"model": "vis-q8", "from": "vis-base", "quantize": "q8_0"})
        assert r.status_code == 200, r.text
        layers = layer_types(vdaemon, "vis-q8")
        assert (MEDIA_PROJECTOR, digest(files["proj"])) in layers
        assert (MEDIA_MODEL, digest(files["model"])) not in layers


def test_a_model_name_plus_a_projector_file_adds_or_swaps_the_projector(
    vdaemon: Daemon, files: dict[str, Path]
) -> None:
    with vdaemon.client() as h:
        model, proj, proj2 = (upload(h, files[k]) for k in ("model", "proj", "proj2"))
        assert create(h, {"model": "plain", "files": {"model.gguf": model}}).status_code == 200
        r = create(h, {"model": "plain-vis", "from": "plain", "files": {"mmproj.gguf": proj}})
        assert r.status_code == 200, r.text
        assert [m for m, _ in layer_types(vdaemon, "plain-vis")] == [MEDIA_MODEL, MEDIA_PROJECTOR]
        assert "vision" in h.post("/api/show", json={"model": "plain-vis"}).json()["capabilities"]
        # a new projector replaces the old one: never two
        r = create(h, {"model": "swapped", "from": "plain-vis", "files": {"mmproj-2.gguf": proj2}})
        assert r.status_code == 200, r.text
        assert layer_types(vdaemon, "swapped") == [(MEDIA_MODEL, model), (MEDIA_PROJECTOR, proj2)]


def test_bad_combinations_are_400_and_change_nothing(vdaemon: Daemon, files: dict[str, Path]) -> None:
    with vdaemon.client() as h:
        model, other, proj, proj2 = (upload(h, files[k]) for k in ("model", "other", "proj", "proj2"))
        assert create(h, {"model": "bad-base", "files": {"model.gguf": model, "mmproj.gguf": proj}}).status_code == 200
        before = snapshot(vdaemon.models)
        cases: list[tuple[dict[str, Any], str]] = [
            ({"files": {"model.gguf": model, "other.gguf": other}}, 'more than one model GGUF was given ("model.gguf"'),
            (
                {"files": {"model.gguf": model, "mmproj.gguf": proj, "mmproj-2.gguf": proj2}},
                "more than one projector GGUF was given",
            ),
            ({"files": {"mmproj.gguf": proj}}, '"mmproj.gguf" is a projector, and no model GGUF was given'),
            ({"from": "bad-base", "files": {"other.gguf": other}}, 'FROM names both the model "bad-base"'),
            ({"from": "bad-base", "files": {"a.gguf": proj, "b.gguf": proj2}}, "more than one projector GGUF"),
        ]
        for body, message in cases:
            r = create(h, {"model": "bad", **body})
            assert r.status_code == 400, (body, r.status_code, r.text)
            assert message in r.json()["error"], r.json()
        assert snapshot(vdaemon.models) == before
        assert h.get("/api/version").status_code == 200


# -- the CLI -------------------------------------------------------------------------------------------------------
def test_cli_creates_and_shows_a_vision_model(vdaemon: Daemon, files: dict[str, Path], tmp_path: Path) -> None:
    for key, name in (("model", "model.gguf"), ("proj", "mmproj.gguf")):
        shutil.copyfile(files[key], tmp_path / name)
    (tmp_path / "Modelfile").write_text("FROM ./model.gguf\nFROM ./mmproj.gguf\nSYSTEM You look at pictures.\n")
    r = vdaemon.cli("create", "cli-vis", "-f", str(tmp_path / "Modelfile"))
    assert r.returncode == 0, r.stderr
    assert [m for m, _ in layer_types(vdaemon, "cli-vis")][:2] == [MEDIA_MODEL, MEDIA_PROJECTOR]

    r = vdaemon.cli("show", "cli-vis")
    assert r.returncode == 0, r.stderr
    lines = [ln.split() for ln in r.stdout.splitlines()]
    at = lines.index(["Projector"])
    count = read_gguf_file(files["proj"]).parameter_count
    assert lines[at + 1 : at + 5] == [
        ["architecture", "clip"],
        ["parameters", format_count(count)],
        ["embedding", "length", "64"],
        ["dimensions", "576"],
    ]
    assert ["vision"] in lines[lines.index(["Capabilities"]) :]

    r = vdaemon.cli("show", "cli-vis", "--modelfile")
    assert r.returncode == 0, r.stderr
    blobs = vdaemon.models / "blobs"
    assert from_lines(r.stdout) == [
        f"FROM {blobs / ('sha256-' + digest(files['model'])[7:])}",
        f"FROM {blobs / ('sha256-' + digest(files['proj'])[7:])}",
    ]

    # FROM a directory holding both GGUF files
    d = tmp_path / "weights"
    d.mkdir()
    for name in ("model.gguf", "mmproj.gguf"):
        shutil.move(tmp_path / name, d / name)
    (tmp_path / "Modelfile").write_text("FROM ./weights\n")
    r = vdaemon.cli("create", "dir-vis", "-f", str(tmp_path / "Modelfile"))
    assert r.returncode == 0, r.stderr
    assert [m for m, _ in layer_types(vdaemon, "dir-vis")] == [MEDIA_MODEL, MEDIA_PROJECTOR]

    # a stored model plus a projector file
    with vdaemon.client() as h:
        assert create(h, {"model": "cli-plain", "files": {"model.gguf": upload(h, files["model"])}}).status_code == 200
    (tmp_path / "Modelfile").write_text("FROM cli-plain\nFROM ./weights/mmproj.gguf\n")
    r = vdaemon.cli("create", "cli-plain-vis", "-f", str(tmp_path / "Modelfile"))
    assert r.returncode == 0, r.stderr
    assert [m for m, _ in layer_types(vdaemon, "cli-plain-vis")] == [MEDIA_MODEL, MEDIA_PROJECTOR]


class RecordingClient:
    """Stands in for the daemon in build_request: every blob is missing, uploads are recorded."""

    def __init__(self) -> None:
        self.uploaded: list[Path] = []

    def blob_exists(self, digest: Digest | str) -> bool:
        return False

    def upload_blob(self, digest: Digest | str, path: Path, progress_callback: Any = None) -> None:
        self.uploaded.append(path)


def test_cli_request_uploads_every_from_file(files: dict[str, Path], tmp_path: Path) -> None:
    client = RecordingClient()
    text = f"FROM {files['model']}\nFROM {files['proj']}\n"
    payload = build_request("m", ModelfileSource(text.encode(), "Modelfile", tmp_path), client)  # type: ignore[arg-type]
    assert payload["files"] == {"model.gguf": digest(files["model"]), "mmproj.gguf": digest(files["proj"])}
    assert "from" not in payload
    assert client.uploaded == [files["model"], files["proj"]]

    with pytest.raises(LocalFileError, match=r'FROM names two models \("llama3" and "qwen3"\)'):
        build_request("m", ModelfileSource(b"FROM llama3\nFROM qwen3\n", "Modelfile", tmp_path), RecordingClient())  # type: ignore[arg-type]


# -- pure units ----------------------------------------------------------------------------------------------------
def header(**metadata: Any) -> GGUFInfo:
    return GGUFInfo(version=3, metadata=metadata, tensors=(), data_offset=0, file_size=0)


@pytest.mark.parametrize(
    ("metadata", "media"),
    [
        ({"general.architecture": "llama", "llama.block_count": 2}, MEDIA_MODEL),
        ({"general.architecture": "clip", "clip.vision.block_count": 2}, MEDIA_PROJECTOR),
        ({"general.architecture": "clip", "clip.has_audio_encoder": True}, MEDIA_PROJECTOR),
        ({"general.architecture": "siglip", "general.type": "mmproj"}, MEDIA_PROJECTOR),
        ({"general.architecture": "siglip", "general.type": "Projector"}, MEDIA_PROJECTOR),
        ({"general.architecture": "qwen25vl", "qwen25vl.vision.block_count": 32}, MEDIA_PROJECTOR),
        # a model that carries its own vision tower (Ollama-engine style) is still the model
        ({"general.architecture": "gemma3", "gemma3.block_count": 26, "gemma3.vision.block_count": 27}, MEDIA_MODEL),
        ({"general.architecture": "llama", "general.type": "adapter"}, MEDIA_ADAPTER),
    ],
)
def test_media_type_for(metadata: dict[str, Any], media: str) -> None:
    assert media_type_for(header(**metadata)) == media


def test_projector_rows_follow_ollama() -> None:
    vision = {
        "general.architecture": "clip",
        "general.parameter_count": 428_000_000,
        "clip.vision.embedding_length": 1152,
        "clip.vision.projection_dim": 2048,
    }
    assert projector_rows(vision) == [
        ["architecture", "clip"],
        ["parameters", "428M"],
        ["embedding length", "1152"],
        ["dimensions", "2048"],
    ]
    audio = {"general.architecture": "clip", "clip.audio.embedding_length": 1280, "clip.audio.projection_dim": 896}
    assert projector_rows(audio) == [["architecture", "clip"], ["embedding length", "1280"], ["dimensions", "896"]]
    lines = summary({"capabilities": ["completion", "vision"], "projector_info": vision})
    assert lines[lines.index("  Projector") + 1].split() == ["architecture", "clip"]
    assert "  Projector" not in summary({"capabilities": ["completion"]})


# -- pulls ---------------------------------------------------------------------------------------------------------
def test_a_pulled_vision_model_keeps_its_projector(files: dict[str, Path], tmp_path: Path) -> None:
    registry = FakeRegistry()
    model, proj = files["model"].read_bytes(), files["proj"].read_bytes()
    registry.add_model(
        "ns/vis",
        "latest",
        [(MEDIA_MODEL, model), (MEDIA_PROJECTOR, proj)],
        config=b'{"model_format":"gguf","model_family":"llama","model_families":["llama","clip"]}',
    )
    store = Store(tmp_path / "models")
    with ServerThread(Holder(registry)) as server:
        name = f"{server.host}/ns/vis"
        lines = list(Puller(store, Downloads(), threading.RLock(), prune=True).run(name, insecure=True))
    assert lines[-1]["status"] == "success"
    catalog = Catalog(store)
    manifest = catalog.get(name).manifest
    assert [la.media_type for la in manifest.layers] == [MEDIA_MODEL, MEDIA_PROJECTOR]
    assert store.has_blob(Digest.parse(digest(files["proj"])))
    shown = catalog.show(name)
    assert "vision" in shown["capabilities"]
    assert shown["projector_info"]["general.architecture"] == "clip"
    assert len(from_lines(shown["modelfile"])) == 2
