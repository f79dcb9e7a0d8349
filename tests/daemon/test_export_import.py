"""``corral export`` / ``corral import`` (issue 18): real models through two daemons with separate stores, the
archive as an OCI image layout (checked by hand and, when installed, by skopeo), and hostile archives that must
each be a clear 400 leaving the store as it was (no manifest, no new blob, no temp file)."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import re
import shutil
import subprocess
import tarfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import ollama
import pytest

from registry import oci
from tests.conftest import Daemon, start_daemon, stop_daemon
from tests.models import smollm2_path, write_tiny_gguf

pytestmark = pytest.mark.real_model

SMOL = smollm2_path()
SYSTEM = "You are a terse assistant who answers in one sentence."
PARAMS = {"temperature": 0.0, "seed": 7, "num_ctx": 512, "stop": ["<|im_end|>", "###"], "top_k": 20}


# -- helpers -------------------------------------------------------------------------------------------------
def create(d: Daemon, name: str, gguf: Path, **kw: Any) -> None:
    client = ollama.Client(host=d.url)
    digest = client.create_blob(gguf)
    client.create(model=name, files={gguf.name: digest}, stream=False, **kw)


def export_to(d: Daemon, name: str, path: Path) -> Path:
    with httpx.stream("POST", d.url + "/api/export", json={"model": name}, timeout=120) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"] == "application/x-tar"
        with path.open("wb") as f:
            for chunk in r.iter_bytes():
                f.write(chunk)
        assert path.stat().st_size == int(r.headers["content-length"])
    return path


def post_import(d: Daemon, data: bytes, *, name: str | None = None, stream: bool = False) -> httpx.Response:
    params = {"stream": "true" if stream else "false"}
    if name:
        params["name"] = name
    return httpx.post(d.url + "/api/import", params=params, content=data, timeout=120)


def show(d: Daemon, name: str) -> dict[str, Any]:
    r = httpx.post(d.url + "/api/show", json={"model": name}, timeout=60)
    assert r.status_code == 200, r.text
    body = r.json()
    body["modelfile"] = body["modelfile"].replace(str(d.models), "<MODELS>")
    return body


def comparable(body: dict[str, Any]) -> dict[str, Any]:
    """What must survive an export and import; the modelfile's "# FROM <name>" comment names the model."""
    keep = {k: body.get(k) for k in ("parameters", "system", "template", "details", "model_info", "capabilities")}
    keep["modelfile"] = re.sub(r"(?m)^# FROM .*$", "# FROM <NAME>", body["modelfile"])
    assert "<MODELS>/blobs/sha256-" in keep["modelfile"]
    return keep


def generate(d: Daemon, name: str) -> dict[str, Any]:
    r = httpx.post(
        d.url + "/api/generate",
        timeout=300,
        json={
            "model": name,
            "prompt": "Hello, who are you?",
            "stream": False,
            "options": {"num_predict": 8, "temperature": 0, "seed": 1, "num_ctx": 512},
        },
    )
    assert r.status_code == 200, r.text
    return r.json()  # type: ignore[no-any-return]


def digest_of(d: Daemon, name: str) -> str:
    tags = httpx.get(d.url + "/api/tags", timeout=30).json()["models"]
    return next(m["digest"] for m in tags if m["name"] == name)


def check_layout(archive: Path) -> dict[str, Any]:
    """The archive is a valid OCI image layout: oci-layout, index.json (schemaVersion 2, one annotated manifest),
    and every blob's sha256 equal to its name; returns the manifest document."""
    blobs: dict[str, bytes] = {}
    with tarfile.open(archive) as tf:
        names = tf.getnames()
        files = {m.name: tf.extractfile(m).read() for m in tf.getmembers() if m.isfile()}  # type: ignore[union-attr]
        assert all(m.isfile() or m.isdir() for m in tf.getmembers())
    assert names[:2] == ["oci-layout", "index.json"]
    assert "blobs" in names and "blobs/sha256" in names
    assert json.loads(files["oci-layout"]) == {"imageLayoutVersion": "1.0.0"}
    index = json.loads(files["index.json"])
    assert index["schemaVersion"] == 2 and index["mediaType"] == "application/vnd.oci.image.index.v1+json"
    [desc] = index["manifests"]
    assert desc["mediaType"] == "application/vnd.docker.distribution.manifest.v2+json"
    assert desc["annotations"]["org.opencontainers.image.ref.name"]
    assert desc["annotations"]["io.corral.model.name"].endswith(
        ":" + desc["annotations"]["org.opencontainers.image.ref.name"]
    )
    for name, data in files.items():
        if name.startswith("blobs/"):
            assert name.startswith("blobs/sha256/")
            assert hashlib.sha256(data).hexdigest() == name.rsplit("/", 1)[1], name
            blobs[name.rsplit("/", 1)[1]] = data
    manifest_raw = blobs[desc["digest"].split(":", 1)[1]]
    assert len(manifest_raw) == desc["size"]
    manifest = json.loads(manifest_raw)
    assert manifest["mediaType"] == "application/vnd.docker.distribution.manifest.v2+json"
    for layer in (manifest["config"], *manifest["layers"]):
        assert len(blobs[layer["digest"].split(":", 1)[1]]) == layer["size"]
    assert any(layer["mediaType"] == "application/vnd.ollama.image.model" for layer in manifest["layers"])
    return manifest  # type: ignore[no-any-return]


def store_state(models: Path) -> tuple[dict[str, str], list[str]]:
    """(manifest path -> sha256 of its bytes, sorted blob file names)."""
    manifests = {
        str(p.relative_to(models)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in (models / "manifests").rglob("*")
        if p.is_file()
    }
    blobs = sorted(p.name for p in (models / "blobs").iterdir())
    return manifests, blobs


def temp_files(models: Path) -> list[str]:
    return [str(p) for p in models.rglob("*") if "tmp" in p.name or p.name.endswith("-partial")]


# -- daemons and models --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def src(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    tmp = tmp_path_factory.mktemp("src")
    d = start_daemon(tmp / "models", tmp / "daemon.log")
    tiny = write_tiny_gguf(tmp / "tiny.gguf")
    create(d, "tiny", tiny, system="tiny system", parameters={"num_ctx": 256, "top_k": 5})
    if SMOL is not None:
        create(d, "me/smol-sys:v1", SMOL, system=SYSTEM, parameters=PARAMS)
    try:
        yield d
    finally:
        stop_daemon(d)


@pytest.fixture(scope="module")
def dst(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    tmp = tmp_path_factory.mktemp("dst")
    d = start_daemon(tmp / "models", tmp / "daemon.log")
    try:
        yield d
    finally:
        stop_daemon(d)


@pytest.fixture(scope="module")
def tiny_archive(src: Daemon, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return export_to(src, "tiny", tmp_path_factory.mktemp("archives") / "tiny.tar")


# -- round trips ---------------------------------------------------------------------------------------------
def test_tiny_round_trip_through_the_cli(src: Daemon, dst: Daemon, tmp_path: Path) -> None:
    archive = tmp_path / "tiny.tar"
    r = src.cli("export", "tiny", "-o", str(archive))
    assert r.returncode == 0, r.stderr
    assert "exported tiny" in r.stderr
    assert not list(tmp_path.glob(".*partial"))
    manifest = check_layout(archive)
    assert len(manifest["layers"]) == 3  # model, system, params

    r = dst.cli("import", str(archive))
    assert r.returncode == 0, r.stderr + r.stdout
    assert "imported tiny.tar" in r.stdout
    assert comparable(show(dst, "tiny")) == comparable(show(src, "tiny"))
    assert digest_of(dst, "tiny:latest") == digest_of(src, "tiny:latest")  # the manifest is the same bytes
    body = generate(dst, "tiny")
    assert body["eval_count"] > 0 and body["done"] is True
    assert not temp_files(dst.models)

    # the same export twice is the same bytes (fixed owners and times), and stdout works
    r2 = subprocess.run(
        [*_cli(src), "export", "tiny", "-o", "-"], env=src.env, cwd=_repo(), capture_output=True, timeout=120
    )
    assert r2.returncode == 0, r2.stderr
    assert r2.stdout == archive.read_bytes()


@pytest.mark.skipif(SMOL is None, reason="SmolLM2 is not cached (run scripts/fetch_smollm2.py)")
def test_smollm2_with_system_and_parameters_round_trip(src: Daemon, dst: Daemon, tmp_path: Path) -> None:
    archive = export_to(src, "me/smol-sys:v1", tmp_path / "smol.tar")
    manifest = check_layout(archive)
    media = [layer["mediaType"] for layer in manifest["layers"]]
    assert media[0] == "application/vnd.ollama.image.model"
    assert "application/vnd.ollama.image.system" in media and "application/vnd.ollama.image.params" in media

    r = post_import(dst, archive.read_bytes(), stream=True)  # streamed progress, as the CLI reads it
    assert r.status_code == 200, r.text
    lines = [json.loads(line) for line in r.text.splitlines()]
    assert lines[0] == {"status": "importing me/smol-sys:v1"}
    assert lines[-1] == {"status": "success"}
    assert any(line.get("completed") == line.get("total") and line.get("digest") for line in lines)

    original = show(src, "me/smol-sys:v1")
    imported = show(dst, "me/smol-sys:v1")
    assert imported["system"] == SYSTEM
    assert comparable(imported) == comparable(original)
    body = generate(dst, "me/smol-sys:v1")
    assert body["eval_count"] > 0 and body["response"].strip()

    # under another name (?name=), and an import over an existing model replaces it, as create and pull do
    r = post_import(dst, archive.read_bytes(), name="other/renamed:v2")
    assert r.status_code == 200 and r.json() == {"status": "success"}, r.text
    assert comparable(show(dst, "other/renamed:v2")) == comparable(original)


def test_import_over_an_existing_model_replaces_it(dst: Daemon, tiny_archive: Path, tmp_path: Path) -> None:
    other = write_tiny_gguf(tmp_path / "other.gguf", seed=3)
    create(dst, "replaced", other, system="the old one")
    old_digest = digest_of(dst, "replaced:latest")
    r = post_import(dst, tiny_archive.read_bytes(), name="replaced")
    assert r.status_code == 200, r.text
    assert show(dst, "replaced")["system"] == "tiny system"
    assert digest_of(dst, "replaced:latest") != old_digest
    # the old model's own GGUF went with it (no other model used it)
    old_blob = "sha256-" + hashlib.sha256(other.read_bytes()).hexdigest()
    assert not (dst.models / "blobs" / old_blob).exists()


def test_export_errors(src: Daemon) -> None:
    r = httpx.get(src.url + "/api/export", params={"model": "nope"}, timeout=30)
    assert r.status_code == 404 and r.json() == {"error": "model 'nope' not found"}
    r = httpx.post(src.url + "/api/export", json={}, timeout=30)
    assert r.status_code == 400
    r = httpx.get(src.url + "/api/export", params={"model": "bad name!"}, timeout=30)
    assert r.status_code == 400
    res = src.cli("export", "nope", "-o", "/tmp/never-written.tar")
    assert res.returncode == 1 and "model 'nope' not found" in res.stderr


# -- other OCI tools -----------------------------------------------------------------------------------------
@pytest.mark.skipif(shutil.which("skopeo") is None, reason="skopeo is not installed (apt-get install skopeo)")
def test_skopeo_reads_the_layout(dst: Daemon, tiny_archive: Path, tmp_path: Path) -> None:
    """skopeo reads the archive as an OCI layout (``oci-archive:``) and finds the manifest byte for byte.

    skopeo 1.9 (Debian 12) goes no further with any Ollama model: it looks a reference up among OCI-typed
    descriptors only, and its Docker v2s2 parser refuses Ollama's layer media types ("unsupported docker v2s2
    media type"), the same limit it has pulling from registry.ollama.ai. Where a skopeo copies, the copy must
    hold every blob, and a layout skopeo wrote (its own member order, no corral annotation) must import."""
    manifest_doc = check_layout(tiny_archive)
    with tarfile.open(tiny_archive) as tf:
        digest = json.loads(tf.extractfile("index.json").read())["manifests"][0]["digest"]  # type: ignore[union-attr]
        manifest_raw = tf.extractfile("blobs/sha256/" + digest.split(":", 1)[1]).read()  # type: ignore[union-attr]
    r = subprocess.run(["skopeo", "inspect", "--raw", f"oci-archive:{tiny_archive}"], capture_output=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout == manifest_raw

    out = tmp_path / "copied"
    r = subprocess.run(
        ["skopeo", "copy", f"oci-archive:{tiny_archive}", f"dir:{out}"], capture_output=True, text=True, timeout=120
    )
    if r.returncode != 0:
        assert "unsupported docker v2s2 media type" in r.stderr, r.stderr
        return
    assert json.loads((out / "manifest.json").read_bytes()) == manifest_doc
    for layer in (manifest_doc["config"], *manifest_doc["layers"]):
        hex_ = layer["digest"].split(":", 1)[1]
        assert hashlib.sha256((out / hex_).read_bytes()).hexdigest() == hex_
    again = tmp_path / "skopeo.tar"
    r = subprocess.run(
        ["skopeo", "copy", f"dir:{out}", f"oci-archive:{again}:latest"], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr
    r2 = post_import(dst, again.read_bytes(), name="via-skopeo")
    assert r2.status_code == 200, r2.text
    assert show(dst, "via-skopeo")["system"] == "tiny system"


def test_a_layout_in_another_order_imports(dst: Daemon, tiny_archive: Path) -> None:
    """Other tools write the blobs before index.json (and no corral annotation): the name comes from ?name=."""
    p = Parts(read_members(tiny_archive))
    blobs = [(m, d) for m, d in p.members if m.name.startswith("blobs/")]
    index = json.loads(p.index[1])
    del index["manifests"][0]["annotations"]["io.corral.model.name"]
    data = build([*reversed(blobs), entry("index.json", json.dumps(index).encode()), p.layout])
    r = post_import(dst, data)
    assert r.status_code == 400 and "--name" in r.json()["error"]
    assert not temp_files(dst.models)
    r = post_import(dst, data, name="reordered")
    assert r.status_code == 200, r.text
    assert show(dst, "reordered")["system"] == "tiny system"
    assert not temp_files(dst.models)


# -- hostile archives ----------------------------------------------------------------------------------------
Members = list[tuple[tarfile.TarInfo, bytes]]


def read_members(archive: Path) -> Members:
    out = []
    with tarfile.open(archive) as tf:
        for m in tf.getmembers():
            data = tf.extractfile(m).read() if m.isfile() else b""  # type: ignore[union-attr]
            out.append((m, data))
    return out


def build(members: Members, fmt: int = tarfile.GNU_FORMAT) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt) as tf:
        for info, data in members:
            info = _copy(info)
            if info.isreg():
                info.size = len(data)
                tf.addfile(info, io.BytesIO(data))
            else:
                tf.addfile(info)
    return buf.getvalue()


def _copy(info: tarfile.TarInfo) -> tarfile.TarInfo:
    new = tarfile.TarInfo(info.name)
    for attr in ("size", "mode", "type", "linkname", "mtime", "uid", "gid", "uname", "gname", "devmajor", "devminor"):
        setattr(new, attr, getattr(info, attr))
    return new


def entry(
    name: str, data: bytes = b"", kind: bytes = tarfile.REGTYPE, linkname: str = ""
) -> tuple[tarfile.TarInfo, bytes]:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.linkname = linkname
    info.size = len(data) if kind == tarfile.REGTYPE else 0
    return info, data


class Parts:
    """The good archive's members by role, for building variants."""

    def __init__(self, members: Members) -> None:
        self.members = members
        by = {m.name: (m, d) for m, d in members}
        self.layout, self.index = by["oci-layout"], by["index.json"]
        desc = json.loads(self.index[1])["manifests"][0]
        self.manifest_name = "blobs/sha256/" + desc["digest"].split(":", 1)[1]
        self.manifest_doc = json.loads(by[self.manifest_name][1])
        model = next(la for la in self.manifest_doc["layers"] if la["mediaType"].endswith(".model"))
        self.model_name = "blobs/sha256/" + model["digest"].split(":", 1)[1]
        self.config_name = "blobs/sha256/" + self.manifest_doc["config"]["digest"].split(":", 1)[1]

    def without(self, *names: str) -> Members:
        return [(m, d) for m, d in self.members if m.name not in names]

    def replace(self, name: str, new: tuple[tarfile.TarInfo, bytes]) -> Members:
        return [new if m.name == name else (m, d) for m, d in self.members]

    def with_model_bytes(self, data: bytes) -> Members:
        """A consistent archive (names, sizes and digests all agree) whose model layer is ``data``."""
        hex_ = hashlib.sha256(data).hexdigest()
        doc = json.loads(json.dumps(self.manifest_doc))
        for layer in doc["layers"]:
            if layer["mediaType"].endswith(".model"):
                layer["digest"], layer["size"] = f"sha256:{hex_}", len(data)
        raw = json.dumps(doc).encode()
        index = json.loads(self.index[1])
        index["manifests"][0].update(digest=f"sha256:{hashlib.sha256(raw).hexdigest()}", size=len(raw))
        out = [
            self.layout,
            entry("index.json", json.dumps(index).encode()),
            entry("blobs/sha256/" + hashlib.sha256(raw).hexdigest(), raw),
            entry("blobs/sha256/" + hex_, data),
        ]
        return out + [
            (m, d)
            for m, d in self.members
            if m.name not in ("oci-layout", "index.json", self.manifest_name, self.model_name) and m.isfile()
        ]


def _index_with(p: Parts, **changes: Any) -> bytes:
    index = json.loads(p.index[1])
    index["manifests"][0].update(changes)
    return json.dumps(index).encode()


def _many_entries(p: Parts) -> bytes:
    extra = []
    for i in range(oci.MAX_ENTRIES + 10):
        data = f"blob {i}".encode()
        extra.append(entry("blobs/sha256/" + hashlib.sha256(data).hexdigest(), data))
    return build([p.layout, *extra])


def _truncated(archive: bytes, p: Parts) -> bytes:
    with tarfile.open(fileobj=io.BytesIO(archive)) as tf:
        model = tf.getmember(p.model_name)
        return archive[: model.offset_data + model.size // 2]


HOSTILE: dict[str, tuple[Callable[[Parts, bytes], bytes], str]] = {
    "dotdot": (lambda p, a: build([entry("../evil", b"x"), *p.members]), "not a clean relative path"),
    "dotdot-inside": (
        lambda p, a: build([*p.members, entry("blobs/sha256/../../../evil", b"x")]),
        "not a clean relative path",
    ),
    "absolute": (lambda p, a: build([entry("/etc/evil", b"x"), *p.members]), "absolute"),
    "windows-drive": (lambda p, a: build([entry("C:/evil", b"x"), *p.members]), "absolute"),
    "backslash": (lambda p, a: build([entry("blobs\\sha256\\evil", b"x"), *p.members]), "non-POSIX"),
    "symlink": (
        lambda p, a: build(p.replace(p.model_name, entry(p.model_name, kind=tarfile.SYMTYPE, linkname="/etc/passwd"))),
        "is a link",
    ),
    "hardlink": (
        lambda p, a: build([entry("evil", kind=tarfile.LNKTYPE, linkname="/etc/passwd"), *p.members]),
        "is a link",
    ),
    "char-device": (lambda p, a: build([*p.members[:2], entry("blobs/null", kind=tarfile.CHRTYPE)]), "device"),
    "fifo": (lambda p, a: build([entry("fifo", kind=tarfile.FIFOTYPE), *p.members]), "device or FIFO"),
    "unknown-file": (lambda p, a: build([*p.members, entry("etc/passwd", b"root:x:0:0")]), "unexpected member"),
    "wrong-digest": (
        lambda p, a: build(
            p.replace(
                p.model_name, entry(p.model_name, b"\0" * len(dict((m.name, d) for m, d in p.members)[p.model_name]))
            )
        ),
        "does not match its digest",
    ),
    "truncated": (lambda p, a: _truncated(a, p), "truncated"),
    "missing-blob": (lambda p, a: build(p.without(p.model_name)), "missing"),
    "missing-config": (lambda p, a: build(p.without(p.config_name)), "missing"),
    "missing-manifest": (lambda p, a: build(p.without(p.manifest_name)), "missing"),
    "missing-index": (lambda p, a: build(p.without("index.json")), "no index.json"),
    "missing-layout": (lambda p, a: build(p.without("oci-layout")), "no oci-layout"),
    "duplicate-blob": (
        lambda p, a: build([*p.members, next((m, d) for m, d in p.members if m.name == p.config_name)]),
        "duplicate entry",
    ),
    "duplicate-index": (lambda p, a: build([p.layout, p.index, *p.members[1:]]), "duplicate entry"),
    "oversized-index": (
        lambda p, a: build([p.layout, entry("index.json", p.index[1] + b" " * (2 << 20)), *p.members[2:]]),
        "more than the 1048576 allowed",
    ),
    "oversized-manifest": (
        lambda p, a: build([p.layout, entry("index.json", _index_with(p, size=5 << 20)), *p.members[2:]]),
        "more than the 4194304 allowed",
    ),
    "manifest-size-lie": (
        lambda p, a: build([p.layout, entry("index.json", _index_with(p, size=12)), *p.members[2:]]),
        "index.json says 12",
    ),
    "two-manifests": (
        lambda p, a: build(
            [
                p.layout,
                entry(
                    "index.json",
                    json.dumps(
                        {"schemaVersion": 2, "manifests": [json.loads(p.index[1])["manifests"][0]] * 2}
                    ).encode(),
                ),
                *p.members[2:],
            ]
        ),
        "2 manifests",
    ),
    "many-entries": (lambda p, a: _many_entries(p), "more than 2048 entries"),
    "huge-pax-header": (lambda p, a: build([entry("x" * 100_000, b"x"), *p.members], tarfile.PAX_FORMAT), "pax header"),
    "not-gguf": (lambda p, a: build(p.with_model_bytes(b"not a gguf at all" * 100)), "not a usable GGUF"),
    "not-a-tar": (lambda p, a: b"PK\x03\x04 a zip file, not a tar" + b"\x07" * 2000, "invalid archive"),
    "gzipped": (lambda p, a: gzip.compress(a), "invalid archive"),
    "empty": (lambda p, a: b"", "invalid archive"),
}


@pytest.fixture(scope="module")
def victim(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    """A daemon with an empty store: a failed import must leave it empty (its blobs cleaned up too)."""
    tmp = tmp_path_factory.mktemp("victim")
    d = start_daemon(tmp / "models", tmp / "daemon.log")
    try:
        yield d
    finally:
        stop_daemon(d)


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_archive_is_a_400_that_leaves_nothing(case: str, victim: Daemon, tiny_archive: Path) -> None:
    good = tiny_archive.read_bytes()
    make, expected = HOSTILE[case]
    data = make(Parts(read_members(tiny_archive)), good)
    before = store_state(victim.models)
    r = post_import(victim, data, name=None if case != "many-entries" else "x")
    assert r.status_code == 400, (case, r.status_code, r.text)
    message = r.json()["error"]
    assert expected in message, (case, message)
    assert store_state(victim.models) == before
    assert not temp_files(victim.models)
    assert not (victim.models / "manifests" / "registry.ollama.ai" / "library" / "tiny").exists()


def test_good_archive_after_the_hostile_ones(victim: Daemon, tiny_archive: Path) -> None:
    r = post_import(victim, tiny_archive.read_bytes())
    assert r.status_code == 200, r.text
    assert show(victim, "tiny")["system"] == "tiny system"


def test_error_after_progress_started_is_an_error_line(victim: Daemon, tiny_archive: Path) -> None:
    """Once the first progress line is out (index and manifest read), a later failure is the stream's last line,
    as for create and pull; nothing is written either."""
    p = Parts(read_members(tiny_archive))
    size = len(dict((m.name, d) for m, d in p.members)[p.model_name])
    data = build(p.replace(p.model_name, entry(p.model_name, b"\1" * size)))
    before = store_state(victim.models)
    r = post_import(victim, data, name="streamed", stream=True)
    assert r.status_code == 200
    lines = [json.loads(line) for line in r.text.splitlines()]
    assert lines[0] == {"status": "importing streamed:latest"}
    assert "does not match its digest" in lines[-1]["error"]
    assert store_state(victim.models) == before and not temp_files(victim.models)


def test_cli_import_of_a_bad_archive_reports_the_error(victim: Daemon, tiny_archive: Path, tmp_path: Path) -> None:
    p = Parts(read_members(tiny_archive))
    bad = tmp_path / "bad.tar"
    bad.write_bytes(build(p.without(p.model_name)))
    r = victim.cli("import", str(bad), "--name", "never")
    assert r.returncode == 1
    assert "Error: invalid archive: blobs the manifest names are missing" in r.stderr
    r = victim.cli("import", str(tmp_path / "absent.tar"))
    assert r.returncode == 1 and "cannot read" in r.stderr


def test_archive_size_is_exact() -> None:
    from registry.digest import Digest
    from registry.manifest import CONFIG_MEDIA_TYPE, Layer, Manifest
    from registry.names import ModelName

    layer = Layer("application/vnd.ollama.image.model", Digest.of_bytes(b"m" * 1000), 1000)
    manifest = Manifest.build(Layer(CONFIG_MEDIA_TYPE, Digest.of_bytes(b"{}"), 2), [layer])
    entries = oci.export_entries(ModelName.parse("a/b:c"), manifest)
    data = {Digest.of_bytes(b"m" * 1000): b"m" * 1000, Digest.of_bytes(b"{}"): b"{}"}
    out = io.BytesIO()
    for e in entries:
        out.write(oci.tar_header(e))
        if not e.is_dir:
            out.write(e.data if e.data is not None else data[e.digest])  # type: ignore[index]
            out.write(oci.padding(e.size))
    out.write(oci.trailer(out.tell()))
    assert len(out.getvalue()) == oci.archive_size(entries)
    with tarfile.open(fileobj=io.BytesIO(out.getvalue())) as tf:
        assert tf.getnames() == [
            "oci-layout",
            "index.json",
            "blobs",
            "blobs/sha256",
            *("blobs/sha256/" + d.hex for d in [manifest.digest, manifest.config.digest, layer.digest]),
        ]


def _cli(d: Daemon) -> list[str]:
    import sys

    return [sys.executable, "-m", "cli"]


def _repo() -> Path:
    from tests.conftest import REPO

    return REPO


def test_client_gone_mid_upload_leaves_nothing(victim: Daemon, tiny_archive: Path) -> None:
    """The upload stops half way (the client dies): the import is abandoned, its temp file and blobs removed."""
    import socket
    import time

    data = tiny_archive.read_bytes()
    before = store_state(victim.models)
    host, port = victim.host.split(":")
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(
            f"POST /api/import?name=gone HTTP/1.1\r\nHost: {victim.host}\r\nContent-Type: application/x-tar\r\n"
            f"Content-Length: {len(data)}\r\n\r\n".encode()
            + data[: len(data) * 2 // 3]
        )
        time.sleep(0.5)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and (temp_files(victim.models) or store_state(victim.models) != before):
        time.sleep(0.1)
    assert store_state(victim.models) == before
    assert not temp_files(victim.models)
    assert "import failed; removed" in victim.log.read_text()  # it had stored the config before the cut
