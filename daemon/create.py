"""``/api/create``: build a model's layers from uploaded blobs or an existing model, then write its manifest.

The daemon never opens a path a client names: files come in as blobs (``POST /api/blobs/:digest``) and are
referenced here by digest. Every model or adapter blob must be a GGUF whose header parses within sane limits.
Layers are written first; the manifest is written last and atomically, so a failed create leaves no model.
"""

from __future__ import annotations

import json
import logging
import posixpath
from collections.abc import Iterator
from typing import Any

from daemon.catalog import Catalog
from daemon.errors import NotSupported
from daemon.schemas import CreateRequest
from modelfile.params import validate_options
from registry.digest import Digest
from registry.errors import InvalidDigest, InvalidGGUF, InvalidRequest, ModelNotFound
from registry.gguf import GGUFInfo, format_parameter_count
from registry.manifest import (
    CONFIG_MEDIA_TYPE,
    MEDIA_ADAPTER,
    MEDIA_LICENSE,
    MEDIA_MESSAGES,
    MEDIA_MODEL,
    MEDIA_PARAMS,
    MEDIA_PROJECTOR,
    MEDIA_PROMPT,
    MEDIA_SYSTEM,
    MEDIA_TEMPLATE,
    Layer,
    Manifest,
)
from registry.names import ModelName

log = logging.getLogger(__name__)

MESSAGE_ROLES = ("system", "user", "assistant")
SIDE_FILE_SUFFIXES = (".json", ".jinja", ".model", ".txt", ".md")


def check_relative(path: str) -> None:
    """Ollama's fs.ValidPath: a clean, relative, slash-separated path."""
    if (
        not path
        or "\x00" in path
        or "\\" in path
        or path.startswith("/")
        or posixpath.normpath(path) != path
        or any(part in ("", ".", "..") for part in path.split("/"))
    ):
        raise InvalidRequest(f'file path must be relative: "{path}"')


def check_template(template: str) -> None:
    """A TEMPLATE must parse as a Go template (Ollama's 400 ``template error: ...``)."""
    from daemon.gotemplate import TemplateError, parse

    try:
        parse(template)
    except TemplateError as exc:
        raise InvalidRequest(f"template error: {exc}") from None


class Creator:
    def __init__(self, catalog: Catalog, *, prune: bool) -> None:
        self.catalog = catalog
        self.store = catalog.store
        self.prune = prune

    def run(self, req: CreateRequest) -> Iterator[dict[str, Any]]:
        """Validate everything first (raising before the first progress line), then write layers and manifest."""
        plan = self._plan(req)
        return self._execute(*plan)

    # -- validation and planning (no writes) -------------------------------------------------------------------
    def _plan(self, req: CreateRequest) -> tuple[ModelName, list[Layer], list[tuple[str, bytes]], dict[str, Any]]:
        raw_name = req.model_name
        name = ModelName.parse(raw_name)
        if req.quantize or req.quantization:
            raise NotSupported(
                "quantization is not supported by corral yet; create the model from a GGUF that is already "
                "quantized (for example Q4_K_M) and leave out quantize"
            )
        base: list[Layer]
        config: dict[str, Any]
        if req.from_:
            base, config = self._from_model(req.from_)
        elif req.files:
            base, config = self._from_files(req.files)
        else:
            raise InvalidRequest("neither 'from' or 'files' was specified")
        if req.adapters:
            base = [layer for layer in base if layer.media_type != MEDIA_ADAPTER] + self._adapters(req.adapters)
        if not any(layer.media_type == MEDIA_MODEL for layer in base):
            raise InvalidRequest("the model has no GGUF model layer; FROM must name a GGUF model file or a model")

        layers = list(base)
        new_blobs: list[tuple[str, bytes]] = []  # (media type, bytes) appended in Ollama's order

        if req.template:
            check_template(req.template)
            layers = [layer for layer in layers if layer.media_type not in (MEDIA_TEMPLATE, MEDIA_PROMPT)]
            new_blobs.append((MEDIA_TEMPLATE, req.template.encode()))
        if req.system:
            layers = [layer for layer in layers if layer.media_type != MEDIA_SYSTEM]
            new_blobs.append((MEDIA_SYSTEM, req.system.encode()))
        licenses = [req.license] if isinstance(req.license, str) else list(req.license or [])
        new_blobs += [(MEDIA_LICENSE, text.encode()) for text in licenses]

        params: dict[str, Any] = {}
        old_params = next((layer for layer in layers if layer.media_type == MEDIA_PARAMS), None)
        if old_params is not None:
            old = self.catalog.json_layer(old_params.digest)
            params.update(old if isinstance(old, dict) else {})
        if req.parameters:
            params.update(validate_options(dict(req.parameters)))
        layers = [layer for layer in layers if layer.media_type != MEDIA_PARAMS]
        if params:
            new_blobs.append((MEDIA_PARAMS, json.dumps(params, separators=(",", ":")).encode()))

        if req.messages:
            for i, m in enumerate(req.messages):
                if m.role not in MESSAGE_ROLES:
                    raise InvalidRequest(
                        f'messages[{i}]: role must be one of "system", "user", or "assistant", got "{m.role}"'
                    )
            layers = [layer for layer in layers if layer.media_type != MEDIA_MESSAGES]
            doc = [{"role": m.role, "content": m.content} for m in req.messages]
            new_blobs.append((MEDIA_MESSAGES, json.dumps(doc, separators=(",", ":")).encode()))
        return name, layers, new_blobs, config

    def _from_model(self, source: str) -> tuple[list[Layer], dict[str, Any]]:
        try:
            stored = self.catalog.get(source)
        except ModelNotFound:
            raise ModelNotFound(
                source,
                f"model '{source}' not found; FROM names a model that is not in the store "
                "(pull it first, or point FROM at a GGUF file)",
            ) from None
        short = stored.name.short()
        layers = [
            Layer(l.media_type, l.digest, l.size, from_=short, name=l.name) for l in stored.manifest.layers
        ]
        config = self.catalog.config(stored.manifest)
        return layers, config

    def _blob_for(self, filename: str, digest_text: str) -> Digest:
        check_relative(filename)
        try:
            digest = Digest.parse(digest_text)
        except InvalidDigest:
            raise InvalidDigest(digest_text, f'invalid digest format for "{filename}": "{digest_text}"') from None
        if not self.store.has_blob(digest):
            raise InvalidRequest(
                f'"{filename}" ({digest}) has not been uploaded; upload it first with POST /api/blobs/{digest}'
            )
        return digest

    def _gguf(self, filename: str, digest: Digest) -> GGUFInfo:
        try:
            return self.catalog.gguf(digest)
        except InvalidGGUF as exc:
            raise InvalidGGUF(f'"{filename}" is not a usable GGUF file: {exc}') from None

    def _from_files(self, files: dict[str, str]) -> tuple[list[Layer], dict[str, Any]]:
        layers: list[Layer] = []
        model_info: GGUFInfo | None = None
        for filename, digest_text in files.items():
            digest = self._blob_for(filename, digest_text)
            lower = filename.lower()
            if lower.endswith(".safetensors"):
                raise NotSupported(
                    f'"{filename}": importing safetensors is not supported yet; convert the model to GGUF first'
                )
            if lower.endswith(SIDE_FILE_SUFFIXES):
                continue
            info = self._gguf(filename, digest)
            media = media_type_for(info)
            if media == MEDIA_MODEL:
                if model_info is not None:
                    raise InvalidRequest(
                        "more than one model GGUF was given; corral needs exactly one (split GGUF files are not "
                        "supported yet)"
                    )
                model_info = info
            layers.append(Layer(media, digest, self.store.blob_size(digest), from_=posixpath.basename(filename)))
        if model_info is None:
            raise InvalidRequest("none of the files is a GGUF model; FROM must name a GGUF model file")
        layers.sort(key=lambda layer: {MEDIA_MODEL: 0, MEDIA_PROJECTOR: 1, MEDIA_ADAPTER: 2}.get(layer.media_type, 3))
        return layers, config_from_gguf(model_info)

    def _adapters(self, adapters: dict[str, str]) -> list[Layer]:
        if len(adapters) > 1:
            raise InvalidRequest(f"only one adapter is supported, got {len(adapters)}")
        out = []
        for filename, digest_text in adapters.items():
            digest = self._blob_for(filename, digest_text)
            self._gguf(filename, digest)
            out.append(Layer(MEDIA_ADAPTER, digest, self.store.blob_size(digest), from_=posixpath.basename(filename)))
        return out

    # -- writes ------------------------------------------------------------------------------------------------
    def _execute(self, name: ModelName, layers: list[Layer], new_blobs: list[tuple[str, bytes]],
                 config: dict[str, Any]) -> Iterator[dict[str, Any]]:
        statuses = []
        with self.catalog.lock:
            final_layers: list[Layer] = []
            for layer in layers:
                self.store.touch_blob(layer.digest)
                statuses.append(f"using existing layer {layer.digest}")
                final_layers.append(layer)
            for media, data in new_blobs:
                existed = self.store.has_blob(Digest.of_bytes(data))
                digest = self.store.put_bytes(data)
                statuses.append(f"{'using existing' if existed else 'creating new'} layer {digest}")
                final_layers.append(Layer(media, digest, len(data)))
            config = {k: v for k, v in config.items() if k != "rootfs"}
            config.update(
                architecture="amd64", os="linux",
                rootfs={"type": "layers", "diff_ids": [str(layer.digest) for layer in final_layers]},
            )
            config_bytes = json.dumps(config, separators=(",", ":")).encode()
            config_digest = self.store.put_bytes(config_bytes)
            manifest = Manifest.build(Layer(CONFIG_MEDIA_TYPE, config_digest, len(config_bytes)), final_layers)

            target = self.store.canonical(name)
            old_blobs = set()
            if self.store.manifest_path(target).is_file():
                try:
                    old_blobs = self.store.read_manifest(target).blobs()
                except InvalidRequest:
                    old_blobs = set()
            self.store.write_manifest(target, manifest)
            removed = self.store.remove_unreferenced(old_blobs - manifest.blobs()) if self.prune else []
        log.info("created model=%s layers=%d size=%d", target.short(), len(final_layers), manifest.size)
        for status in statuses:
            yield {"status": status}
        yield {"status": "writing manifest"}
        if removed:
            yield {"status": "removing unused layers"}
        yield {"status": "success"}


def media_type_for(info: GGUFInfo) -> str:
    general_type = (info.general_type or "").lower()
    if general_type == "adapter":
        return MEDIA_ADAPTER
    meta = info.metadata
    arch = info.architecture or ""
    if general_type in ("projector", "mmproj") or arch == "clip" or (
        "vision.block_count" in meta and f"{arch}.block_count" not in meta
    ):
        return MEDIA_PROJECTOR
    return MEDIA_MODEL


def config_from_gguf(info: GGUFInfo) -> dict[str, Any]:
    arch = info.architecture or ""
    return {
        "model_format": "gguf",
        "model_family": arch,
        "model_families": [arch] if arch else None,
        "model_type": format_parameter_count(info.parameter_count),
        "file_type": info.file_type_name,
    }
