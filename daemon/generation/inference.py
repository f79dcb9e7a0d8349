"""From an API request to a runner: resolve the model, merge and check options, build the load spec and the
sampling parameters, and hold a scheduler lease while the runner works."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import time
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from daemon.chat.pipeline import ChatModel
from daemon.generation import lora
from daemon.models.catalog import Catalog
from daemon.models.draft import Draft, check_vocabulary, draft_option, find_draft
from daemon.rpc import RpcPool
from daemon.rpc import split as rpc_split
from daemon.runners.base import LoadSpec, MemoryUse, SampleParams
from daemon.scheduling.scheduler import Adapter, Lease, ModelRef, Scheduler
from daemon.settings import Settings, SettingsError, parse_duration
from errors import CorralError, InvalidRequest
from modelfile.params import (
    DEFAULT_OPTIONS,
    DEPRECATED_OPTIONS,
    OPTION_TYPES,
    SPECULATIVE_DEFAULTS,
    check_value,
    validate_options,
)
from registry.digest import Digest
from registry.gguf import GGUFInfo
from registry.manifest import MEDIA_ADAPTER, MEDIA_MODEL, MEDIA_PROJECTOR
from registry.names import ModelName
from registry.store import StoredModel

if TYPE_CHECKING:
    from daemon.scheduling.memory import Estimate

log = logging.getLogger(__name__)

# A generic JSON grammar (GBNF) for format: "json": any JSON object.
JSON_GBNF = r"""
root   ::= object
value  ::= object | array | string | number | ("true" | "false" | "null") ws
object ::= "{" ws ( string ":" ws value ("," ws string ":" ws value)* )? "}" ws
array  ::= "[" ws ( value ("," ws value)* )? "]" ws
string ::= "\"" ( [^"\\\x7F\x00-\x1F] | "\\" (["\\bfnrt/] | "u" [0-9a-fA-F]{4}) )* "\"" ws
number ::= ("-"? ([0-9] | [1-9] [0-9]{0,15})) ("." [0-9]+)? ([eE] [-+]? [0-9] [1-9]{0,15})? ws
ws     ::= | " " | "\n" [ \t]{0,20}
"""


_second_cache: list[Any] = [-1, ""]


MODEL_CACHE = 64  # model lookups remembered (Inference.lookup)


def now_rfc3339() -> str:
    """UTC with nanosecond precision, as Ollama's created_at (the per-second prefix is cached: hot path)."""
    ns = time.time_ns()
    sec, frac = divmod(ns, 1_000_000_000)
    if _second_cache[0] != sec:
        _second_cache[0] = sec
        _second_cache[1] = datetime.fromtimestamp(sec, UTC).strftime("%Y-%m-%dT%H:%M:%S.")
    return f"{_second_cache[1]}{frac:09d}Z"


def keep_alive_value(raw: Any) -> float | None:
    """A request's keep_alive in seconds (inf = forever), or None when absent."""
    if raw is None:
        return None
    try:
        return parse_duration(raw, "keep_alive")
    except SettingsError as exc:
        raise InvalidRequest(str(exc)) from None


@dataclass
class ModelContext:
    raw: str  # the name as the client gave it
    name: ModelName
    stored: StoredModel
    model_path: Path
    adapters: tuple[str, ...]
    info: GGUFInfo
    template: str | None  # the Go TEMPLATE layer
    system: str | None
    params: dict[str, Any]
    messages: list[dict[str, str]]
    capabilities: list[str]
    details: dict[str, Any] = field(default_factory=dict)
    chat: ChatModel = field(default_factory=ChatModel)  # template, renderer and parser: how it chats
    projector_path: Path | None = None  # the vision projector (mmproj) blob, loaded with the model
    adapter_bytes: tuple[int, ...] = ()  # each adapter's file size, in ``adapters`` order (its memory, once loaded)

    @property
    def projector_memory(self) -> int:
        """The projector's bytes loaded (tensors and its compute buffer), 0 without one: counted with the model."""
        if self.projector_path is None:
            return 0
        from daemon.scheduling.memory import projector_file_memory

        return projector_file_memory(str(self.projector_path))

    @property
    def chat_template(self) -> str | None:
        return self.info.chat_template

    @property
    def ref(self) -> ModelRef:
        """The model's generation runner: the key is the base weights, not the name nor the adapters. Names that
        resolve to the same model file (a copy, a Modelfile that only changes SYSTEM, TEMPLATE, PARAMETER or
        MESSAGE, or one that adds ADAPTERs: the runner applies them per request, issue 29) share one runner, with
        the base's weights counted once. The projector is part of it: the same weights with another projector
        (or none) see images differently."""
        return self._ref(with_adapters=False)

    @property
    def embedding_ref(self) -> ModelRef:
        """The model's embedding runner: llama.cpp's high-level API applies adapters to the whole model at load,
        so they are part of what it is loaded for."""
        return self._ref(with_adapters=True)

    def _ref(self, *, with_adapters: bool) -> ModelRef:
        parts = [self.model_path.name, *(Path(a).name for a in self.adapters if with_adapters)]
        if self.projector_path is not None:
            parts.append(f"mmproj:{self.projector_path.name}")
        weights = "+".join(parts)
        return ModelRef(
            key=weights, name=self.name.short(), digest=self.stored.manifest.digest.hex, details=self.details
        )


class Inference:
    def __init__(
        self,
        catalog: Catalog,
        scheduler: Scheduler,
        settings: Settings,
        *,
        vram_budget: int = 0,
        physical_cores: int = 0,
        logical_cores: int = 0,
        ram_budget: int = 0,
        default_num_ctx: int = 4096,
        gpu_budgets: tuple[int, ...] = (),
        shared_memory: bool = False,
        rpc: RpcPool | None = None,
    ) -> None:
        self.rpc = rpc  # llama.cpp rpc-servers (CORRAL_RPC_SERVERS): their budgets are added to vram_budget
        self.catalog = catalog
        self.gpu_budgets = gpu_budgets  # VRAM budget per visible GPU, in llama.cpp's device order (hardware.Budgets)
        self.scheduler = scheduler
        self.settings = settings
        self.local_vram_budget = vram_budget  # the local GPUs'
        self.ram_budget = ram_budget
        self.shared_memory = shared_memory  # unified memory: what goes to the GPU comes out of the RAM budget too
        self.physical_cores = physical_cores
        self.logical_cores = logical_cores  # what runners may use (CPU affinity, a container's CPU quota)
        self.default_num_ctx = default_num_ctx  # CORRAL_CONTEXT_LENGTH, or automatic by VRAM (see create_app)
        self._estimates: dict[tuple[str, int, int, int, int, str, str], Estimate] = {}
        self._kv_keys: dict[tuple[str, ...], str] = {}  # kv_key_for, per model file, adapters, projector, KV settings
        # model() by the name as given, with what proves it current: the store's generation and the manifest's
        # identity on disk (a manifest replaced or removed behind the daemon's back shows in its stat)
        self._models: OrderedDict[str, tuple[int, tuple[int, int, int], ModelContext]] = OrderedDict()
        # draft models (speculative decoding) by the name as given, with what proves them current (as _models)
        self._drafts: dict[str, tuple[int, tuple[int, int, int] | None, Draft]] = {}
        self._draft_names: dict[str, str] = {}  # draft blob path -> the name it was last asked by (/api/ps shows it)

    # -- the model ---------------------------------------------------------------------------------------------
    async def lookup(self, raw: str) -> ModelContext:
        """:meth:`model` for a request: a name looked up before, whose manifest has not changed since, comes from
        memory at the cost of one ``stat`` on the event loop; otherwise the store is read in a worker thread. Every
        request to a model needs this before it can reach the runner, so a burst of requests (16 users at once)
        reaches it within a few milliseconds instead of one worker-thread hop and a few file reads apart."""
        store = self.catalog.store
        hit = self._models.get(raw)
        if hit is not None:
            generation, identity, ctx = hit
            if generation == store.generation and identity == store.manifest_stamp(ctx.stored.name):
                self._models.move_to_end(raw)
                return ctx
            del self._models[raw]
        from starlette.concurrency import run_in_threadpool

        generation = store.generation
        ctx = await run_in_threadpool(self.model, raw)
        stamp = store.manifest_stamp(ctx.stored.name)
        if stamp is not None:
            self._models[raw] = (generation, stamp, ctx)
            while len(self._models) > MODEL_CACHE:
                self._models.popitem(last=False)
        return ctx

    @property
    def vram_budget(self) -> int:
        """What a load may offload: the local GPUs' budget and what the llama.cpp rpc-servers in use lend now."""
        return self.local_vram_budget + (self.rpc.budget if self.rpc is not None else 0)

    def model(self, raw: str) -> ModelContext:
        stored = self.catalog.get(raw)
        manifest = stored.manifest
        self.catalog.check_requires(manifest, raw)  # REQUIRES newer than this corral's Ollama version: a 400
        layer = manifest.first(MEDIA_MODEL)
        if layer is None:
            raise InvalidRequest(f"model '{raw}' has no GGUF model layer and cannot be run")
        info = self.catalog.gguf(layer.digest)
        from daemon.scheduling.memory import layers_of

        layers_of(info)  # the per-layer sums, once, here in the thread pool: load_spec then runs in O(1) per estimate
        template = self.catalog.template_text(manifest)
        projector = manifest.first(MEDIA_PROJECTOR)
        adapter_layers = manifest.layers_of(MEDIA_ADAPTER)
        mctx = ModelContext(
            raw=raw,
            name=stored.name,
            stored=stored,
            model_path=self.catalog.store.blob_path(layer.digest),
            adapters=tuple(str(self.catalog.store.blob_path(a.digest)) for a in adapter_layers),
            info=info,
            template=template,
            system=self.catalog.system_text(manifest),
            params=self.catalog.params(manifest),
            messages=self.catalog.messages(manifest),
            capabilities=self.catalog.capabilities(manifest, info, template),
            details=self.catalog.details(manifest),
            chat=self.catalog.chat_model(manifest, template, info),
            projector_path=None if projector is None else self.catalog.store.blob_path(projector.digest),
            adapter_bytes=tuple(_adapter_size(self.catalog.store.blob_path(a.digest), a.size) for a in adapter_layers),
        )
        mctx.projector_memory  # noqa: B018 - read its header here, in the thread pool, not in load_spec
        if draft_option(mctx.params) and "completion" in mctx.capabilities:
            # the model's own draft (PARAMETER draft_model): resolved and its vocabulary compared here, in the
            # thread pool, so load_spec finds both remembered; what is wrong is said there, when a request drafts
            with contextlib.suppress(CorralError):
                self.draft_for(mctx, mctx.params)
        return mctx

    # -- the draft model (speculative decoding, issue 28) ------------------------------------------------------
    def draft_for(self, ctx: ModelContext, opts: dict[str, Any]) -> Draft | None:
        """The draft model the merged options name (a request's ``draft_model`` over the model's PARAMETER; ""
        for none), resolved in the store and checked to share the model's vocabulary: a 400 naming both
        otherwise. Both the resolution and the comparison are remembered (this runs on every request)."""
        raw = draft_option(opts)
        if not raw:
            return None
        store = self.catalog.store
        hit = self._drafts.get(raw)
        draft: Draft | None = None
        if hit is not None:
            generation, stamp, known = hit
            if generation == store.generation and stamp is not None and stamp == store.manifest_stamp(known.model):
                draft = known
        if draft is None:
            generation = store.generation
            draft = find_draft(self.catalog, raw, model=ctx.raw)
            if len(self._drafts) >= MODEL_CACHE:
                self._drafts.clear()
            self._drafts[raw] = (generation, store.manifest_stamp(draft.model), draft)
        check_vocabulary(ctx.raw, str(ctx.model_path), draft, raw=raw)
        if len(self._draft_names) >= MODEL_CACHE:
            self._draft_names.clear()
        self._draft_names[str(draft.path)] = draft.name
        return draft

    def draft_name(self, path: str) -> str:
        """The model name a draft blob was last asked for by ("" for none or unknown)."""
        return self._draft_names.get(path, "") if path else ""

    def _draft_layers(self, draft: Draft, num_ctx: int, num_batch: int, parallel: int, left: int, kv: str) -> int:
        """The draft's GPU layers: the target's offload policy applied to the VRAM the target leaves (``left``):
        all of its layers when they fit, else as many as fit, none without a GPU budget."""
        if self.vram_budget <= 0 or left <= 0:
            return 0
        from daemon.scheduling.memory import choose_gpu_layers

        return choose_gpu_layers(
            draft.info, num_ctx=num_ctx, num_parallel=parallel, num_batch=num_batch, vram_budget=left, kv_type=kv
        )

    def _with_draft(
        self,
        draft: Draft | None,
        est: Estimate,
        num_ctx: int,
        num_batch: int,
        parallel: int,
        kv: str,
        *,
        cpu_only: bool = False,
    ) -> tuple[int, int, int]:
        """(the draft's GPU layers, ram, vram) of the target's estimate ``est`` plus the draft beside it."""
        if draft is None:
            return 0, est.ram, est.vram
        from daemon.scheduling.memory import draft_memory

        left = self.vram_budget - est.vram
        layers = 0 if cpu_only else self._draft_layers(draft, num_ctx, num_batch, parallel, left, kv)
        ram, vram = draft_memory(
            draft.info, num_ctx=num_ctx, num_parallel=parallel, num_batch=num_batch, n_gpu_layers=layers, kv_type=kv
        )
        return layers, est.ram + ram, est.vram + vram

    def has_projector(self, ctx: ModelContext) -> bool:
        return ctx.stored.manifest.first(MEDIA_PROJECTOR) is not None

    # -- options -----------------------------------------------------------------------------------------------
    def options(self, ctx: ModelContext, request_options: Any) -> dict[str, Any]:
        """Built-in defaults < the model's PARAMETERs < the request's options (checked; unknown keys ignored).
        ``num_ctx`` set by neither comes from the daemon's default (``CORRAL_CONTEXT_LENGTH`` or by VRAM), not
        from the built-in table, as in Ollama."""
        if request_options is None:
            request_options = {}
        if not isinstance(request_options, dict):
            raise InvalidRequest(f"options must be an object, got {type(request_options).__name__}")
        merged: dict[str, Any] = dict(DEFAULT_OPTIONS)
        model_opts = validate_options(ctx.params, ignore_unknown=True)
        merged.update(model_opts)
        unknown = [
            k for k in request_options if k not in OPTION_TYPES and k not in DEPRECATED_OPTIONS and k != "logit_bias"
        ]
        if unknown:
            log.warning("invalid option provided options=%s", ",".join(map(str, unknown)))
        request_opts = validate_options(request_options, ignore_unknown=True)
        merged.update(request_opts)
        if "num_ctx" not in model_opts and "num_ctx" not in request_opts:
            merged["num_ctx"] = self.default_num_ctx
        self._check_ranges(merged)
        # logit_bias (OpenAI's, a corral extension in options too) is not merged: the dialect parsed it once into
        # the call (daemon.generation.calls.options_and_bias), and sample_params takes it from there
        return merged

    @staticmethod
    def _check_ranges(o: dict[str, Any]) -> None:
        """Every merged value within its range (``modelfile.params.check_value``: finite numbers, repeat_penalty
        above 0, num_thread within this machine's bound...), whichever layer it came from; a ParameterError (400)
        names the option."""
        for key, value in o.items():
            check_value(key, value)

    def load_spec(self, ctx: ModelContext, opts: dict[str, Any], *, embedding: bool = False) -> LoadSpec:
        trained = ctx.info.context_length or opts["num_ctx"]
        num_ctx = max(4, min(int(opts["num_ctx"]), int(trained)))
        if self.has_projector(ctx):
            num_ctx = max(num_ctx, 2048)
        num_batch = min(int(opts["num_batch"]), num_ctx) if embedding else int(opts["num_batch"])
        kv_type = self.settings.kv_cache_type
        # a quantized KV cache needs flash attention (llama.cpp refuses a quantized V cache without it), so "auto"
        # means on there, and /api/ps says so
        flash_attn = self.settings.flash_attention
        if kv_type != "f16" and flash_attn == "auto":
            flash_attn = "on"
        # the draft model (speculative decoding): generation only, never an embedding or rerank runner
        draft = None if embedding else self.draft_for(ctx, opts)
        num_parallel = 1 if embedding else self.parallel_for(ctx, num_ctx, num_batch, kv_type, draft=draft)
        num_gpu = int(opts["num_gpu"])
        if num_gpu < 0:
            num_gpu = self.choose_gpu_layers(ctx, num_ctx, num_batch, num_parallel, kv_type)
        num_thread = int(opts["num_thread"]) or self.physical_cores
        prompt_cache = (
            0
            if embedding
            else self.prompt_cache_for(ctx, num_ctx, num_batch, num_parallel, num_gpu, kv_type, draft=draft)
        )
        draft_gpu = 0
        if draft is not None:
            est = self._estimate(ctx, num_ctx, num_batch, num_parallel, num_gpu, kv_type)
            draft_gpu, _, _ = self._with_draft(
                draft, est, num_ctx, num_batch, num_parallel, kv_type, cpu_only=num_gpu == 0
            )
        # the prompt cache on disk: for generation only (an embedding or rerank runner keeps no KV state)
        kv_dir = self.settings.kv_disk_dir
        kv_disk = not embedding and self.settings.kv_disk > 0 and kv_dir is not None
        return LoadSpec(
            model_path=str(ctx.model_path),
            # a generation runner is loaded with the base alone and applies adapters per request
            # (GenerateRequest.adapters), so every model over this base shares it; an embedding runner (llama.cpp's
            # high-level API) is loaded with them
            adapters=ctx.adapters if embedding else (),
            num_ctx=num_ctx,
            num_batch=num_batch,
            num_gpu=num_gpu,
            num_thread=num_thread,
            cpus=self.logical_cores,
            use_mmap=opts.get("use_mmap"),
            num_parallel=num_parallel,
            embedding=embedding,
            prompt_cache=prompt_cache,
            main_gpu=(placement := self.gpu_split(ctx, opts, num_ctx, num_batch, num_parallel, num_gpu))[0],
            tensor_split=placement[1],
            flash_attn=flash_attn,
            kv_cache_type=kv_type,
            projector_path="" if embedding else _projector_of(ctx),
            kv_disk_dir=str(kv_dir) if kv_disk else "",
            kv_disk_bytes=self.settings.kv_disk if kv_disk else 0,
            kv_key=self.kv_key_for(ctx, kv_type, flash_attn) if kv_disk else "",  # the base's, shared
            draft_path="" if draft is None else str(draft.path),
            draft_num_gpu=draft_gpu,
            rpc_servers=tuple(s.endpoint for s in self.rpc.active) if self.rpc is not None and num_gpu else (),
        )

    def kv_key_for(self, ctx: ModelContext, kv_type: str, flash_attn: str) -> str:
        """The daemon's part of the prompt cache's key (``LoadSpec.kv_key``): canonical JSON of everything of the
        runner's that makes its KV state valid: the model and projector blob digests, the KV cache type, flash
        attention (the V cache's layout) and the model's rope and context metadata. The key is the base's (no
        adapters, ``"adapters": []``): a generation runner is shared by every model over its base, and KV computed
        under an adapter never goes to the disk cache (the runner keeps it apart, issue 29). Remembered per model
        file (it runs on every request)."""
        projector = _projector_of(ctx)
        memo = (str(ctx.model_path), projector, kv_type, flash_attn)
        key = self._kv_keys.get(memo)
        if key is None:
            arch = ctx.info.architecture
            rope = {
                k: v
                for k, v in sorted(ctx.info.metadata.items())
                if (k.startswith(f"{arch}.rope.") or k == f"{arch}.context_length") and _plain_json(v)
            }
            key = json.dumps(
                {
                    "model": _blob_digest(str(ctx.model_path)),
                    "adapters": [],  # the base's KV alone (see above)
                    "projector": _blob_digest(projector) if projector else "",
                    "rope": rope,
                    "kv_type": kv_type,
                    "flash_attn": flash_attn,
                },
                sort_keys=True,
                separators=(",", ":"),
            )
            if len(self._kv_keys) >= 256:
                self._kv_keys.clear()
            self._kv_keys[memo] = key
        return key

    def parallel_for(
        self, ctx: ModelContext, num_ctx: int, num_batch: int, kv_type: str = "f16", *, draft: Draft | None = None
    ) -> int:
        """``CORRAL_NUM_PARALLEL`` when set; else the most sequence slots (at most 4) whose KV cache, at this
        num_ctx each, fits the memory budgets, counting what the GPU takes off the RAM (and the draft model's
        weights and KV cache, when there is one)."""
        if self.settings.num_parallel > 0:
            return self.settings.num_parallel
        for parallel in (4, 3, 2):
            layers = self.choose_gpu_layers(ctx, num_ctx, num_batch, parallel, kv_type)
            est = self._estimate(ctx, num_ctx, num_batch, parallel, layers, kv_type)
            _, ram, vram = self._with_draft(draft, est, num_ctx, num_batch, parallel, kv_type, cpu_only=layers == 0)
            ram += vram if self.shared_memory else 0
            if (self.ram_budget <= 0 or ram <= self.ram_budget) and vram <= max(self.vram_budget, 0):
                return parallel
        return 1

    def prompt_cache_for(
        self,
        ctx: ModelContext,
        num_ctx: int,
        num_batch: int,
        num_parallel: int,
        num_gpu: int,
        kv_type: str = "f16",
        *,
        draft: Draft | None = None,
    ) -> int:
        """Host RAM for the sequences a runner saves when it reuses a slot: as much as the slots' KV cache, when
        the model (with its draft model) and that much more fit the RAM budget together (else none: the model
        itself comes first)."""
        est = self._estimate(ctx, num_ctx, num_batch, num_parallel, num_gpu, kv_type)
        want = est.kv_per_layer * len(est.weights_per_layer)
        _, ram, vram = self._with_draft(draft, est, num_ctx, num_batch, num_parallel, kv_type, cpu_only=num_gpu == 0)
        if self.ram_budget > 0 and ram + (vram if self.shared_memory else 0) + want > self.ram_budget:
            return 0
        return want

    def _estimate(
        self, ctx: ModelContext, num_ctx: int, num_batch: int, num_parallel: int, num_gpu: int, kv_type: str = "f16"
    ) -> Estimate:
        """``daemon.scheduling.memory.estimate``, remembered per model file (blobs never change) and shape:
        ``load_spec`` runs on every request and would otherwise estimate the same model several times each time
        (~0.25 ms each)."""
        key = (str(ctx.model_path), num_ctx, num_batch, num_parallel, num_gpu, _projector_of(ctx), kv_type)
        est = self._estimates.get(key)
        if est is None:
            from daemon.scheduling.memory import estimate

            if len(self._estimates) >= 256:
                self._estimates.clear()
            est = self._estimates[key] = estimate(
                ctx.info,
                num_ctx=num_ctx,
                num_parallel=num_parallel,
                num_batch=num_batch,
                n_gpu_layers=num_gpu,
                kv_type=kv_type,
                projector=_projector_memory(ctx),
            )
        return est

    def choose_gpu_layers(
        self, ctx: ModelContext, num_ctx: int, num_batch: int, num_parallel: int = 1, kv_type: str = "f16"
    ) -> int:
        if self.vram_budget <= 0:
            return 0
        from daemon.scheduling.memory import choose_gpu_layers

        return choose_gpu_layers(
            ctx.info,
            num_ctx=num_ctx,
            num_parallel=num_parallel,
            num_batch=num_batch,
            vram_budget=self.vram_budget,
            kv_type=kv_type,
            projector=_projector_memory(ctx),
        )

    def gpu_split(
        self, ctx: ModelContext, opts: dict[str, Any], num_ctx: int, num_batch: int, num_parallel: int, num_gpu: int
    ) -> tuple[int, tuple[float, ...]]:
        """``main_gpu`` and ``tensor_split`` for this load over the visible GPUs (see ``gpu_placement``), from the
        VRAM the offloaded layers need. With llama.cpp RPC servers, the layers are spread over the servers and the
        local GPUs in proportion to their budgets (``daemon.rpc.split``)."""
        if num_gpu and self.rpc is not None and self.rpc.active:
            return 0, rpc_split(self.rpc.budgets, self.gpu_budgets)
        if num_gpu == 0 or len(self.gpu_budgets) <= 1:
            return self.gpu_placement(self.gpu_budgets, 0, opts.get("main_gpu"))  # nothing to split
        est = self._estimate(ctx, num_ctx, num_batch, num_parallel, num_gpu, self.settings.kv_cache_type)
        return self.gpu_placement(self.gpu_budgets, int(est.vram), opts.get("main_gpu"))

    @staticmethod
    def gpu_placement(
        gpu_budgets: tuple[int, ...], vram_needed: int, main_gpu: Any = None
    ) -> tuple[int, tuple[float, ...]]:
        """Where a model's offloaded layers go. ``main_gpu`` (the option; GPU 0 when unset) is the GPU that holds
        the model alone when its layers fit that GPU's budget (no traffic between GPUs, as Ollama places models);
        a model too big for it is split over every GPU with a budget, in proportion to each one's free memory
        less its reserve (``tensor_split``), with ``main_gpu`` still the GPU for the small tensors. One GPU or
        none: llama.cpp's defaults (no split). A ``main_gpu`` beyond the visible GPUs falls back to GPU 0 with a
        warning, so a Modelfile written on a bigger machine still runs."""
        main = 0 if main_gpu is None else int(main_gpu)
        if main < 0:
            raise InvalidRequest(f'option "main_gpu" must not be negative, got {main}')
        count = len(gpu_budgets)
        if count and main >= count:
            log.warning("main_gpu=%d but %d GPU(s) are visible; using GPU 0", main, count)
            main = 0
        if count <= 1 or vram_needed <= 0:
            return (main if count else 0), ()
        usable = [max(0, int(b)) for b in gpu_budgets]
        total = sum(usable)
        if vram_needed <= usable[main] or total <= 0:
            return main, tuple(1.0 if i == main else 0.0 for i in range(count))
        return main, tuple(round(b / total, 6) for b in usable)

    @staticmethod
    def sample_params(
        opts: dict[str, Any], fmt: Any = None, *, logit_bias: tuple[tuple[int, float], ...] = ()
    ) -> SampleParams:
        """The runner's sampling parameters from merged options, ``format`` and the call's parsed logit_bias."""
        grammar, schema = grammar_for(fmt)
        stop = opts.get("stop") or []
        if isinstance(stop, str):
            stop = [stop]
        num_predict = int(opts["num_predict"])
        return SampleParams(
            num_predict=num_predict,
            temperature=float(opts["temperature"]),
            top_k=int(opts["top_k"]),
            top_p=float(opts["top_p"]),
            min_p=float(opts["min_p"]),
            typical_p=float(opts["typical_p"]),
            repeat_penalty=float(opts["repeat_penalty"]),
            repeat_last_n=int(opts["repeat_last_n"]),
            presence_penalty=float(opts["presence_penalty"]),
            frequency_penalty=float(opts["frequency_penalty"]),
            seed=int(opts["seed"]),
            stop=tuple(s for s in stop if s),
            num_keep=int(opts["num_keep"]),
            grammar=grammar,
            json_schema=schema,
            logit_bias=logit_bias,
            # speculative decoding (issue 28): llama-server's --draft-max/--draft-min/--draft-p-min, prompt lookup
            draft_max=int(opts.get("draft_max", SPECULATIVE_DEFAULTS["draft_max"])),
            draft_min=int(opts.get("draft_min", SPECULATIVE_DEFAULTS["draft_min"])),
            draft_p_min=float(opts.get("draft_p_min", SPECULATIVE_DEFAULTS["draft_p_min"])),
            draft_ngram=int(opts.get("draft_ngram", SPECULATIVE_DEFAULTS["draft_ngram"])),
        )

    # -- LoRA adapters (issue 29) ------------------------------------------------------------------------------
    def adapters_for(self, ctx: ModelContext, opts: dict[str, Any]) -> tuple[tuple[str, float], ...]:
        """``GenerateRequest.adapters`` for a generation of ``ctx`` under the merged options: (adapter blob path,
        scale) in the model's ADAPTER order, with the model's ``lora_scale`` defaults and the request's ``lora``
        override (llama-server's ``[{"id", "scale"}]``), adapters at scale 0 left out (``daemon.generation.lora``).
        An id the model does not have is a 400 naming it."""
        return lora.request_adapters(ctx.adapters, opts, model=ctx.raw)

    def adapter_uses(
        self, ctx: ModelContext, spec: LoadSpec, adapters: tuple[tuple[str, float], ...]
    ) -> tuple[Adapter, ...]:
        """The adapters a request applies, for the scheduler: each one's digest and what it adds to the runner's
        memory: its file size (its tensors, F32/F16 as stored), on the devices of the layers it patches, so in
        VRAM in the share of the model's layers offloaded (``spec.num_gpu`` of ``n_layer + 1``)."""
        sizes = dict(zip(ctx.adapters, ctx.adapter_bytes, strict=False))
        layers = max(1, ctx.info.block_count + 1) if spec.num_gpu else 1
        on_gpu = 0.0 if spec.num_gpu == 0 or self.vram_budget <= 0 else min(1.0, spec.num_gpu / layers)
        out = []
        for path, _scale in adapters:
            size = sizes.get(path, 0)
            vram = int(size * on_gpu)
            out.append(Adapter(path=path, digest=_blob_digest(path), memory=MemoryUse(ram=size - vram, vram=vram)))
        return tuple(out)

    def adapter_blobs(self, raw: str) -> list[Digest]:
        """The adapter blobs of the model ``raw`` names now ([] when there is none: a create that makes it anew)."""
        try:
            manifest = self.catalog.get(raw).manifest
        except CorralError:
            return []
        return [layer.digest for layer in manifest.layers_of(MEDIA_ADAPTER)]

    async def drop_adapters(self, digests: Iterable[Digest]) -> list[str]:
        """Free on the loaded runners the adapters among ``digests`` (blobs of models just deleted or replaced) that
        no model in the store uses any more; an adapter another model still uses stays loaded. Returns the adapter
        paths the runners were asked to free."""
        from starlette.concurrency import run_in_threadpool

        candidates = set(digests)
        if not candidates:
            return []
        store = self.catalog.store
        try:
            gone = candidates - await run_in_threadpool(store.referenced_blobs)
            if not gone:
                return []
            return await self.scheduler.drop_adapters(str(store.blob_path(d)) for d in gone)
        except Exception as exc:  # noqa: BLE001 - the delete or create is done: a runner keeps them, no error
            log.warning("adapters of a deleted or replaced model not freed: %s", exc)
            return []

    async def acquire(
        self,
        ctx: ModelContext,
        spec: LoadSpec,
        keep_alive: float | None,
        *,
        adapters: tuple[tuple[str, float], ...] = (),
    ) -> Lease:
        """A lease on the runner for ``spec``. ``adapters``: the request's ``GenerateRequest.adapters`` (counted
        once in that runner's memory, from the first request that applies each)."""
        ref = ctx.embedding_ref if spec.embedding else ctx.ref
        if spec.draft_path:  # /api/ps names the draft model with the model
            ref = dataclasses.replace(ref, draft=self.draft_name(spec.draft_path))
        if adapters and not spec.embedding:
            ref = dataclasses.replace(ref, adapters=self.adapter_uses(ctx, spec, adapters))
        return await self.scheduler.acquire(ref, spec, keep_alive)


def _projector_of(ctx: ModelContext) -> str:
    """The model's projector blob path, "" for none (contexts built without the field, as tests' fakes, have none)."""
    path = getattr(ctx, "projector_path", None)
    return "" if path is None else str(path)


def _adapter_size(path: Path, size: int) -> int:
    """An adapter blob's size: the file's, else the manifest's."""
    try:
        return path.stat().st_size
    except OSError:
        return max(0, int(size))


def _blob_digest(path: str) -> str:
    """A blob's digest (``sha256:<hex>``) from its file name in the store; a file outside the store by its name."""
    name = Path(path).name
    digest = Digest.from_filename(name)
    return str(digest) if digest is not None else name


def _plain_json(value: Any) -> bool:
    """A metadata value that goes into JSON as it is: a scalar, or a list of scalars."""
    if isinstance(value, list):
        return all(_plain_json(v) and not isinstance(v, list) for v in value)
    if isinstance(value, float):
        return math.isfinite(value)
    return isinstance(value, (str, int, bool))


def _projector_memory(ctx: ModelContext) -> int:
    from daemon.scheduling.memory import projector_file_memory

    return projector_file_memory(_projector_of(ctx))


def grammar_for(fmt: Any) -> tuple[str | None, str | None]:
    """``format`` -> (GBNF grammar, JSON schema text); the runner turns a schema into a grammar."""
    if fmt is None or fmt == "" or fmt == "null":
        return None, None
    if fmt == "json":
        return JSON_GBNF, None
    if isinstance(fmt, dict):
        if not fmt:
            return JSON_GBNF, None
        return None, json.dumps(fmt)
    if isinstance(fmt, str):
        try:
            parsed = json.loads(fmt)
        except ValueError:
            raise InvalidRequest(f'invalid format: "{fmt}"; use "json" or a JSON schema object') from None
        return grammar_for(parsed)
    raise InvalidRequest('invalid format: use "json" or a JSON schema object')


def normalise(vec: list[float]) -> list[float]:
    if any(math.isnan(x) or math.isinf(x) for x in vec):
        raise CorralError("embedding contains NaN or Inf values")
    norm = math.sqrt(sum(x * x for x in vec))
    return [x / norm for x in vec] if norm > 0 else list(vec)
