"""Model management over the store: resolve names, list, show, copy, delete.

All store mutations in the daemon go through :attr:`Catalog.lock`, so a delete's garbage collection never races a
create or copy that is about to reference the same blobs.
"""

from __future__ import annotations

import json
import logging
import re
import threading
from collections import OrderedDict
from datetime import datetime
from typing import Any

from daemon.chat.pipeline import ChatModel
from daemon.version import OLLAMA_COMPAT_VERSION
from errors import CorralError, InvalidGGUF, InvalidModelName, InvalidRequest, ModelNotFound
from modelfile import Modelfile, render
from modelfile.ast import Adapter, From, License, Message, Parameter, Parser, Renderer, Requires, System, Template
from registry.digest import Digest
from registry.gguf import GGUFInfo, model_info, projector_info, read_gguf_header
from registry.manifest import (
    MEDIA_ADAPTER,
    MEDIA_LICENSE,
    MEDIA_MESSAGES,
    MEDIA_MODEL,
    MEDIA_PARAMS,
    MEDIA_PROJECTOR,
    MEDIA_PROMPT,
    MEDIA_SYSTEM,
    MEDIA_TEMPLATE,
    Manifest,
)
from registry.names import ModelName
from registry.store import Store, StoredModel

log = logging.getLogger(__name__)

DEFAULT_TEMPLATE = "{{ .Prompt }}"
_SEMVER = re.compile(
    r"v?(0|[1-9][0-9]*)(?:\.(0|[1-9][0-9]*))?(?:\.(0|[1-9][0-9]*))?"
    r"(?:-([0-9A-Za-z-]+(?:\.[0-9A-Za-z-]+)*))?(?:\+[0-9A-Za-z-]+(?:\.[0-9A-Za-z-]+)*)?\Z"
)
MAX_TEXT_LAYER = 16 * 1024 * 1024
MAX_CONFIG = 1024 * 1024


def rfc3339(ts: float) -> str:
    """Go's RFC3339Nano rendering of a local time (trailing zeros trimmed, Z for UTC)."""
    dt = datetime.fromtimestamp(ts).astimezone()
    base = dt.strftime("%Y-%m-%dT%H:%M:%S")
    frac = f"{dt.microsecond:06d}".rstrip("0")
    offset = dt.strftime("%z")
    zone = "Z" if offset in ("+0000", "-0000") else f"{offset[:3]}:{offset[3:]}"
    return f"{base}{'.' + frac if frac else ''}{zone}"


def normalise_requires(value: str) -> str:
    """A REQUIRES version as Ollama stores it: semver (``1``, ``1.2`` and a leading ``v`` allowed), the ``v``
    dropped; InvalidRequest otherwise (Ollama's message)."""
    text = value.strip()
    if not _SEMVER.match(text):
        raise InvalidRequest("requires must be a valid semver (e.g. 0.14.0)")
    return text[1:] if text.startswith("v") else text


def _version_key(text: str) -> tuple[Any, ...]:
    m = _SEMVER.match(text.strip())
    if m is None:
        return (0, 0, 0, 1, ())
    major, minor, patch, pre = m.groups()
    pre_key = tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in pre.split(".")) if pre else ()
    return (int(major), int(minor or 0), int(patch or 0), 0 if pre else 1, pre_key)


def requires_newer(requires: str, have: str = OLLAMA_COMPAT_VERSION) -> bool:
    """Whether a REQUIRES version is newer than the Ollama version this corral implements."""
    return _version_key(requires) > _version_key(have)


def check_requires(requires: Any, model: str, *, at: str) -> None:
    """Refuse (400) a model that requires a newer Ollama than this corral is compatible with."""
    if isinstance(requires, str) and requires and requires_newer(requires):
        raise InvalidRequest(
            f'{at}: model "{model}" requires Ollama {requires} or newer, but this corral is compatible with Ollama '
            f"{OLLAMA_COMPAT_VERSION}; upgrade corral (or, for a model you build, lower REQUIRES in the Modelfile)"
        )


def go_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    return str(value)


class Catalog:
    def __init__(self, store: Store) -> None:
        self.store = store
        self.lock = threading.RLock()
        self._gguf_cache: OrderedDict[Digest, GGUFInfo] = OrderedDict()
        #: /api/tags' details and capabilities per manifest digest (a manifest names its config and layers by
        #: digest, so its summary never changes): a listing reads each model's config, template and GGUF header
        #: once, not on every call. Entries for models no longer listed are dropped at the next listing.
        self._summaries: dict[Digest, tuple[dict[str, Any], list[str]]] = {}

    # -- names -------------------------------------------------------------------------------------------------
    def parse_name(self, raw: str) -> ModelName:
        return ModelName.parse(raw)

    def resolve(self, raw: str) -> ModelName:
        """Validate ``raw`` and find it in the store (case-insensitively); ModelNotFound names it as given."""
        name = ModelName.parse(raw)
        return self.store.resolve(name, given=raw)

    def get(self, raw: str) -> StoredModel:
        name = self.resolve(raw)
        try:
            return self.store.get(name)
        except ModelNotFound:
            raise ModelNotFound(raw) from None

    # -- blobs as values ---------------------------------------------------------------------------------------
    def gguf(self, digest: Digest, *, verbose: bool = False) -> GGUFInfo:
        """The GGUF header of a blob, checked within sane limits (cached per digest; blobs are immutable)."""
        if not verbose and digest in self._gguf_cache:
            self._gguf_cache.move_to_end(digest)
            return self._gguf_cache[digest]
        size = self.store.blob_size(digest)
        with self.store.open_blob(digest) as f:
            info = read_gguf_header(f, size, keep_arrays=True, max_array_keep=None if verbose else 5)
        if not verbose:
            self._gguf_cache[digest] = info
            while len(self._gguf_cache) > 64:
                self._gguf_cache.popitem(last=False)
        return info

    def text(self, digest: Digest) -> str:
        return self.store.read_blob(digest, MAX_TEXT_LAYER).decode("utf-8", errors="replace")

    def json_layer(self, digest: Digest) -> Any:
        try:
            return json.loads(self.store.read_blob(digest, MAX_TEXT_LAYER))
        except ValueError as exc:
            raise CorralError(f"layer {digest} is not valid JSON: {exc}") from exc

    def config(self, manifest: Manifest) -> dict[str, Any]:
        try:
            cfg = json.loads(self.store.read_blob(manifest.config.digest, MAX_CONFIG))
        except (CorralError, ValueError, OSError) as exc:
            log.warning("unreadable config blob digest=%s error=%s", manifest.config.digest, exc)
            return {}
        return cfg if isinstance(cfg, dict) else {}

    # -- views -------------------------------------------------------------------------------------------------
    def details(
        self,
        manifest: Manifest,
        *,
        parent: str = "",
        info: GGUFInfo | None = None,
        cfg: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """Ollama's ModelDetails, from the config blob (``cfg`` when the caller has read it already); with the GGUF
        header ``info``, an unknown quantization and the context and embedding lengths come from it, as in
        Ollama's model list (``context_length`` and ``embedding_length`` are left out when unknown)."""
        if cfg is None:
            cfg = self.config(manifest)
        family = cfg.get("model_family") or ""
        families = cfg.get("model_families")
        quant = cfg.get("file_type") or ""
        if quant in ("", "unknown") and info is not None and info.file_type_name != "unknown":
            quant = info.file_type_name
        out: dict[str, Any] = {
            "parent_model": parent,
            "format": cfg.get("model_format") or "gguf",
            "family": family,
            "families": families if isinstance(families, list) else ([family] if family else None),
            "parameter_size": cfg.get("model_type") or "",
            "quantization_level": quant,
        }
        for key in ("context_length", "embedding_length"):
            value = cfg.get(key)
            if not (isinstance(value, int) and value > 0) and info is not None:
                value = info.metadata.get(f"{info.architecture}.{key}")
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                out[key] = value
        return out

    def model_gguf(self, manifest: Manifest, model: str, *, verbose: bool = False) -> GGUFInfo | None:
        """The header of the model's GGUF layer (None when it has none or it cannot be read)."""
        layer = manifest.first(MEDIA_MODEL)
        if layer is None:
            return None
        try:
            return self.gguf(layer.digest, verbose=verbose)
        except (InvalidGGUF, OSError, CorralError) as exc:
            log.warning("cannot read GGUF header model=%s error=%s", model, exc)
            return None

    def projector_gguf(self, manifest: Manifest, model: str, *, verbose: bool = False) -> GGUFInfo | None:
        """The header of the model's projector layer (None when it has none or it cannot be read)."""
        layer = manifest.first(MEDIA_PROJECTOR)
        if layer is None:
            return None
        try:
            return self.gguf(layer.digest, verbose=verbose)
        except (InvalidGGUF, OSError, CorralError) as exc:
            log.warning("cannot read the projector GGUF header model=%s error=%s", model, exc)
            return None

    def summary(self, manifest: Manifest, model: str) -> tuple[dict[str, Any], list[str]]:
        """A model's details and capabilities, exactly as /api/show computes them, cached per manifest digest."""
        cached = self._summaries.get(manifest.digest)
        if cached is not None:
            return cached
        cfg = self.config(manifest)
        info = self.model_gguf(manifest, model)
        model_layer = manifest.first(MEDIA_MODEL)
        parent = (model_layer.from_ or "") if model_layer else ""
        try:
            template = self.template_text(manifest)
        except (CorralError, OSError) as exc:
            log.warning("cannot read the template model=%s error=%s", model, exc)
            template = None
        result = (
            self.details(manifest, parent=parent, info=info, cfg=cfg),
            self.capabilities(manifest, info, template, cfg=cfg),
        )
        self._summaries[manifest.digest] = result
        return result

    def tags(self) -> list[dict[str, Any]]:
        out = []
        listed: set[Digest] = set()
        for m in self.store.list_models():
            details, capabilities = self.summary(m.manifest, m.name.short())
            listed.add(m.manifest.digest)
            out.append(
                {
                    "name": m.name.short(),
                    "model": m.name.short(),
                    "modified_at": rfc3339(m.modified_at),
                    "size": m.manifest.size,
                    "digest": m.manifest.digest.hex,
                    "details": dict(details),
                    "capabilities": list(capabilities),
                }
            )
        for digest in [d for d in list(self._summaries) if d not in listed]:
            self._summaries.pop(digest, None)
        return out

    def template_text(self, manifest: Manifest) -> str | None:
        layer = manifest.first(MEDIA_TEMPLATE, MEDIA_PROMPT)
        return self.text(layer.digest) if layer else None

    def system_text(self, manifest: Manifest) -> str | None:
        layer = manifest.first(MEDIA_SYSTEM)
        return self.text(layer.digest) if layer else None

    def params(self, manifest: Manifest) -> dict[str, Any]:
        layer = manifest.first(MEDIA_PARAMS)
        if not layer:
            return {}
        data = self.json_layer(layer.digest)
        return data if isinstance(data, dict) else {}

    def messages(self, manifest: Manifest) -> list[dict[str, str]]:
        layer = manifest.first(MEDIA_MESSAGES)
        if not layer:
            return []
        data = self.json_layer(layer.digest)
        if not isinstance(data, list):
            return []
        return [
            {"role": str(m.get("role", "")), "content": str(m.get("content", ""))} for m in data if isinstance(m, dict)
        ]

    def licenses(self, manifest: Manifest) -> list[str]:
        return [self.text(layer.digest) for layer in manifest.layers_of(MEDIA_LICENSE)]

    def chat_model(self, manifest: Manifest, template: str | None, info: GGUFInfo | None) -> ChatModel:
        """The model's chat behaviour: template, Jinja chat template, RENDERER and PARSER."""
        return _chat_model(template, info.chat_template if info else None, self.config(manifest))

    def capabilities(
        self, manifest: Manifest, info: GGUFInfo | None, template: str | None, *, cfg: dict[str, Any] | None = None
    ) -> list[str]:
        caps: list[str] = []
        meta = info.metadata if info else {}
        arch = meta.get("general.architecture", "")
        if f"{arch}.pooling_type" in meta:
            caps.append("embedding")
        else:
            caps.append("completion")
        cfg = self.config(manifest) if cfg is None else cfg
        chat = _chat_model(template, info.chat_template if info else None, cfg)
        chat_caps = chat.capabilities()
        if "tools" in chat_caps:
            caps.append("tools")
        if ".Suffix" in (template or ""):
            caps.append("insert")
        # only a projector layer makes a model see: llama.cpp's mtmd needs the projector GGUF, and the vision
        # tensors some Ollama-engine GGUFs carry inside the model file (``<arch>.vision.block_count``) are not
        # usable by corral's runner, so claiming vision for them would accept images it cannot look at
        if manifest.first(MEDIA_PROJECTOR):
            caps.append("vision")
        if "thinking" in chat_caps:
            caps.append("thinking")
        extra = cfg.get("capabilities")
        if isinstance(extra, list):
            caps += [c for c in extra if isinstance(c, str) and c not in caps]
        return caps

    def show(
        self, raw: str, *, verbose: bool = False, system: str | None = None, options: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        stored = self.get(raw)
        manifest = stored.manifest
        model_layer = manifest.first(MEDIA_MODEL)
        info = None
        if model_layer is not None:
            try:
                info = self.gguf(model_layer.digest, verbose=verbose)
            except (InvalidGGUF, OSError, CorralError) as exc:
                log.warning("cannot read GGUF header model=%s error=%s", raw, exc)
        template = self.template_text(manifest)
        sys_text = system if system is not None else self.system_text(manifest)
        params = {**self.params(manifest), **(options or {})}
        messages = self.messages(manifest)
        licenses = self.licenses(manifest)
        shown_template = template
        if shown_template is None:
            shown_template = (info.chat_template if info else None) or DEFAULT_TEMPLATE

        header = (
            '# Modelfile generated by "corral show"\n'
            "# To build a new Modelfile based on this, replace FROM with:\n"
            f"# FROM {stored.name.short()}\n\n"
        )
        cfg = self.config(manifest)
        requires, renderer, parser = (
            value if isinstance(value := cfg.get(key), str) else "" for key in ("requires", "renderer", "parser")
        )
        body = render(
            self.modelfile(
                manifest,
                template,
                sys_text,
                params,
                messages,
                licenses,
                requires=requires,
                renderer=renderer,
                parser=parser,
            )
        )
        out: dict[str, Any] = {}
        if licenses:
            out["license"] = "\n".join(licenses)
        out["modelfile"] = header + body
        param_lines = []
        for key, value in params.items():
            for v in value if isinstance(value, list) else [value]:
                param_lines.append(f"{key:<30} {go_value(v)}")
        if param_lines:
            out["parameters"] = "\n".join(param_lines)
        out["template"] = shown_template
        if sys_text:
            out["system"] = sys_text
        if renderer:
            out["renderer"] = renderer
        if parser:
            out["parser"] = parser
        out["details"] = self.details(
            manifest, parent=(model_layer.from_ or "") if model_layer else "", info=info, cfg=cfg
        )
        if messages:
            out["messages"] = messages
        out["model_info"] = model_info(info, verbose) if info else {}
        projector = self.projector_gguf(manifest, raw, verbose=verbose)
        if projector is not None:
            out["projector_info"] = projector_info(projector, verbose)
        if verbose and info is not None:
            out["tensors"] = [{"name": t.name, "type": t.type_name, "shape": list(t.shape)} for t in info.tensors]
        out["capabilities"] = self.capabilities(manifest, info, template, cfg=cfg)
        out["modified_at"] = rfc3339(stored.modified_at)
        if requires:
            out["requires"] = requires
        return out

    def requires(self, manifest: Manifest) -> str:
        """The model's REQUIRES version (its config's ``requires``), or ""."""
        value = self.config(manifest).get("requires")
        return value if isinstance(value, str) else ""

    def check_requires(self, manifest: Manifest, model: str) -> None:
        """Refuse to run a model that requires a newer Ollama than this corral is compatible with."""
        check_requires(self.requires(manifest), model, at="cannot load the model")

    def modelfile(
        self,
        manifest: Manifest,
        template: str | None,
        system: str | None,
        params: dict[str, Any],
        messages: list[dict[str, str]],
        licenses: list[str],
        *,
        requires: str = "",
        renderer: str = "",
        parser: str = "",
    ) -> Modelfile:
        ins: list[Any] = []
        for layer in manifest.layers:
            if layer.media_type == MEDIA_MODEL:
                ins.append(From(str(self.store.blob_path(layer.digest))))
        for layer in manifest.layers_of(MEDIA_ADAPTER):
            ins.append(Adapter(str(self.store.blob_path(layer.digest))))
        for layer in manifest.layers_of(MEDIA_PROJECTOR):
            ins.append(From(str(self.store.blob_path(layer.digest))))
        if template:
            ins.append(Template(template))
        if system:
            ins.append(System(system))
        if renderer:  # Ollama's order: after SYSTEM, before the parameters
            ins.append(Renderer(renderer))
        if parser:
            ins.append(Parser(parser))
        for key, value in params.items():
            for v in value if isinstance(value, list) else [value]:
                ins.append(Parameter(key, v))
        ins += [License(text) for text in licenses]
        ins += [Message(m["role"], m["content"]) for m in messages]
        if requires:
            ins.append(Requires(requires))
        return Modelfile(tuple(ins))

    # -- mutations ---------------------------------------------------------------------------------------------
    def copy(self, source: str, destination: str) -> None:
        try:
            src = ModelName.parse(source)
        except InvalidModelName:
            raise InvalidRequest(f'source "{source}" is invalid') from None
        try:
            dst = ModelName.parse(destination)
        except InvalidModelName:
            raise InvalidRequest(f'destination "{destination}" is invalid') from None
        with self.lock:
            src = self.store.canonical(src)
            if not self.store.manifest_path(src).is_file():
                raise ModelNotFound(source, f'model "{source}" not found')
            self.store.copy(src, self.store.canonical(dst))

    def delete(self, raw: str) -> list[Digest]:
        try:
            name = ModelName.parse(raw)
        except InvalidModelName:
            raise InvalidRequest(f'name "{raw}" is invalid') from None
        with self.lock:
            canonical = self.store.canonical(name)
            if not self.store.manifest_path(canonical).is_file():
                raise ModelNotFound(raw)
            removed = self.store.delete(canonical)
        log.info("deleted model=%s blobs_removed=%d", canonical.short(), len(removed))
        return removed


def _chat_model(template: str | None, chat_template: str | None, cfg: dict[str, Any]) -> ChatModel:
    renderer, parser = (value if isinstance(value := cfg.get(key), str) else "" for key in ("renderer", "parser"))
    return ChatModel(template=template, chat_template=chat_template, renderer=renderer, parser=parser)
