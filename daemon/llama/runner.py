"""The runner child process: owns one llama.cpp model. The only module in corral that imports llama_cpp (the
batching engine it drives, ``engine.py``, is handed the module).

Run as ``python -m daemon.llama.runner``. It reads ops and sends replies as the runner protocol has them
(``daemon/runners/protocol.py``, docs/runner-protocol.md) on its stdin and its original stdout; everything else
(llama.cpp's logs included) goes to stderr. A reader thread takes frames from stdin so a ``cancel`` reaches a
generation between two tokens. EOF on stdin or a new parent pid (the daemon died, even by SIGKILL) ends the process
at once. Ops arrive typed: each is handled by the method the dispatch table names for its class.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import queue
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any, NoReturn

from daemon.runners.protocol import (
    AdaptersOp,
    AdaptersReply,
    BatchReply,
    CancelOp,
    DetokenizeOp,
    Embedding,
    EmbedOp,
    EmbedReply,
    ErrorReply,
    GenerateOp,
    GenerateRequest,
    KVDiskInfo,
    LoadedReply,
    LoadErrorReply,
    LoadOp,
    LoadSpec,
    Op,
    Piece,
    PiecesOp,
    PiecesReply,
    ProtocolError,
    Reply,
    RerankOp,
    RerankReply,
    RunnerInfo,
    ShutdownOp,
    SlotErasedReply,
    SlotEraseOp,
    SlotRestoredReply,
    SlotRestoreOp,
    SlotSavedReply,
    SlotSaveOp,
    SlotsOp,
    SlotsReply,
    StageReply,
    TextReply,
    TokenizeOp,
    TokensReply,
    decode_op,
    encode,
    parse_payload,
    read_payload,
    request_id,
)

KV_TYPES = {"f16": 1, "q8_0": 8, "q4_0": 2}  # ggml_type values (GGML_TYPE_F16, _Q8_0, _Q4_0)
FLASH_ATTN = {"auto": -1, "off": 0, "on": 1}  # llama_flash_attn_type
FAULT_ENV = "CORRAL_TEST_FAULT"
SHUTDOWN_FLUSH = 3.0  # seconds a shutting-down runner waits for its disk cache's writes


def _inject_fault(stage: str, spec: LoadSpec) -> None:
    """Test-only fault injection (docs/runner-faults.md): ``CORRAL_TEST_FAULT=<stage>`` makes this runner die by
    SIGSEGV at that stage (``warmup``, ``first-decode``) while llama.cpp's extra buffer types are on, as
    llama.cpp's AMX kernels do on some Intel CPUs; ``<stage>-always`` whatever the configuration. Unset in
    production: nothing happens."""
    wanted = os.environ.get(FAULT_ENV, "")
    if not wanted:
        return
    always = wanted.endswith("-always")
    if wanted.removesuffix("-always") != stage or not (always or spec.extra_bufts):
        return
    sys.stderr.write(f"corral test fault: SIGSEGV at {stage} ({FAULT_ENV}={wanted})\n")
    sys.stderr.flush()
    import signal

    os.kill(os.getpid(), signal.SIGSEGV)


class _model_params_patch:
    """While a high-level ``Llama`` is built, its default model params carry ``use_extra_bufts`` (Llama() has no
    argument for it)."""

    def __init__(self, lc: Any, extra_bufts: bool) -> None:
        self.lc, self.extra_bufts = lc, extra_bufts
        self.original: Any = None

    def __enter__(self) -> None:
        import llama_cpp.llama_cpp as low

        self.original = low.llama_model_default_params
        extra = self.extra_bufts

        def patched() -> Any:
            params = self.original()
            params.use_extra_bufts = extra
            return params

        low.llama_model_default_params = patched

    def __exit__(self, *exc: object) -> None:
        import llama_cpp.llama_cpp as low

        low.llama_model_default_params = self.original


class RequestError(Exception):
    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


class Channel:
    def __init__(self, out_fd: int) -> None:
        self._out = os.fdopen(out_fd, "wb", buffering=0)
        self._lock = threading.Lock()

    def send(self, reply: Reply) -> None:
        self.send_many([reply])

    def send_many(self, replies: list[Reply]) -> None:
        """Several replies (an engine step's tokens and ends) as one ``batch`` frame: one JSON encoding and one
        write here, one read and one JSON decoding in the daemon, whatever the number of sequences."""
        data = encode(replies[0] if len(replies) == 1 else BatchReply(tuple(replies)))
        with self._lock:
            self._out.write(data)


class Runner:
    def __init__(self, chan: Channel) -> None:
        import llama_cpp

        self.lc = llama_cpp
        self.chan = chan
        self.llm: Any = None  # a high-level Llama, for embedding runners only
        self.model: Any = None
        self.context: Any = None
        self.engine: Any = None
        self.projector: Any = None  # a vision.Projector when the model came with one (spec projector_path)
        # speculative decoding's draft model (spec draft_path): its model, context and speculative.DraftModel
        self.draft_model: Any = None
        self.draft_context: Any = None
        self.draft: Any = None
        # libmtmd's context is not thread-safe: the request thread tokenizes images, the engine thread evaluates them
        self._vision_lock = threading.Lock()
        self.log_lines: list[str] = []
        self.spec = LoadSpec(model_path="")
        self.projector_gpu = False
        self._embedded = False
        self.kv_disk = KVDiskInfo()  # the disk cache's state while it has none (off, or why)
        self.slot_files: Any = None  # a kvdisk.SlotFiles: saved slots, under the prompt cache's directory
        self.n_stream = 0  # the stream count of this context's sequence states (0: not a KV cache kvblocks reads)
        self._log_cb = llama_cpp.llama_log_callback(self._on_log)
        llama_cpp.llama_log_set(self._log_cb, ctypes.c_void_p(0))

    def _on_log(self, level: int, text: bytes, _user: Any) -> None:
        line = text.decode("utf-8", errors="replace")
        if len(self.log_lines) < 5000:
            self.log_lines.append(line.rstrip("\n"))
        sys.stderr.write(line)

    # -- load ----------------------------------------------------------------------------------------------------
    def load(self, spec: LoadSpec) -> None:
        import psutil

        if spec.rpc_servers:  # llama.cpp's RPC backend: the servers' devices come first (daemon/llama/rpc.py)
            from daemon.llama import rpc

            spec = rpc.prepare(self.lc, spec)
        self.spec = spec
        threads = spec.num_thread or psutil.cpu_count(logical=False) or os.cpu_count() or 1
        n_parallel = max(1, spec.num_parallel)
        n_ctx = spec.num_ctx * n_parallel
        n_batch = spec.num_batch or 512
        if not os.path.isfile(spec.model_path):
            raise RequestError(f"model file {spec.model_path} does not exist", 500)
        adapters = list(spec.adapters)
        lc = self.lc
        kv_type = KV_TYPES.get(spec.kv_cache_type or "f16", lc.GGML_TYPE_F16)
        flash = FLASH_ATTN.get(spec.flash_attn or "auto", -1)
        if spec.embedding:
            kwargs: dict[str, Any] = dict(
                model_path=spec.model_path,
                n_ctx=n_ctx,
                n_batch=n_batch,
                n_gpu_layers=spec.num_gpu,
                n_threads=threads,
                n_threads_batch=threads,
                embedding=True,
                verbose=False,
                seed=0,
                main_gpu=spec.main_gpu,
                type_k=kv_type,
                type_v=kv_type,
            )
            if flash >= 0:
                kwargs["flash_attn"] = bool(flash)
            if spec.tensor_split:
                kwargs["tensor_split"] = list(spec.tensor_split)
            if spec.use_mmap is not None:
                kwargs["use_mmap"] = spec.use_mmap
            if adapters:
                kwargs["lora_path"] = adapters[0]
            if spec.rerank:  # a reranker: pooling rank, and a whole batch in one ubatch (no KV cache)
                kwargs["pooling_type"] = lc.LLAMA_POOLING_TYPE_RANK
                kwargs["n_ubatch"] = n_batch
            with _model_params_patch(lc, spec.extra_bufts):
                self.llm = lc.Llama(**kwargs)
            self.model = self.llm._model
            self.chan.send(StageReply("warm-up"))
            _inject_fault("warmup", spec)
            if self._is_reranker():  # the same kernels as a request, see _warm_up
                self._rank([self._rerank_tokens("warm up", "warm up")])
            else:
                self.llm.embed("warm up", normalize=False, truncate=True)
            return
        from llama_cpp import _internals

        from daemon.llama.engine import (
            FIRST_TOKEN_PAUSE,
            SPEC_MAX_STREAMS,
            SPEC_MAX_STREAMS_GPU,
            SPEC_TOKEN_COST,
            SPEC_TOKEN_COST_GPU,
            STREAM_INTERVAL,
            Engine,
        )

        mparams = lc.llama_model_default_params()
        self._model_params(mparams, spec)
        if spec.use_mmap is not None:
            mparams.use_mmap = spec.use_mmap and not adapters
        self.model = _internals.LlamaModel(path_model=spec.model_path, params=mparams, verbose=False)
        cparams = lc.llama_context_default_params()
        cparams.n_ctx = n_ctx
        cparams.n_batch = n_batch
        cparams.n_ubatch = min(n_batch, 512)
        cparams.n_seq_max = n_parallel
        cparams.kv_unified = False  # a stream per slot: a sequence computes the same alone as in a batch
        cparams.n_threads = threads
        cparams.n_threads_batch = threads
        cparams.no_perf = True
        cparams.type_k = kv_type
        cparams.type_v = kv_type
        if flash >= 0 or kv_type != lc.GGML_TYPE_F16:
            # a quantized V cache needs flash attention (llama.cpp refuses it otherwise); the daemon has already
            # refused CORRAL_FLASH_ATTENTION=false with a quantized CORRAL_KV_CACHE_TYPE
            cparams.flash_attn_type = 1 if flash != 0 else 0
        self.context = _internals.LlamaContext(model=self.model, params=cparams, verbose=False)
        if spec.draft_path:
            self._load_draft(spec, cparams)
        offloaded = self._fully_offloaded()
        self.engine = Engine(
            lc,
            self.context.ctx,
            self.model.vocab,
            n_parallel=n_parallel,
            n_ctx_slot=spec.num_ctx,
            n_batch=n_batch,
            emit=self.chan.send_many,
            cache_bytes=spec.prompt_cache,
            before_first_decode=lambda: _inject_fault("first-decode", spec),
            first_token_pause=0.0 if offloaded else FIRST_TOKEN_PAUSE,
            # llama.cpp computing with a thread on every core: each frame that wakes the daemon stalls a decode
            stream_interval=STREAM_INTERVAL if not offloaded and threads >= (spec.cpus or _usable_cores()) else 0.0,
            draft=self.draft,
            spec_max_streams=SPEC_MAX_STREAMS_GPU if offloaded else SPEC_MAX_STREAMS,
            spec_token_cost=SPEC_TOKEN_COST_GPU if offloaded else SPEC_TOKEN_COST,
        )
        if adapters:  # the load's own adapters: what requests naming none are computed under
            self.engine.call(lambda: self._load_adapters(adapters, status=500))
            self.engine.default_adapters = tuple((path, 1.0) for path in adapters)
        # on the engine's thread, as every decode after them (Engine.call)
        self.engine.call(lambda: self._warm_up(self.context.ctx, self.model))
        if self.draft is not None:
            self.engine.call(lambda: self._warm_up(self.draft_context.ctx, self.draft_model, "draft-warmup"))
        if spec.projector_path:
            self.engine.call(lambda: self._load_projector(spec.projector_path, threads, flash))
            self.engine.set_media(self._eval_media)
        if spec.kv_disk_dir and spec.kv_disk_bytes > 0:
            self._open_disk_cache(spec)

    def _load_adapters(self, paths: list[str], status: int = 400) -> None:
        """Load these LoRA adapter files into the model, once each (engine thread: ``Engine.call``)."""
        engine = self.engine
        for path in paths:
            if path in engine.adapter_ptrs and path not in engine._drop_later:
                continue
            if path in engine.adapter_ptrs:  # being dropped, asked for again: keep it
                engine.add_adapter(path, engine.adapter_ptrs[path])
                continue
            if not os.path.isfile(path):
                raise RequestError(f"the LoRA adapter file {path} does not exist", 500)
            ptr = self.lc.llama_adapter_lora_init(self.model.model, path.encode("utf-8"))
            if not ptr:
                raise RequestError(
                    "llama.cpp could not load the LoRA adapter: it does not fit this model (another architecture "
                    "or other tensor shapes); create the model with an adapter made for its base",
                    status,
                )
            engine.add_adapter(path, ptr)

    def _adapters(self, op: AdaptersOp) -> Reply:
        if self.engine is None:
            return AdaptersReply(op.id, ())
        loaded = self.engine.call(lambda: self.engine.drop_adapters(tuple(op.drop)))
        return AdaptersReply(op.id, tuple(loaded))

    def _load_draft(self, spec: LoadSpec, cparams: Any) -> None:
        """Load the draft model for speculative decoding (daemon/llama/speculative.py) with a context shaped as the
        target's (a KV stream per slot, the same context per slot): refused with a 400 when its vocabulary is not
        the target's, as the daemon checks before it asks."""
        from llama_cpp import _internals

        from daemon.llama.speculative import DraftModel, vocab_mismatch

        if not os.path.isfile(spec.draft_path):
            raise RequestError(f"draft model file {spec.draft_path} does not exist", 500)
        lc = self.lc
        mparams = lc.llama_model_default_params()
        self._model_params(mparams, spec)
        mparams.n_gpu_layers = spec.draft_num_gpu
        if spec.use_mmap is not None:
            mparams.use_mmap = spec.use_mmap
        self.draft_model = _internals.LlamaModel(path_model=spec.draft_path, params=mparams, verbose=False)
        why = vocab_mismatch(lc, self.model.vocab, self.draft_model.vocab)
        if why is not None:
            raise RequestError(
                f"the draft model does not share this model's vocabulary ({why}): use a draft made from the same "
                "tokenizer (a smaller or more quantized model of the same family)",
                400,
            )
        self.draft_context = _internals.LlamaContext(model=self.draft_model, params=cparams, verbose=False)
        self.draft = DraftModel(
            lc,
            self.draft_context.ctx,
            self.draft_model.vocab,
            n_parallel=max(1, spec.num_parallel),
            n_batch=int(cparams.n_batch),
        )
        self.draft.before_decode = lambda: _inject_fault("draft-decode", spec)

    # -- the prompt cache on disk (issue 27, daemon/llama/kvdisk.py) ------------------------------------------------
    def _open_disk_cache(self, spec: LoadSpec) -> None:
        """Keep prompts' KV state on disk under ``spec.kv_disk_dir``, keyed by the daemon's part of the key
        (model, adapters, projector, KV type, flash attention, rope parameters), this llama.cpp build and how the
        model was offloaded. A model whose state cannot be cut into blocks keeps none (one log line); its slots can
        still be saved and restored whole (``slot_files``)."""
        import json

        from daemon.llama.kvdisk import DiskCache, SlotFiles, build_id, cache_key, log
        from daemon.runners.kvstore import KVStore

        lc, model = self.lc, self.model.model
        reason = ""
        if lc.llama_model_is_recurrent(model) or lc.llama_model_is_hybrid(model):
            reason = "a recurrent or hybrid model's state cannot be cut into blocks"
        elif int(lc.llama_model_n_swa(model)) > 0:
            reason = "a sliding-window model's state cannot be cut into blocks"
        elif not spec.kv_key:
            reason = "the daemon sent no cache key"
        n_stream = 0
        if not reason:
            try:
                n_stream = self.engine.call(self._n_stream)
            except Exception as exc:  # noqa: BLE001 - no disk cache, the model serves as before
                reason = f"llama.cpp's state of this model cannot be cut into blocks ({exc})"
        self.n_stream = n_stream
        store = None
        if spec.kv_key:
            try:
                described = json.loads(spec.kv_key)
            except ValueError:
                described = {}
            if not isinstance(described, dict):
                described = {}
            build = build_id(lc)
            n_layer = int(lc.llama_model_n_layer(model))
            offload = "all" if spec.num_gpu < 0 or spec.num_gpu > n_layer else str(spec.num_gpu)
            offload = offload if lc.llama_supports_gpu_offload() else "0"
            runner_part = f"offload={offload} extra_bufts={spec.extra_bufts}"
            key = cache_key(spec.kv_key, build, runner_part)
            meta = {
                "model": str(described.get("model", "")),
                "adapters": json.dumps(described.get("adapters", [])),
                "projector": str(described.get("projector", "")),
                "build": "; ".join(build.splitlines()[:2]),
            }
            try:
                store = KVStore(spec.kv_disk_dir, key, spec.kv_disk_bytes, meta)
            except (ValueError, OSError) as exc:
                reason = reason or str(exc)
            else:
                self.slot_files = SlotFiles(store)
        if reason or store is None:
            log(f"off for this model: {reason}")
            self.kv_disk = KVDiskInfo(dir=spec.kv_disk_dir, limit_bytes=spec.kv_disk_bytes, reason=reason)
            return
        disk = DiskCache(store, key=store.key, n_stream=n_stream, root=spec.kv_disk_dir, limit_bytes=spec.kv_disk_bytes)
        self.engine.attach_disk(disk)

    def _n_stream(self) -> int:
        """The stream count at the head of this context's sequence states (kvblocks.join writes it): read from an
        empty sequence's state (engine thread), which also tells whether the state can be cut into blocks at all
        (kvblocks.Unsplittable: a sliding-window, recurrent or hybrid memory's does not parse as a KV cache's)."""
        from daemon.llama.kvblocks import n_stream_of, split

        lc, ctx = self.lc, self.context.ctx
        size = int(lc.llama_state_seq_get_size(ctx, 0))
        buf = (ctypes.c_uint8 * max(size, 1))()
        if size <= 0 or int(lc.llama_state_seq_get_data(ctx, buf, size, 0)) != size:
            raise RuntimeError("llama.cpp gave no state for an empty sequence")
        state = bytes(buf)
        split(state, 0)
        return n_stream_of(state)

    def kv_disk_info(self) -> KVDiskInfo:
        engine = self.engine
        if engine is not None and engine.disk is not None:
            info: KVDiskInfo = engine.disk.info()
            return info
        return self.kv_disk

    def flush_disk(self, timeout: float) -> None:
        """Before the runner exits (a shutdown): what its slots hold goes to disk, within ``timeout`` seconds."""
        engine = self.engine
        if engine is not None and engine.disk is not None:
            engine.flush_disk(timeout)

    def _fully_offloaded(self) -> bool:
        """Every layer on a GPU: llama.cpp's CPU threads then wait on the device instead of computing. llama.cpp
        counts the output layer in ``n_gpu_layers``: all of them is ``n_layer + 1``."""
        lc = self.lc
        n_layer = int(lc.llama_model_n_layer(self.model.model))
        num_gpu = self.spec.num_gpu
        return bool(lc.llama_supports_gpu_offload()) and (num_gpu < 0 or num_gpu > n_layer)

    def _load_projector(self, path: str, threads: int, flash: int) -> None:
        """Load the vision projector for the loaded model. On the GPU only when the whole model is offloaded (as
        Ollama: libmtmd puts the projector whole on one device, and a partly offloaded model has no VRAM to spare);
        flash attention as the context has it. A projector that cannot load fails the load with libmtmd's reason."""
        from daemon.llama.vision import Projector

        if not os.path.isfile(path):
            raise RequestError(f"projector file {path} does not exist", 500)
        use_gpu = self._fully_offloaded()
        try:
            self.projector = Projector(
                path,
                self.model.model,
                use_gpu=use_gpu,
                n_threads=threads,
                flash_attn=None if flash < 0 else bool(flash),
                log_callback=self._log_cb,
            )
        except ValueError as exc:
            # one path-free line in llama.cpp's "error loading model:" form, which the daemon may show the client
            # (process.safe_load_reason); the full reason, path included, goes to the daemon log
            import re

            found = None
            for line in reversed(self.log_lines[-40:]):
                found = re.search(r"mismatch between text model \(n_embd = \d+\) and mmproj \(n_embd = \d+\)", line)
                if found:
                    break
            reason = "vision projector: " + (found.group(0) if found else "not a projector this llama.cpp supports")
            self._on_log(4, f"error loading model: {reason}\n".encode(), None)
            raise RequestError(f"{exc} ({reason})", 500) from None
        self.projector_gpu = use_gpu

    def _eval_media(
        self, media: Any, index: int, offset: int, n_past: int, seq_id: int, final: bool, limit: int
    ) -> int:
        """The engine's hook for an image segment (engine thread): evaluate it into ``seq_id`` at ``n_past`` from
        its position ``offset``, at most ``limit`` positions; the positions evaluated. An image whose embeddings may
        be decoded apart (causal, one position each: ``Projector.can_split``) is encoded once and decoded a slice
        per call, so the engine runs the other sequences' steps between slices; others go whole through libmtmd's
        helper. ``final``: the prompt ends with it (logits for its last position)."""
        projector, ctx = self.projector, self.context.ctx
        with self._vision_lock:
            if offset == 0 and not projector.can_split(media, index):
                n_batch = int(self.lc.llama_n_batch(ctx))
                end = projector.eval_segment(
                    media, index, ctx, n_past=n_past, seq_id=seq_id, n_batch=n_batch, logits_last=final
                )
                return int(end) - n_past
            held = getattr(media, "encoded", None)  # (segment index, its embeddings) while it is being decoded
            if held is None or held[0] != index:
                held = media.encoded = (index, projector.encode(media, index))
            embd = held[1]
            k = max(1, min(limit, len(embd) - offset))
            done = offset + k == len(embd)
            projector.decode_embeddings(
                ctx, embd[offset : offset + k], n_past=n_past, seq_id=seq_id, logits_last=final and done
            )
            if done:
                media.encoded = None
            return k

    def close(self) -> None:
        """Free in dependency order: the engine, the projector (it points at the model), the context, the model."""
        if self.engine is not None:
            self.flush_disk(SHUTDOWN_FLUSH)
            self.engine.close()
            self.engine = None
        if self.projector is not None:
            with self._vision_lock:
                self.projector.close()
            self.projector = None
        if self.draft is not None:
            self.draft.close()
            self.draft = None
        for obj in (self.draft_context, self.draft_model, self.context, self.model):
            if obj is not None and hasattr(obj, "close"):
                obj.close()
        self.context = self.model = self.draft_context = self.draft_model = None

    def _model_params(self, mparams: Any, spec: LoadSpec) -> None:
        lc = self.lc
        mparams.n_gpu_layers = spec.num_gpu
        mparams.main_gpu = spec.main_gpu
        mparams.use_extra_bufts = spec.extra_bufts
        split = list(spec.tensor_split)[: lc.LLAMA_MAX_DEVICES]
        if split:
            self._tensor_split = (ctypes.c_float * lc.LLAMA_MAX_DEVICES)(*split)  # kept alive with the runner
            mparams.tensor_split = ctypes.cast(self._tensor_split, ctypes.POINTER(ctypes.c_float))

    def _warm_up(self, ctx: Any, model: Any, fault: str = "warmup") -> None:
        """One short prompt-sized decode and one single-token decode before the runner says it is loaded: a
        kernel that faults on this CPU or GPU (llama.cpp's AMX path, a bad driver) kills the runner here, while
        the daemon can still load it again with a safer configuration, and not in a user's request. The draft
        model warms up the same way (its test fault stage: ``draft-warmup``)."""
        lc = self.lc
        self.chan.send(StageReply("warm-up"))
        _inject_fault(fault, self.spec)
        n_ctx = int(lc.llama_n_ctx(ctx))
        n = max(1, min(16, int(lc.llama_n_batch(ctx)), n_ctx - 1))
        bos = model.token_bos()
        first = bos if bos >= 0 else 0
        n_vocab = int(lc.llama_vocab_n_tokens(model.vocab))
        tokens = [first] + [(first + 1 + i) % max(1, n_vocab) for i in range(n - 1)]
        batch = lc.llama_batch_init(max(n, 1), 0, 1)
        try:
            for start, count in ((0, n), (n, 1)):
                if start + count > n_ctx:
                    break
                batch.n_tokens = count
                for j in range(count):
                    batch.token[j] = tokens[(start + j) % n]
                    batch.pos[j] = start + j
                    batch.n_seq_id[j] = 1
                    batch.seq_id[j][0] = 0
                    batch.logits[j] = j == count - 1
                rc = lc.llama_decode(ctx, batch)
                if rc != 0:
                    raise RequestError(f"the warm-up decode failed (llama_decode returned {rc})", 500)
        finally:
            lc.llama_batch_free(batch)
            mem = lc.llama_get_memory(ctx)
            if mem:
                lc.llama_memory_clear(mem, True)

    def info(self) -> RunnerInfo:
        m, spec = self.model, self.spec
        n_ctx = self.llm.n_ctx() if self.llm is not None else self.context.n_ctx()
        return RunnerInfo(
            n_ctx=int(n_ctx),
            n_ctx_train=int(m.n_ctx_train()),
            n_vocab=int(m.n_vocab()),
            n_embd=int(m.n_embd()),
            n_gpu_layers=spec.num_gpu,
            extra_bufts=spec.extra_bufts,
            flash_attn=spec.flash_attn or "auto",
            kv_cache_type=spec.kv_cache_type or "f16",
            num_parallel=max(1, spec.num_parallel),
            projector=self.projector is not None,
            projector_gpu=self.projector_gpu,
            gpu_offload_supported=bool(self.lc.llama_supports_gpu_offload()),
            pid=os.getpid(),
            log_lines=tuple(self.log_lines),
        )

    def cancel(self, rid: int) -> None:
        if self.engine is not None:
            self.engine.cancel(rid)

    def tokenize(self, text: str, add_special: bool) -> list[int]:
        return list(self.model.tokenize(text.encode("utf-8"), add_bos=add_special, special=True))

    # -- generate ------------------------------------------------------------------------------------------------
    def generate(self, rid: int, req: GenerateRequest) -> None:
        """Hand the request to the batching engine; its tokens and ``done`` are sent from the engine thread."""
        from daemon.llama.engine import EngineError

        if self.llm is not None:
            raise RequestError("this runner was loaded for embeddings only", 500)
        context = list(req.context)
        if context:
            from daemon.llama.engine import check_token_ids

            n_vocab = int(self.model.n_vocab())
            bad = check_token_ids(context, n_vocab)
            if bad is not None:
                raise RequestError(
                    f"invalid context: token id {context[bad]!r} (context[{bad}]) is out of range: "
                    f"this model's vocabulary has ids 0 to {n_vocab - 1}"
                )
        media = None
        if req.images:
            media = self._media_prompt(req)
            tokens = context + media.cache_key()  # image positions as negative keys (vision.MediaPrompt.cache_key)
        else:
            tokens = context + self.tokenize(req.prompt, req.add_special)
        if not tokens:
            tokens = [self.model.token_bos()]
        adapters = tuple((path, float(scale)) for path, scale in req.adapters)
        engine = self.engine
        try:
            if any(path not in engine.adapter_ptrs or path in engine._drop_later for path, _ in adapters):
                engine.call(lambda: self._load_adapters([path for path, _ in adapters]))
            engine.submit(
                rid,
                tokens,
                req.params,
                shift=req.shift,
                truncate=req.truncate,
                media=media,
                adapters=adapters,
            )
        except (EngineError, RequestError) as exc:
            if media is not None:
                media.close()
            raise RequestError(str(exc), exc.status) from None

    def _media_prompt(self, req: GenerateRequest) -> Any:
        """The request's prompt and images (base64, one per media marker) tokenized by the projector; any problem
        with them is the request's 400, and the runner goes on serving."""
        import base64
        import binascii

        if self.projector is None:
            raise RequestError(
                "this model cannot take images: it was loaded without a vision projector (create it with its "
                "projector GGUF, or remove the images)"
            )
        try:
            data = [base64.b64decode(img, validate=True) for img in req.images]
        except (binascii.Error, ValueError):
            raise RequestError("an image is not valid base64") from None
        with self._vision_lock:
            try:
                return self.projector.tokenize(req.prompt, data, add_special=req.add_special)
            except ValueError as exc:
                raise RequestError(str(exc)) from None

    # -- embeddings ------------------------------------------------------------------------------------------------
    def embed(self, inputs: tuple[str, ...], truncate: bool) -> Embedding:
        llm = self.llm
        if self._is_reranker():  # its pooled output is one score, not a vector
            raise RequestError("this model is a reranker and does not support embeddings; use /api/rerank")
        if not self._embedded:
            self._embedded = True
            _inject_fault("first-decode", self.spec)
        n_ctx = llm.n_ctx()
        counts = []
        for text in inputs:
            n = len(self.tokenize(text, True))
            if n > n_ctx and not truncate:
                raise RequestError("the input length exceeds the context length")
            counts.append(min(n, n_ctx))
        vectors = []
        for text in inputs:
            out = llm.embed(text, normalize=False, truncate=True)
            if out and isinstance(out[0], list):  # per-token embeddings (no pooling): mean-pool them
                dim = len(out[0])
                out = [sum(row[i] for row in out) / len(out) for i in range(dim)]
            vectors.append([float(x) for x in out])
        return Embedding(vectors, sum(counts))

    # -- rerank (issue 18) -----------------------------------------------------------------------------------------
    def _is_reranker(self) -> bool:
        return self.llm is not None and int(self.llm.pooling_type()) == int(self.lc.LLAMA_POOLING_TYPE_RANK)

    def _rerank_tokens(self, query: str, document: str, limit: int | None = None) -> list[int]:
        """A query/document pair as llama-server's ``format_prompt_rerank`` builds it: the model's ``rerank``
        template with {query} and {document} filled in, else BOS query EOS SEP document EOS (each special token
        only where the vocabulary adds it; SEP stands for a missing EOS). ``limit``: the document (or, with a
        template, the end of the whole text) is cut so the pair has at most that many tokens."""
        lc, model = self.lc, self.model
        template = lc.llama_model_chat_template(model.model, b"rerank")
        if template:
            text = template.decode("utf-8", errors="replace").replace("{query}", query).replace("{document}", document)
            tokens = list(model.tokenize(text.encode("utf-8"), add_bos=False, special=True))
            return tokens if limit is None else tokens[:limit]
        vocab = model.vocab
        q = list(model.tokenize(query.encode("utf-8"), add_bos=False, special=False))
        d = list(model.tokenize(document.encode("utf-8"), add_bos=False, special=False))
        eos = int(lc.llama_vocab_eos(vocab))
        if eos < 0:
            eos = int(lc.llama_vocab_sep(vocab))
        add_eos = bool(lc.llama_vocab_get_add_eos(vocab))
        head = [int(lc.llama_vocab_bos(vocab))] if lc.llama_vocab_get_add_bos(vocab) else []
        head += (
            q
            + ([eos] if add_eos else [])
            + ([int(lc.llama_vocab_sep(vocab))] if lc.llama_vocab_get_add_sep(vocab) else [])
        )
        tail = [eos] if add_eos else []
        if limit is not None and len(head) + len(d) + len(tail) > limit:
            keep = limit - len(head) - len(tail)
            if keep < 0:
                return (head + d + tail)[:limit]
            d = d[:keep]
        return head + d + tail

    def _rank(self, pairs: list[list[int]]) -> list[float]:
        """The rank score of each token sequence: as many sequences per ``llama_decode`` as fit n_batch tokens and
        the context's sequence slots, each its own sequence id; the score is element 0 of its pooled output."""
        lc, llm = self.lc, self.llm
        n_batch = int(llm.n_batch)
        n_seq_max = max(1, int(llm.context_params.n_seq_max))
        scores: list[float] = []
        group: list[list[int]] = []

        def flush() -> None:
            if not group:
                return
            llm._ctx.kv_cache_clear()
            llm._batch.reset()
            for i, tokens in enumerate(group):
                llm._batch.add_sequence(tokens, i, True)
            llm._ctx.decode(llm._batch)
            for i in range(len(group)):
                ptr = lc.llama_get_embeddings_seq(llm._ctx.ctx, i)
                if not ptr:
                    raise RequestError("llama.cpp returned no rank score", 500)
                scores.append(float(ptr[0]))
            llm._batch.reset()
            llm._ctx.kv_cache_clear()
            group.clear()

        used = 0
        for tokens in pairs:
            if used + len(tokens) > n_batch or len(group) >= n_seq_max:
                flush()
                used = 0
            group.append(tokens)
            used += len(tokens)
        flush()
        return scores

    def rerank(self, query: str, documents: tuple[str, ...], truncate: bool) -> tuple[list[float], int]:
        if not self._is_reranker():
            raise RequestError("this model does not support reranking")
        if not self._embedded:
            self._embedded = True
            _inject_fault("first-decode", self.spec)
        limit = min(int(self.llm.n_batch), int(self.llm.n_ctx()))
        pairs: list[list[int]] = []
        for doc in documents:
            tokens = self._rerank_tokens(query, doc)
            if len(tokens) > limit:
                if not truncate:
                    raise RequestError(
                        f"the query and document {len(pairs)} are {len(tokens)} tokens, more than "
                        f"the {limit} this model was loaded for (num_ctx / num_batch)"
                    )
                tokens = self._rerank_tokens(query, doc, limit)
            if not tokens:
                raise RequestError("an empty query and document")
            pairs.append(tokens)
        return self._rank(pairs), sum(len(t) for t in pairs)

    def pieces(self, tokens: tuple[int, ...]) -> list[Piece]:
        """Each token's text (special tokens included): a string, or its bytes as a list of ints where they are not
        valid UTF-8 alone (a part of a character), as llama-server's ``with_pieces``."""
        lc, vocab = self.lc, self.model.vocab
        out: list[Piece] = []
        buf = ctypes.create_string_buffer(64)
        for token in tokens:
            n = int(lc.llama_token_to_piece(vocab, lc.llama_token(int(token)), buf, len(buf), 0, True))
            if n < 0:
                buf = ctypes.create_string_buffer(-n)
                n = int(lc.llama_token_to_piece(vocab, lc.llama_token(int(token)), buf, len(buf), 0, True))
            raw = buf.raw[: max(n, 0)]
            try:
                out.append(raw.decode("utf-8"))
            except UnicodeDecodeError:
                out.append(list(raw))
        return out

    # -- dispatch --------------------------------------------------------------------------------------------------
    def _generate(self, op: GenerateOp) -> None:
        self.generate(op.id, op.req)  # the engine thread sends the replies

    def _embed(self, op: EmbedOp) -> Reply:
        return EmbedReply(op.id, self.embed(op.inputs, op.truncate))

    def _slots(self, op: SlotsOp) -> Reply:
        slots = tuple(self.engine.slots_info()) if self.engine is not None else ()
        return SlotsReply(op.id, slots, self.kv_disk_info())

    # -- saved slots (llama-server's /slots/{id}?action=save|restore|erase) -------------------------------------------
    def _slot_files(self) -> Any:
        if self.engine is None:
            raise RequestError("this model has no sequence slots (an embedding model)")
        if self.slot_files is None:
            raise RequestError(
                "saving and restoring slots needs the prompt cache on disk, which is off for this model "
                f"({self.kv_disk.reason or 'CORRAL_KV_DISK=0'}): set CORRAL_KV_DISK to a size",
                501,
            )
        return self.slot_files

    def _slot_save(self, op: SlotSaveOp) -> Reply:
        """The slot's state is copied out on the engine thread; cutting it and writing the file happen here."""
        from daemon.llama.engine import EngineError
        from daemon.llama.kvdisk import SlotFileError, check_slot_name, pack_slot

        files = self._slot_files()
        reason = check_slot_name(op.filename)
        if reason is not None:
            raise RequestError(reason)
        started = time.perf_counter()
        try:
            tokens, shifted_at, state = self.engine.call(lambda: self.engine.slot_state(op.slot))
        except EngineError as exc:
            raise RequestError(str(exc), exc.status) from None
        if not tokens:
            raise RequestError(f"slot {op.slot} holds no tokens: there is nothing to save", 400)
        layout, payload = pack_slot(state, len(tokens))
        try:
            written = files.write(op.filename, tokens, shifted_at, layout, self.n_stream, payload)
        except SlotFileError as exc:
            raise RequestError(str(exc), exc.status) from None
        ms = (time.perf_counter() - started) * 1000
        return SlotSavedReply(op.id, op.slot, op.filename, len(tokens), written, round(ms, 3))

    def _slot_restore(self, op: SlotRestoreOp) -> Reply:
        """The file is read and checked whole here, then put into the slot on the engine thread."""
        from daemon.llama.engine import EngineError
        from daemon.llama.kvdisk import SlotFileError, check_slot_name, unpack_slot

        files = self._slot_files()
        reason = check_slot_name(op.filename)
        if reason is not None:
            raise RequestError(reason)
        started = time.perf_counter()
        try:
            self.engine.check_slot(op.slot)  # before the file is read
            saved = files.read(op.filename)
            state = unpack_slot(saved, self.n_stream)
        except (SlotFileError, EngineError) as exc:
            raise RequestError(str(exc), exc.status) from None
        try:
            self.engine.call(lambda: self.engine.restore_slot(op.slot, saved.tokens, saved.shifted_at, state))
        except EngineError as exc:
            raise RequestError(str(exc), exc.status) from None
        ms = (time.perf_counter() - started) * 1000
        return SlotRestoredReply(op.id, op.slot, op.filename, len(saved.tokens), saved.size, round(ms, 3))

    def _slot_erase(self, op: SlotEraseOp) -> Reply:
        from daemon.llama.engine import EngineError

        if self.engine is None:
            raise RequestError("this model has no sequence slots (an embedding model)")
        try:
            n = self.engine.call(lambda: self.engine.erase_slot(op.slot))
        except EngineError as exc:
            raise RequestError(str(exc), exc.status) from None
        return SlotErasedReply(op.id, op.slot, int(n))

    def _tokenize(self, op: TokenizeOp) -> Reply:
        return TokensReply(op.id, tuple(self.tokenize(op.text, op.add_special)))

    def _detokenize(self, op: DetokenizeOp) -> Reply:
        return TextReply(op.id, self.model.detokenize(list(op.tokens)).decode("utf-8", errors="replace"))

    def _rerank(self, op: RerankOp) -> Reply:
        scores, count = self.rerank(op.query, op.documents, op.truncate)
        return RerankReply(op.id, tuple(scores), count)

    def _pieces(self, op: PiecesOp) -> Reply:
        return PiecesReply(op.id, tuple(self.pieces(op.tokens)))

    #: op class -> its handler: the reply to send, or None when the engine sends them (a generation)
    HANDLERS: dict[type[Any], Callable[[Runner, Any], Reply | None]] = {
        GenerateOp: _generate,
        EmbedOp: _embed,
        SlotsOp: _slots,
        TokenizeOp: _tokenize,
        DetokenizeOp: _detokenize,
        RerankOp: _rerank,
        PiecesOp: _pieces,
        SlotSaveOp: _slot_save,
        SlotRestoreOp: _slot_restore,
        SlotEraseOp: _slot_erase,
        AdaptersOp: _adapters,
    }

    def handle(self, op: Op) -> None:
        """Serve one op (the main thread's loop); a failure is the op's error reply, and the runner goes on."""
        rid = getattr(op, "id", 0)
        try:
            handler = self.HANDLERS.get(type(op))
            if handler is None:
                raise RequestError(f"unexpected operation {op.op!r}", 500)
            reply = handler(self, op)
            if reply is not None:
                self.chan.send(reply)
        except RequestError as exc:
            self.chan.send(ErrorReply(rid, str(exc), exc.status))
        except Exception as exc:  # noqa: BLE001 - report and keep serving
            traceback.print_exc()
            self.chan.send(ErrorReply(rid, f"llama.cpp error: {exc}", 500))


def _usable_cores() -> int:
    """The cores this process may run on (where the daemon did not say: ``LoadSpec.cpus``)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # macOS has no affinity: every core
        return os.cpu_count() or 1


def _watch_parent(ppid: int) -> None:
    while True:
        time.sleep(0.5)
        if os.getppid() != ppid:
            os._exit(0)


def main() -> None:
    proto_fd = os.dup(1)
    os.dup2(2, 1)  # anything printed (by us or llama.cpp) goes to stderr, never into the protocol
    sys.stdout = os.fdopen(1, "w", buffering=1)  # fd 1 now points at stderr
    chan = Channel(proto_fd)
    threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True).start()
    inbox: queue.Queue[Op | None] = queue.Queue()
    runner_ref: list[Runner] = []

    def malformed(exc: ProtocolError, data: bytes) -> None:
        sys.stderr.write(f"runner: malformed op: {exc}\n")
        try:
            obj = parse_payload(data)
        except ProtocolError:
            return
        if obj.get("op") == "load" and not runner_ref:
            chan.send(LoadErrorReply(f"the runner could not read the load op: {exc}"))
            os._exit(1)
        rid = request_id(obj)
        if rid is not None:
            chan.send(ErrorReply(rid, f"the runner could not read the request: {exc}", 500))

    def shutdown() -> NoReturn:
        """End the process at once, after what the slots hold has gone to the disk cache (within
        ``SHUTDOWN_FLUSH`` seconds: the daemon kills a runner that takes 5)."""
        if runner_ref:
            with contextlib.suppress(Exception):
                runner_ref[0].flush_disk(SHUTDOWN_FLUSH)
        os._exit(0)

    def read() -> None:
        stdin = sys.stdin.buffer
        while True:
            try:
                data = read_payload(stdin)
            except Exception:  # noqa: BLE001 - a length past MAX_FRAME: the stream cannot be read on
                data = None
            if data is None:
                shutdown()
            try:
                obj = parse_payload(data)
                op = decode_op(obj)
            except ProtocolError as exc:  # a malformed op fails alone (its request, when it names one)
                malformed(exc, data)
                continue
            if isinstance(op, ShutdownOp):
                shutdown()
            if isinstance(op, CancelOp):
                if runner_ref:
                    runner_ref[0].cancel(op.id)
                continue
            inbox.put(op)

    threading.Thread(target=read, daemon=True).start()
    first = inbox.get()
    if not isinstance(first, LoadOp):
        chan.send(LoadErrorReply("the first message must be load"))
        os._exit(1)
    try:
        runner = Runner(chan)
        runner_ref.append(runner)
        chan.send(StageReply("load"))
        runner.load(first.spec)
        chan.send(LoadedReply(runner.info()))
    except Exception as exc:  # noqa: BLE001
        traceback.print_exc()
        lines = runner_ref[0].log_lines[-20:] if runner_ref else []
        chan.send(LoadErrorReply(f"{exc}", tuple(lines)))
        os._exit(1)
    try:
        while True:
            op = inbox.get()
            if op is None:
                break
            runner.handle(op)
    finally:
        with contextlib.suppress(Exception):
            runner.close()
        os._exit(0)


if __name__ == "__main__":
    main()
