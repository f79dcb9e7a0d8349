"""``/api/create``: build a model's layers from uploaded blobs or an existing model, then write its manifest.

The daemon never opens a path a client names: files come in as blobs (``POST /api/blobs/:digest``) and are
referenced here by digest. Every model or adapter blob must be a GGUF whose header parses within sane limits.
Layers are written first; the manifest is written last and atomically, so a failed create leaves no model.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import posixpath
import secrets
from collections.abc import Generator, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from daemon.models.catalog import Catalog, check_requires, normalise_requires
from daemon.models.draft import check_vocabulary, draft_option, find_draft
from daemon.runners.quantize import QUANTIZABLE_SOURCES, SOURCE_ERROR, QuantizeFailed, parse_quant_type, run_worker
from errors import InvalidDigest, InvalidGGUF, InvalidRequest, ModelNotFound, NotSupported
from modelfile.params import validate_options
from registry.digest import Digest
from registry.gguf import FILE_TYPES, GGUFInfo, format_parameter_count, read_gguf_file
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
from registry.store import TEMP_PREFIX

log = logging.getLogger(__name__)

MESSAGE_ROLES = ("system", "user", "assistant")
SIDE_FILE_SUFFIXES = (".json", ".jinja", ".model", ".txt", ".md")
QUANT_PROGRESS_DIGEST = "0000000000000000000"  # what Ollama sends as the quantize progress's digest


@dataclass(frozen=True)
class QuantizePlan:
    """Quantize the model layer ``source`` (file type ``source_type``) to ``type_name`` (as the client spelt it,
    upper-cased: "Q4_K" stays "Q4_K" in the status, as in Ollama) = LLAMA_FTYPE ``ftype``."""

    source: Layer
    source_type: str
    type_name: str
    ftype: int


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
    from daemon.templates.gotemplate import TemplateError, parse

    try:
        parse(template)
    except TemplateError as exc:
        raise InvalidRequest(f"template error: {exc}") from None


class RoleContent(Protocol):
    """A MESSAGE of the model being created."""

    @property
    def role(self) -> str: ...
    @property
    def content(self) -> str: ...


class CreateOrder(Protocol):
    """What a create asks for: the fields of Ollama's ``/api/create`` body that :meth:`Creator.run` reads (the HTTP
    edge's ``daemon.api.schemas.CreateRequest`` has them; the model layer does not import the edge)."""

    @property
    def model_name(self) -> str: ...
    @property
    def from_(self) -> str | None: ...
    @property
    def files(self) -> Mapping[str, str] | None: ...
    @property
    def adapters(self) -> Mapping[str, str] | None: ...
    @property
    def template(self) -> str | None: ...
    @property
    def system(self) -> str | None: ...
    @property
    def license(self) -> str | Sequence[str] | None: ...
    @property
    def parameters(self) -> Mapping[str, Any] | None: ...
    @property
    def messages(self) -> Sequence[RoleContent] | None: ...
    @property
    def quantize(self) -> str | None: ...
    @property
    def quantization(self) -> str | None: ...
    @property
    def requires(self) -> str | None: ...
    @property
    def renderer(self) -> str | None: ...
    @property
    def parser(self) -> str | None: ...


class Creator:
    def __init__(self, catalog: Catalog, *, prune: bool) -> None:
        self.catalog = catalog
        self.store = catalog.store
        self.prune = prune
        self._worker: Any = None  # the quantize worker (subprocess.Popen) while one runs

    def cancel(self) -> None:
        """The client is gone: kill a running quantize worker now (thread-safe; the create then fails)."""
        worker = self._worker
        if worker is not None and worker.poll() is None:
            with contextlib.suppress(OSError):
                worker.kill()

    def run(self, req: CreateOrder) -> Iterator[dict[str, Any]]:
        """Validate everything first (raising before the first progress line), then write layers and manifest."""
        plan = self._plan(req)
        return self._execute(*plan)

    # -- validation and planning (no writes) -------------------------------------------------------------------
    def _plan(
        self, req: CreateOrder
    ) -> tuple[ModelName, list[Layer], list[tuple[str, bytes]], dict[str, Any], QuantizePlan | None]:
        raw_name = req.model_name
        name = ModelName.parse(raw_name)
        base: list[Layer]
        config: dict[str, Any]
        if req.from_:
            base, config = self._from_model(req.from_)
            if req.files:  # FROM a model plus FROM a projector file: the model gains (or swaps) its projector
                base = self._with_projector(req.from_, base, req.files)
        elif req.files:
            base, config = self._from_files(req.files)
        else:
            raise InvalidRequest("neither 'from' or 'files' was specified")
        if req.requires:  # REQUIRES: stored in the config (else inherited from FROM's model, as in Ollama)
            config = {**config, "requires": normalise_requires(req.requires)}
        check_requires(config.get("requires"), raw_name, at="cannot create the model")
        for key in ("renderer", "parser"):  # RENDERER/PARSER: config fields, else inherited as REQUIRES is
            given = req.renderer if key == "renderer" else req.parser
            if given:
                config = {**config, key: given}
        if req.adapters:
            base = [layer for layer in base if layer.media_type != MEDIA_ADAPTER] + self._adapters(req.adapters)
        if not any(layer.media_type == MEDIA_MODEL for layer in base):
            raise InvalidRequest("the model has no GGUF model layer; FROM must name a GGUF model file or a model")
        self._check_adapters(base)
        quant = self._quantize_plan(req.quantize or req.quantization or "", base)

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
        if req.adapters and not (req.parameters and "lora_scale" in req.parameters):
            params.pop("lora_scale", None)  # new adapters: the FROM model's scales were for its own adapters
        if req.parameters:
            if "lora" in req.parameters:
                raise InvalidRequest(
                    'parameter "lora" is a per-request option (llama-server\'s [{"id": N, "scale": S}]); a model '
                    "sets the default scale of each adapter with PARAMETER lora_scale, one per ADAPTER, in ADAPTER "
                    "order"
                )
            params.update(validate_options(dict(req.parameters)))
        layers = [layer for layer in layers if layer.media_type != MEDIA_PARAMS]
        self._check_scales(params, layers)
        self._check_draft(raw_name, params, layers)
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
        return name, layers, new_blobs, config, quant

    def _check_draft(self, raw_name: str, params: Mapping[str, Any], layers: list[Layer]) -> None:
        """PARAMETER draft_model (issue 28): the name must be a model in the store that can draft for this one (a
        runnable GGUF sharing its vocabulary); a 400 naming both otherwise. An empty name (no draft) is fine."""
        raw = draft_option(dict(params))
        if not raw:
            return
        draft = find_draft(self.catalog, raw, model=raw_name)
        model = next(layer for layer in layers if layer.media_type == MEDIA_MODEL)
        check_vocabulary(raw_name, str(self.store.blob_path(model.digest)), draft, raw=raw)

    def _quantize_plan(self, requested: str, base: list[Layer]) -> QuantizePlan | None:
        """Ollama's checks, before anything is written: a known type (400 listing them), an F16/BF16/F32 source
        (400). A source already of the requested type is kept as it is."""
        if not requested:
            return None
        type_name, ftype = parse_quant_type(requested)
        source = next(layer for layer in base if layer.media_type == MEDIA_MODEL)
        source_type = self._gguf(source.from_ or str(source.digest), source.digest).file_type_name
        if source_type not in QUANTIZABLE_SOURCES:
            raise InvalidRequest(SOURCE_ERROR)
        if source_type == FILE_TYPES[ftype]:
            return None
        return QuantizePlan(source, source_type, type_name, ftype)

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
        layers = [Layer(la.media_type, la.digest, la.size, from_=short, name=la.name) for la in stored.manifest.layers]
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

    def _file_layers(self, files: Mapping[str, str]) -> tuple[list[Layer], dict[str, list[str]], GGUFInfo | None]:
        """One layer per uploaded GGUF, typed by its header (model, projector or adapter), sorted model first;
        also the file names per media type and the model GGUF's header (None when there is none)."""
        layers: list[Layer] = []
        names: dict[str, list[str]] = {}
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
            names.setdefault(media, []).append(filename)
            if media == MEDIA_MODEL and model_info is None:
                model_info = info
            layers.append(Layer(media, digest, self.store.blob_size(digest), from_=posixpath.basename(filename)))
        models = sorted(names.get(MEDIA_MODEL, []))
        if len(models) > 1:
            raise InvalidRequest(
                f"more than one model GGUF was given ({_quoted(models)}); corral needs exactly one, plus at most one "
                'projector (a projector GGUF has general.architecture "clip"; split GGUF files are not supported '
                "yet)"
            )
        projectors = sorted(names.get(MEDIA_PROJECTOR, []))
        if len(projectors) > 1:
            raise InvalidRequest(
                f"more than one projector GGUF was given ({_quoted(projectors)}); a model takes at most one projector"
            )
        # the model layer first: Ollama's order, and what the runner and `show --modelfile` expect
        layers.sort(key=lambda layer: {MEDIA_MODEL: 0, MEDIA_PROJECTOR: 1, MEDIA_ADAPTER: 2}.get(layer.media_type, 3))
        return layers, names, model_info

    def _from_files(self, files: Mapping[str, str]) -> tuple[list[Layer], dict[str, Any]]:
        layers, names, model_info = self._file_layers(files)
        if model_info is None:
            projectors = names.get(MEDIA_PROJECTOR, [])
            if projectors:
                raise InvalidRequest(
                    f"{_quoted(projectors)} is a projector, and no model GGUF was given; a vision model needs two FROM "
                    "lines: the model GGUF and its projector GGUF"
                )
            raise InvalidRequest("none of the files is a GGUF model; FROM must name a GGUF model file")
        return layers, config_from_gguf(model_info)

    def _with_projector(self, source: str, base: list[Layer], files: Mapping[str, str]) -> list[Layer]:
        """FROM a stored model plus GGUF files: only a projector may come as a file (Ollama ignores such files
        silently; corral uses the projector and refuses anything else rather than dropping it)."""
        layers, names, _ = self._file_layers(files)
        others = sorted(n for media, group in names.items() if media != MEDIA_PROJECTOR for n in group)
        if others:
            raise InvalidRequest(
                f'FROM names both the model "{source}" and the GGUF file(s) {_quoted(others)}; alongside a model '
                "name, FROM may only add a projector GGUF"
            )
        if not layers:
            return base
        kept = [layer for layer in base if layer.media_type != MEDIA_PROJECTOR]
        at = next((i + 1 for i, layer in enumerate(kept) if layer.media_type == MEDIA_MODEL), len(kept))
        return kept[:at] + layers + kept[at:]

    def _adapters(self, adapters: Mapping[str, str]) -> list[Layer]:
        """One layer per ADAPTER, in the order given (an adapter's index in it is its ``id`` in a request's
        ``lora``); the same adapter twice is refused."""
        out: list[Layer] = []
        seen: dict[Digest, str] = {}
        for filename, digest_text in adapters.items():
            digest = self._blob_for(filename, digest_text)
            if digest in seen:
                raise InvalidRequest(
                    f'ADAPTER "{filename}" is the same file as ADAPTER "{seen[digest]}"; give each adapter once '
                    "(PARAMETER lora_scale sets how strongly it applies)"
                )
            seen[digest] = filename
            self._gguf(filename, digest)
            out.append(Layer(MEDIA_ADAPTER, digest, self.store.blob_size(digest), from_=posixpath.basename(filename)))
        return out

    def _check_adapters(self, layers: list[Layer]) -> None:
        """Every adapter of the model must be a LoRA adapter that fits its base model (:func:`adapter_misfit`):
        refused here, with what is wrong, rather than when a runner first loads it."""
        adapters = [layer for layer in layers if layer.media_type == MEDIA_ADAPTER]
        if not adapters:
            return
        model = next(layer for layer in layers if layer.media_type == MEDIA_MODEL)
        base = self._gguf(model.from_ or str(model.digest), model.digest)
        for layer in adapters:
            name = layer.from_ or str(layer.digest)
            problem = adapter_misfit(base, self._gguf(name, layer.digest))
            if problem:
                raise InvalidRequest(f'ADAPTER "{name}" does not fit the model: {problem}')

    @staticmethod
    def _check_scales(params: Mapping[str, Any], layers: list[Layer]) -> None:
        """PARAMETER lora_scale: at most one value per ADAPTER."""
        scales = params.get("lora_scale")
        if not isinstance(scales, list):
            return
        n = sum(1 for layer in layers if layer.media_type == MEDIA_ADAPTER)
        if len(scales) > n:
            raise InvalidRequest(
                f"PARAMETER lora_scale is given {len(scales)} times, but the model has {n} ADAPTER"
                f"{'' if n == 1 else 's'}; give one lora_scale per ADAPTER, in ADAPTER order (adapters past the "
                "last lora_scale take 1.0)"
            )

    # -- writes ------------------------------------------------------------------------------------------------
    def _execute(
        self,
        name: ModelName,
        layers: list[Layer],
        new_blobs: list[tuple[str, bytes]],
        config: dict[str, Any],
        quant: QuantizePlan | None = None,
    ) -> Iterator[dict[str, Any]]:
        statuses = []
        fresh: dict[Digest, str] = {}  # layers made here (the quantized model): their own status
        if quant is not None:
            quantized, file_type, existed = yield from self._quantize(quant)
            layers = [quantized if layer is quant.source else layer for layer in layers]
            config = {**config, "file_type": file_type}
            fresh[quantized.digest] = f"{'using existing' if existed else 'creating new'} layer {quantized.digest}"
        with self.catalog.lock:
            final_layers: list[Layer] = []
            for layer in layers:
                self.store.touch_blob(layer.digest)
                statuses.append(fresh.get(layer.digest, f"using existing layer {layer.digest}"))
                final_layers.append(layer)
            for media, data in new_blobs:
                existed = self.store.has_blob(Digest.of_bytes(data))
                digest = self.store.put_bytes(data)
                statuses.append(f"{'using existing' if existed else 'creating new'} layer {digest}")
                final_layers.append(Layer(media, digest, len(data)))
            config = {k: v for k, v in config.items() if k != "rootfs"}
            config.update(
                architecture="amd64",
                os="linux",
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

    def _quantize(self, plan: QuantizePlan) -> Generator[dict[str, Any], None, tuple[Layer, str, bool]]:
        """Quantize the source blob in a worker child process into a temp file in ``blobs/``, verify it (a GGUF of
        the requested file type), hash it and rename it into place. Yields Ollama's progress objects; returns
        ``(layer, file type name, blob existed)``. Whatever happens (a failure, the worker killed, the client
        gone), the temp file is removed: nothing half-written stays in the store."""
        status = f"quantizing {plan.source_type} model to {plan.type_name}"
        size = plan.source.size
        tmp = self.store.blobs_dir / f"{TEMP_PREFIX}{secrets.token_hex(16)}"
        src = str(self.store.blob_path(plan.source.digest))
        log.info("quantizing digest=%s from=%s to=%s", plan.source.digest, plan.source_type, plan.type_name)
        try:
            yield {"status": status, "digest": QUANT_PROGRESS_DIGEST, "total": size, "completed": 0}
            last = 0
            for done, total in run_worker(src, str(tmp), plan.type_name, on_start=self._started):
                completed = size * min(done, total) // max(total, 1)
                if completed > last:
                    last = completed
                    yield {"status": status, "digest": QUANT_PROGRESS_DIGEST, "total": size, "completed": completed}
            yield {"status": "verifying conversion"}
            want = FILE_TYPES[plan.ftype]
            try:
                info = read_gguf_file(tmp, keep_arrays=False)
            except (InvalidGGUF, OSError) as exc:
                raise QuantizeFailed(f"quantization failed: the result is not a valid GGUF file: {exc}") from None
            if info.file_type_name != want:
                raise QuantizeFailed(f"quantization failed: the result has file type {info.file_type_name}, not {want}")
            digest = _sha256_file(tmp)
            with self.catalog.lock:
                existed = self.store.has_blob(digest)
                if existed:
                    self.store.touch_blob(digest)
                else:
                    os.chmod(tmp, 0o644)
                    os.replace(tmp, self.store.blob_path(digest))
            if not existed:
                self.store.sync_blob(digest)
            new_size = self.store.blob_size(digest)
            log.info("quantized digest=%s -> %s size=%d -> %d", plan.source.digest, digest, size, new_size)
            return Layer(MEDIA_MODEL, digest, new_size), info.file_type_name, existed
        finally:
            self._worker = None
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()

    def _started(self, proc: Any) -> None:
        self._worker = proc


def _sha256_file(path: Any) -> Digest:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return Digest(h.hexdigest())


def media_type_for(info: GGUFInfo) -> str:
    """The layer a GGUF becomes, as in Ollama: an adapter by its ``general.type``; a projector when
    ``general.type`` says so, when its architecture is ``clip`` (llama.cpp's mmproj files; never a runnable language
    model), or when it has vision blocks but no language-model blocks (``<arch>.vision.block_count`` without
    ``<arch>.block_count``); otherwise the model."""
    general_type = (info.general_type or "").lower()
    if general_type == "adapter":
        return MEDIA_ADAPTER
    meta = info.metadata
    arch = info.architecture or ""
    if (
        general_type in ("projector", "mmproj")
        or arch == "clip"
        or (_positive(meta.get(f"{arch}.vision.block_count")) and not _positive(meta.get(f"{arch}.block_count")))
    ):
        return MEDIA_PROJECTOR
    return MEDIA_MODEL


def adapter_misfit(base: GGUFInfo, adapter: GGUFInfo) -> str:
    """What keeps llama.cpp from applying ``adapter`` to ``base`` (llama_adapter_lora_init's checks), or "": it must
    be a LoRA adapter (general.type "adapter", adapter.type "lora") for the base's architecture, with its tensors in
    pairs ``<w>.lora_a``/``<w>.lora_b`` for weights ``<w>`` of the base, shaped for them (ggml order: A is
    [in, rank] and B [rank, out] for a weight [in, out]; the token embedding's pair is the other way round)."""
    kind = adapter.general_type or "(none)"
    if kind != "adapter":
        return f'it is not an adapter GGUF (its general.type is "{kind}", not "adapter")'
    lora_type = adapter.metadata.get("adapter.type")
    if lora_type != "lora":
        return f'it is not a LoRA adapter (its adapter.type is {_text(lora_type)}, not "lora")'
    if adapter.architecture != base.architecture:
        return (
            f'it was made for the architecture "{adapter.architecture or "(none)"}", and the model is '
            f'"{base.architecture or "(none)"}"; an adapter only fits the base model it was trained on'
        )
    weights = {t.name: t.shape for t in base.tensors}
    pairs: dict[str, dict[str, tuple[int, ...]]] = {}
    for t in adapter.tensors:
        part = t.name.rsplit(".", 1)[-1]
        if part in ("lora_a", "lora_b"):
            pairs.setdefault(t.name[: -len(part) - 1], {})[part] = t.shape
        elif not t.name.endswith("_norm.weight"):  # llama.cpp takes norm weights beside the pairs, nothing else
            return f'its tensor "{t.name}" is neither a .lora_a/.lora_b half of a pair nor a norm weight'
    if not pairs:
        return "it has no LoRA tensors (no <weight>.lora_a / <weight>.lora_b pairs)"
    for name, pair in pairs.items():
        if "lora_a" not in pair or "lora_b" not in pair:
            missing = "lora_a" if "lora_a" not in pair else "lora_b"
            return f'its tensor pair for "{name}" has no {name}.{missing}'
        weight = weights.get(name)
        if weight is None:
            return f'it has tensors for "{name}", which the model does not have (an adapter for another model?)'
        a, b = pair["lora_a"], pair["lora_b"]
        if len(weight) != 2 or len(a) != 2 or len(b) != 2:
            return (
                f'"{name}" is not a matrix in both files (model {_dims(weight)}, lora_a {_dims(a)}, lora_b {_dims(b)})'
            )
        if name == "token_embd.weight":
            ok = weight[0] == b[1] and weight[1] == a[1] and a[0] == b[0]
        else:
            ok = weight[0] == a[0] and weight[1] == b[1] and a[1] == b[0]
        if not ok:
            return (
                f'"{name}" is {_dims(weight)} in the model, but its lora_a is {_dims(a)} and lora_b {_dims(b)}: '
                "an adapter of other tensor shapes (made for another model of this architecture?)"
            )
    return ""


def _dims(shape: tuple[int, ...]) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


def _text(value: Any) -> str:
    return f'"{value}"' if isinstance(value, str) else "(none)" if value is None else repr(value)


def _positive(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _quoted(names: list[str]) -> str:
    return ", ".join(f'"{n}"' for n in names)


def config_from_gguf(info: GGUFInfo) -> dict[str, Any]:
    arch = info.architecture or ""
    return {
        "model_format": "gguf",
        "model_family": arch,
        "model_families": [arch] if arch else None,
        "model_type": format_parameter_count(info.parameter_count),
        "file_type": info.file_type_name,
    }
