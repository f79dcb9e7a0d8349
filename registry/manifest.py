"""Docker v2 manifests with Ollama's media types (pure: bytes in, values out)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from errors import InvalidDigest, InvalidManifest
from registry.digest import Digest

MANIFEST_MEDIA_TYPE = "application/vnd.docker.distribution.manifest.v2+json"
CONFIG_MEDIA_TYPE = "application/vnd.docker.container.image.v1+json"

_PREFIX = "application/vnd.ollama.image."
MEDIA_MODEL = _PREFIX + "model"
MEDIA_ADAPTER = _PREFIX + "adapter"
MEDIA_PROJECTOR = _PREFIX + "projector"
MEDIA_TEMPLATE = _PREFIX + "template"
MEDIA_PROMPT = _PREFIX + "prompt"  # legacy name for a template
MEDIA_SYSTEM = _PREFIX + "system"
MEDIA_PARAMS = _PREFIX + "params"
MEDIA_MESSAGES = _PREFIX + "messages"
MEDIA_LICENSE = _PREFIX + "license"

MAX_MANIFEST_BYTES = 4 * 1024 * 1024
MAX_LAYERS = 10_000
MAX_BLOB_SIZE = 1 << 50  # 1 PiB: anything larger is a lie


@dataclass(frozen=True)
class Layer:
    media_type: str
    digest: Digest
    size: int
    from_: str | None = None
    name: str | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"mediaType": self.media_type, "digest": str(self.digest), "size": self.size}
        if self.from_:
            out["from"] = self.from_
        if self.name:
            out["name"] = self.name
        return out


@dataclass(frozen=True)
class Manifest:
    config: Layer
    layers: tuple[Layer, ...]
    raw: bytes = field(default=b"", compare=False, repr=False)

    @property
    def digest(self) -> Digest:
        """The model's digest: sha256 of the manifest bytes as stored."""
        return Digest.of_bytes(self.raw or self.to_bytes())

    @property
    def size(self) -> int:
        return self.config.size + sum(layer.size for layer in self.layers)

    def blobs(self) -> set[Digest]:
        return {self.config.digest, *(layer.digest for layer in self.layers)}

    def layers_of(self, media_type: str) -> list[Layer]:
        return [layer for layer in self.layers if layer.media_type == media_type]

    def first(self, *media_types: str) -> Layer | None:
        for layer in self.layers:
            if layer.media_type in media_types:
                return layer
        return None

    def to_bytes(self) -> bytes:
        doc = {
            "schemaVersion": 2,
            "mediaType": MANIFEST_MEDIA_TYPE,
            "config": self.config.to_json(),
            "layers": [layer.to_json() for layer in self.layers],
        }
        return (json.dumps(doc, separators=(",", ":")) + "\n").encode()

    @classmethod
    def build(cls, config: Layer, layers: list[Layer] | tuple[Layer, ...]) -> Manifest:
        m = cls(config=config, layers=tuple(layers))
        return cls(config=config, layers=m.layers, raw=m.to_bytes())

    @classmethod
    def parse(cls, raw: bytes) -> Manifest:
        """Validate a manifest; every digest is checked before anything can build a path from it."""
        if len(raw) > MAX_MANIFEST_BYTES:
            raise InvalidManifest(f"manifest is {len(raw)} bytes, more than the {MAX_MANIFEST_BYTES} allowed")
        try:
            doc = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            raise InvalidManifest(f"manifest is not valid JSON: {exc}") from exc
        if not isinstance(doc, dict):
            raise InvalidManifest("manifest must be a JSON object")
        if doc.get("schemaVersion") != 2:
            raise InvalidManifest(f"unsupported manifest schemaVersion {doc.get('schemaVersion')!r} (want 2)")
        config = _layer(doc.get("config"), "config")
        layers_doc = doc.get("layers")
        if not isinstance(layers_doc, list):
            raise InvalidManifest("manifest has no layers list")
        if len(layers_doc) > MAX_LAYERS:
            raise InvalidManifest(f"manifest has {len(layers_doc)} layers, more than {MAX_LAYERS}")
        layers = tuple(_layer(item, f"layers[{i}]") for i, item in enumerate(layers_doc))
        return cls(config=config, layers=layers, raw=bytes(raw))


def _layer(item: Any, where: str) -> Layer:
    if not isinstance(item, dict):
        raise InvalidManifest(f"manifest {where} must be an object")
    media_type = item.get("mediaType")
    if not isinstance(media_type, str) or not media_type or len(media_type) > 255:
        raise InvalidManifest(f"manifest {where} has no valid mediaType")
    try:
        digest = Digest.parse(item.get("digest"))  # type: ignore[arg-type]
    except InvalidDigest as exc:
        raise InvalidManifest(f"manifest {where} has an invalid digest {item.get('digest')!r}") from exc
    size = item.get("size")
    if not isinstance(size, int) or isinstance(size, bool) or size < 0 or size > MAX_BLOB_SIZE:
        raise InvalidManifest(f"manifest {where} has an invalid size {size!r}")
    from_ = item.get("from")
    name = item.get("name")
    return Layer(
        media_type=media_type,
        digest=digest,
        size=size,
        from_=from_ if isinstance(from_, str) and from_ else None,
        name=name if isinstance(name, str) and name else None,
    )


def layer_progress(verb: str, layer: Layer, completed: int) -> dict[str, Any]:
    """One progress line of a pull or push in Ollama's shape (``completed`` left out until bytes have moved)."""
    line: dict[str, Any] = {"status": f"{verb} {layer.digest.short}", "digest": str(layer.digest), "total": layer.size}
    if completed:
        line["completed"] = completed
    return line
