"""OCI image layouts for ``corral export`` and ``corral import`` (pure: bytes and names in, values out).

An exported model is a tar of an OCI image layout (image-spec ``image-layout.md``), readable by any OCI tool
(``skopeo inspect oci-archive:model.tar``, ``oras``)::

    oci-layout                  {"imageLayoutVersion":"1.0.0"}
    index.json                  one manifest descriptor, annotated with the tag (org.opencontainers.image.ref.name)
                                and corral's full model name (io.corral.model.name)
    blobs/                      directory entries (for tools that unpack the tar)
    blobs/sha256/
    blobs/sha256/<hex>          the manifest (Ollama's, byte for byte), then its config, then every layer

The manifest stays Ollama's (Docker v2 media type, ``application/vnd.ollama.image.*`` layers), so the model's
digest is the same in both stores. Entries are written in that order, so an importer that reads the archive as
a stream knows what to expect before the first large blob arrives; an importer must accept any order, though
(other tools write blobs first).

Everything an importer must refuse is decided here: member names (only the layout's own names, no ``..``,
absolute, Windows or backslash paths), member types (regular files and directories only: no links, devices,
FIFOs or sparse files), sizes (bounded per kind) and documents (``oci-layout`` and ``index.json``).
"""

from __future__ import annotations

import json
import tarfile
from dataclasses import dataclass
from typing import Any

from errors import InvalidDigest, InvalidModelName, InvalidRequest
from registry.digest import Digest
from registry.manifest import MANIFEST_MEDIA_TYPE, MAX_BLOB_SIZE, MAX_MANIFEST_BYTES, Manifest
from registry.names import ModelName

LAYOUT_FILE = "oci-layout"
INDEX_FILE = "index.json"
BLOBS_DIR = "blobs"
SHA256_DIR = "blobs/sha256"
LAYOUT_VERSION = "1.0.0"

INDEX_MEDIA_TYPE = "application/vnd.oci.image.index.v1+json"
OCI_MANIFEST_MEDIA_TYPE = "application/vnd.oci.image.manifest.v1+json"
MANIFEST_MEDIA_TYPES = (MANIFEST_MEDIA_TYPE, OCI_MANIFEST_MEDIA_TYPE)
ANNOTATION_REF_NAME = "org.opencontainers.image.ref.name"
ANNOTATION_MODEL_NAME = "io.corral.model.name"

#: Limits on what an importer reads into memory or accepts at all.
MAX_LAYOUT_BYTES = 4 * 1024
MAX_INDEX_BYTES = 1024 * 1024
MAX_ENTRIES = 2048  # tar members, directories included (a model has a handful of blobs)

#: Tar members are written in USTAR format with these fixed fields, so an export of a model is reproducible.
_BLOCK = tarfile.BLOCKSIZE
_RECORD = tarfile.RECORDSIZE


class InvalidArchive(InvalidRequest):
    """An archive given to ``/api/import`` that corral refuses (400). Nothing of it becomes a model."""

    def __init__(self, message: str) -> None:
        super().__init__(f"invalid archive: {message}")


# -- writing -------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Entry:
    """One member of an export: ``data`` for small documents written from memory, else ``digest`` (a blob from
    the store, ``size`` bytes); directories have neither."""

    name: str
    size: int = 0
    data: bytes | None = None
    digest: Digest | None = None
    is_dir: bool = False


def blob_name(digest: Digest) -> str:
    return f"{SHA256_DIR}/{digest.hex}"


def layout_bytes() -> bytes:
    return json.dumps({"imageLayoutVersion": LAYOUT_VERSION}, separators=(",", ":")).encode()


def index_bytes(
    name: ModelName, manifest_digest: Digest, manifest_size: int, media_type: str = MANIFEST_MEDIA_TYPE
) -> bytes:
    doc = {
        "schemaVersion": 2,
        "mediaType": INDEX_MEDIA_TYPE,
        "manifests": [
            {
                "mediaType": media_type,
                "digest": str(manifest_digest),
                "size": manifest_size,
                "annotations": {ANNOTATION_REF_NAME: name.tag, ANNOTATION_MODEL_NAME: name.full()},
            }
        ],
    }
    return json.dumps(doc, separators=(",", ":")).encode()


def export_entries(name: ModelName, manifest: Manifest) -> list[Entry]:
    """The members of ``name``'s archive, in order. Blob sizes are the manifest's; the caller checks the store's
    files against them."""
    raw = manifest.raw or manifest.to_bytes()
    digest = Digest.of_bytes(raw)
    index = index_bytes(name, digest, len(raw))
    entries = [
        Entry(LAYOUT_FILE, len(layout_bytes()), data=layout_bytes()),
        Entry(INDEX_FILE, len(index), data=index),
        Entry(BLOBS_DIR, is_dir=True),
        Entry(SHA256_DIR, is_dir=True),
        Entry(blob_name(digest), len(raw), data=raw),
    ]
    seen = {digest}
    for layer in (manifest.config, *manifest.layers):
        if layer.digest in seen:
            continue
        seen.add(layer.digest)
        entries.append(Entry(blob_name(layer.digest), layer.size, digest=layer.digest))
    return entries


def tar_header(entry: Entry) -> bytes:
    """The USTAR header block of ``entry`` (fixed owner, mode and mtime: the same model gives the same bytes)."""
    info = tarfile.TarInfo(entry.name)
    info.mtime = 0
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    if entry.is_dir:
        info.type = tarfile.DIRTYPE
        info.mode = 0o755
        info.size = 0
    else:
        info.type = tarfile.REGTYPE
        info.mode = 0o644
        info.size = entry.size
    return info.tobuf(format=tarfile.USTAR_FORMAT, encoding="utf-8", errors="strict")


def padding(size: int) -> bytes:
    """Zeros that take ``size`` bytes of member data to a whole block."""
    return b"\0" * (-size % _BLOCK)


def trailer(written: int) -> bytes:
    """The end-of-archive marker (two zero blocks) and the zeros that fill the last record, as tar(1) writes."""
    end = written + 2 * _BLOCK
    return b"\0" * (2 * _BLOCK + (-end % _RECORD))


def archive_size(entries: list[Entry]) -> int:
    """The exact length of the archive :func:`tar_header`, :func:`padding` and :func:`trailer` make."""
    total = 0
    for e in entries:
        total += _BLOCK + (0 if e.is_dir else e.size + len(padding(e.size)))
    return total + len(trailer(total))


# -- reading -------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Member:
    """A validated member: ``kind`` is ``layout``, ``index``, ``dir`` or ``blob`` (then ``digest`` is set)."""

    kind: str
    name: str
    digest: Digest | None = None


def clean_name(raw: str) -> str:
    """A member name as a layout path, or InvalidArchive: relative, slash-separated, no ``.``/``..`` parts."""
    if not isinstance(raw, str) or not raw or len(raw) > 256:
        raise InvalidArchive(f"bad member name {raw!r}")
    if "\x00" in raw or "\\" in raw or raw.startswith("/") or (len(raw) > 1 and raw[1] == ":"):
        raise InvalidArchive(f"member {raw!r} has an absolute or non-POSIX path")
    name = raw
    while name.startswith("./"):
        name = name[2:]
    if name in ("", "."):
        return "."
    parts = name.split("/")
    if any(p in ("", ".", "..") for p in parts):
        raise InvalidArchive(f"member {raw!r} is not a clean relative path (no '..', '.' or empty parts)")
    return name


def classify(info: tarfile.TarInfo) -> Member:
    """Check one tar member's type, name and size; say what it is in the layout."""
    raw = info.name
    if info.issym() or info.islnk():
        raise InvalidArchive(f"member {raw!r} is a link; an OCI layout holds only files and directories")
    if info.ischr() or info.isblk() or info.isfifo() or info.isdev():
        raise InvalidArchive(f"member {raw!r} is a device or FIFO; an OCI layout holds only files and directories")
    if info.issparse() or getattr(info, "sparse", None) is not None:
        raise InvalidArchive(f"member {raw!r} is a sparse file")
    is_dir = info.type == tarfile.DIRTYPE
    if not is_dir and info.type not in (tarfile.REGTYPE, tarfile.AREGTYPE):
        raise InvalidArchive(f"member {raw!r} has an unsupported type {info.type!r}")
    name = clean_name(raw)
    if is_dir:
        if name not in (".", BLOBS_DIR, SHA256_DIR):
            raise InvalidArchive(f"unexpected directory {raw!r} (an OCI layout has blobs/sha256/ only)")
        return Member("dir", name)
    if info.size < 0 or info.size > MAX_BLOB_SIZE:
        raise InvalidArchive(f"member {raw!r} has an impossible size {info.size}")
    if name == LAYOUT_FILE:
        if info.size > MAX_LAYOUT_BYTES:
            raise InvalidArchive(f"{LAYOUT_FILE} is {info.size} bytes, more than the {MAX_LAYOUT_BYTES} allowed")
        return Member("layout", name)
    if name == INDEX_FILE:
        if info.size > MAX_INDEX_BYTES:
            raise InvalidArchive(f"{INDEX_FILE} is {info.size} bytes, more than the {MAX_INDEX_BYTES} allowed")
        return Member("index", name)
    if name.startswith(SHA256_DIR + "/") and name.count("/") == 2:
        hex_ = name.rsplit("/", 1)[1]
        try:
            return Member("blob", name, Digest(hex_))
        except InvalidDigest:
            raise InvalidArchive(f"blob {raw!r} is not named by a sha256 digest (64 lowercase hex)") from None
    if name.startswith(BLOBS_DIR + "/"):
        raise InvalidArchive(f"unsupported blob {raw!r} (only blobs/sha256/<hex> is supported)")
    raise InvalidArchive(f"unexpected member {raw!r} (an OCI layout holds oci-layout, index.json and blobs/)")


def parse_layout(raw: bytes) -> None:
    try:
        doc = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise InvalidArchive(f"{LAYOUT_FILE} is not valid JSON") from None
    version = doc.get("imageLayoutVersion") if isinstance(doc, dict) else None
    if not isinstance(version, str) or not version.startswith("1."):
        raise InvalidArchive(f"unsupported imageLayoutVersion {version!r} in {LAYOUT_FILE} (want 1.x)")


@dataclass(frozen=True)
class IndexEntry:
    """The one manifest an archive's ``index.json`` names."""

    digest: Digest
    size: int
    media_type: str
    ref_name: str | None
    model_name: str | None


def parse_index(raw: bytes) -> IndexEntry:
    try:
        doc = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise InvalidArchive(f"{INDEX_FILE} is not valid JSON") from None
    if not isinstance(doc, dict) or doc.get("schemaVersion") != 2:
        raise InvalidArchive(f"{INDEX_FILE} must be an object with schemaVersion 2")
    manifests = doc.get("manifests")
    if not isinstance(manifests, list) or not manifests:
        raise InvalidArchive(f"{INDEX_FILE} names no manifest")
    if len(manifests) != 1:
        raise InvalidArchive(f"{INDEX_FILE} names {len(manifests)} manifests; corral imports one model per archive")
    desc: Any = manifests[0]
    if not isinstance(desc, dict):
        raise InvalidArchive(f"{INDEX_FILE}: the manifest descriptor must be an object")
    media_type = desc.get("mediaType")
    if media_type not in MANIFEST_MEDIA_TYPES:
        raise InvalidArchive(
            f"{INDEX_FILE}: unsupported manifest mediaType {media_type!r} (want {MANIFEST_MEDIA_TYPE})"
        )
    try:
        digest = Digest.parse(desc.get("digest"))  # type: ignore[arg-type]
    except InvalidDigest:
        raise InvalidArchive(f"{INDEX_FILE}: invalid manifest digest {desc.get('digest')!r}") from None
    size = desc.get("size")
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        raise InvalidArchive(f"{INDEX_FILE}: invalid manifest size {size!r}")
    if size > MAX_MANIFEST_BYTES:
        raise InvalidArchive(f"the manifest is {size} bytes, more than the {MAX_MANIFEST_BYTES} allowed")
    annotations = desc.get("annotations")
    annotations = annotations if isinstance(annotations, dict) else {}
    ref, model = annotations.get(ANNOTATION_REF_NAME), annotations.get(ANNOTATION_MODEL_NAME)
    return IndexEntry(
        digest=digest,
        size=size,
        media_type=media_type,
        ref_name=ref if isinstance(ref, str) else None,
        model_name=model if isinstance(model, str) else None,
    )


def model_name_for(entry: IndexEntry, override: ModelName | None) -> ModelName:
    """The name an import writes: ``override`` (``?name=``), else the archive's ``io.corral.model.name``."""
    if override is not None:
        return override
    if not entry.model_name:
        raise InvalidArchive(
            f"the archive does not name its model (no {ANNOTATION_MODEL_NAME} annotation in {INDEX_FILE}); "
            "give a name (corral import FILE --name NAME, or ?name= on /api/import)"
        )
    try:
        return ModelName.parse(entry.model_name)
    except InvalidModelName:
        raise InvalidArchive(
            f"the archive's model name {entry.model_name!r} is not a valid model name; give another with --name"
        ) from None


def parse_manifest(raw: bytes, entry: IndexEntry) -> Manifest:
    """The archive's manifest, checked against its descriptor (size and digest) and Manifest.parse."""
    if len(raw) != entry.size:
        raise InvalidArchive(f"the manifest is {len(raw)} bytes, {INDEX_FILE} says {entry.size}")
    actual = Digest.of_bytes(raw)
    if actual != entry.digest:
        raise InvalidArchive(f"the manifest's digest is {actual}, {INDEX_FILE} says {entry.digest}")
    return Manifest.parse(raw)
