"""The FastAPI app factory. No module-level app: ``create_app(settings, store=...)`` builds one."""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Response
from prometheus_client import CONTENT_TYPE_LATEST

from daemon.api import errors
from daemon.api.auth import APIKeyGate
from daemon.api.disconnect import CancelOnDisconnect
from daemon.api.lifecycle import InstanceInfo, Lifecycle, LifecycleGate, run_preloads
from daemon.api.lifecycle import router as lifecycle_router
from daemon.api.observe import Metrics, Observe
from daemon.api.routes import anthropic as anthropic_routes
from daemon.api.routes import blobs, create, embed, generate, meta, models, ps
from daemon.api.routes import lora as lora_routes
from daemon.api.routes import openai as openai_routes
from daemon.api.routes import registry as registry_routes
from daemon.api.routes import rerank as rerank_routes
from daemon.api.routes import responses as responses_routes
from daemon.api.routes import slots as slots_routes
from daemon.api.routes import transfer as transfer_routes
from daemon.api.routes import ui as ui_routes
from daemon.api.security import DoorGuard
from daemon.generation.inference import Inference
from daemon.models.catalog import Catalog
from daemon.rpc import RpcPool, rpc_budgets
from daemon.runners.base import LoadSpec, MemoryUse, Runner
from daemon.scheduling.eviction import Budget
from daemon.scheduling.fallback import Fallbacks, machine_fingerprint
from daemon.scheduling.scheduler import ModelRef, Scheduler
from daemon.settings import Settings, default_context_length
from daemon.version import VERSION
from registry.store import Store

log = logging.getLogger(__name__)


def startup_prune(store: Store, settings: Settings) -> None:
    if settings.noprune:
        log.info("prune skipped (CORRAL_NOPRUNE is set)")
        return
    plan = store.plan_prune()
    if plan.skipped_reason:
        log.warning("corrupt manifests detected, skipping prune: %s; re-pull or delete to clear", plan.skipped_reason)
        return
    freed = store.prune(plan)
    log.info("prune removed_blobs=%d bytes_freed=%d", len(plan.blobs), freed)
    kv_freed = registry_routes.prune_kv_disk(store, settings, [])  # no runner is loaded yet
    if kv_freed:
        log.info("prune removed the prompt caches on disk of models that are gone bytes_freed=%d", kv_freed)


def default_runner_factory(
    ref: ModelRef, spec: LoadSpec, *, load_timeout: float | None = None, rpc: RpcPool | None = None
) -> Runner:
    """A llama.cpp runner process; ``load_timeout``: CORRAL_LOAD_TIMEOUT (None: the runner's default). One that
    offloads to llama.cpp rpc-servers (its spec names them) runs with the RPC-enabled libraries (``rpc``,
    CORRAL_RPC_SERVERS, daemon/rpc.py); any other with the daemon's environment."""
    from daemon.runners.process import ProcessRunner

    env = rpc.env() if rpc is not None and spec.rpc_servers else None
    if load_timeout is None:
        return ProcessRunner(spec, env=env)
    return ProcessRunner(spec, load_timeout=load_timeout, env=env)


def default_estimator(catalog: Catalog) -> Callable[[ModelRef, LoadSpec], MemoryUse]:
    """The scheduler's memory estimate of a load (it runs it in a worker thread, off the event loop). The header is
    read bounded (registry.gguf's limits; at most MAX_LAYERS layers) and without the token list: per-layer arrays
    (at most MAX_LAYERS long) are all the estimate reads."""
    from daemon.scheduling.memory import draft_header, draft_memory, estimate, projector_file_memory
    from registry.gguf import MAX_LAYERS, read_gguf_file

    def run(ref: ModelRef, spec: LoadSpec) -> MemoryUse:
        info = read_gguf_file(spec.model_path, max_array_keep=MAX_LAYERS)
        est = estimate(
            info,
            num_ctx=spec.num_ctx,
            num_parallel=spec.num_parallel,
            num_batch=spec.num_batch,
            n_gpu_layers=spec.num_gpu,
            kv_type=spec.kv_cache_type,
            projector=projector_file_memory(spec.projector_path) if spec.projector_path else 0,
        )
        draft_ram = draft_vram = 0
        if spec.draft_path:  # the draft model loaded beside it (speculative decoding): weights, KV cache, buffer
            draft_ram, draft_vram = draft_memory(
                draft_header(spec.draft_path),
                num_ctx=spec.num_ctx,
                num_parallel=spec.num_parallel,
                num_batch=spec.num_batch,
                n_gpu_layers=spec.draft_num_gpu,
                kv_type=spec.kv_cache_type,
            )
        return MemoryUse(ram=est.ram + spec.prompt_cache + draft_ram, vram=est.vram + draft_vram)

    return run


def create_app(
    settings: Settings,
    *,
    store: Store | None = None,
    runner_factory: Callable[[ModelRef, LoadSpec], Runner] | None = None,
    estimator: Callable[[ModelRef, LoadSpec], MemoryUse] | None = None,
) -> FastAPI:
    """Build the daemon's app. ``store`` lets the caller take the directory lock before serving; the runner
    factory and the memory estimator can be replaced (tests)."""
    from daemon.hardware import Budgets, budgets, describe, detect

    the_store = store or Store(settings.models)
    catalog = Catalog(the_store)
    hw = detect()
    local_budgets = budgets(hw, settings.ram_budget, settings.vram_budget)
    # llama.cpp rpc-servers (issue 30): probed here (bounded), their memory added to the offload budget; those that
    # do not answer yet are probed again in the background (RpcPool.watch) and join when they do
    rpc_pool = RpcPool.start(settings.rpc_servers, settings.llama_lib_path)

    def current_budgets() -> Budgets:
        return rpc_budgets(local_budgets, rpc_pool)

    the_budgets = current_budgets()
    total_vram = sum(g.total_vram for g in hw.gpus) if hw.gpu_offload else 0  # the GPUs llama.cpp can use
    default_num_ctx = default_context_length(total_vram, settings.context_length)
    scheduler = Scheduler(
        runner_factory=runner_factory
        or functools.partial(default_runner_factory, load_timeout=settings.load_timeout, rpc=rpc_pool),
        estimate=estimator or default_estimator(catalog),
        budget=lambda: Budget(
            ram=local_budgets.ram,
            vram=current_budgets().vram,
            max_loaded=settings.max_loaded_models,
            shared=local_budgets.shared,
        ),
        default_keep_alive=settings.keep_alive,
        max_queue=settings.max_queue,
        fallbacks=Fallbacks(
            machine=machine_fingerprint(tuple(g.name for g in hw.gpus)),
            read=the_store.read_runner_state,
            write=the_store.write_runner_state,
        ),
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        startup_prune(the_store, settings)
        for line in describe(hw, the_budgets):
            log.info("%s", line)
        log.info(
            "default context length total_vram=%d default_num_ctx=%d source=%s flash_attention=%s kv_cache_type=%s",
            total_vram,
            default_num_ctx,
            "CORRAL_CONTEXT_LENGTH" if settings.context_length else "automatic",
            settings.flash_attention,
            settings.kv_cache_type,
        )
        if settings.kv_disk > 0 and settings.kv_disk_dir is not None:
            log.info("prompt cache on disk dir=%s limit_bytes=%d", settings.kv_disk_dir, settings.kv_disk)
        else:
            log.info("prompt cache on disk off (CORRAL_KV_DISK=0)")
        scheduler.start()
        log.info("corral ready version=%s models=%s", VERSION, the_store.root)
        preloading = (
            asyncio.ensure_future(run_preloads(app.state, settings.preload, pull=settings.preload_pull))
            if settings.preload
            else None
        )  # in the background: startup does not wait for the loads (readiness does: daemon/api/lifecycle.py)
        rpc_watch = asyncio.ensure_future(rpc_pool.watch())  # servers that did not answer at startup
        try:
            yield
        finally:
            rpc_watch.cancel()
            if preloading is not None:
                preloading.cancel()
            log.info("corral shutting down; unloading models")
            await scheduler.close()

    app = FastAPI(title="corral", version=VERSION, lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.settings = settings
    app.state.lifecycle = lifecycle = Lifecycle(settings.instance, settings.drain_timeout)
    lifecycle.preloads.update(dict.fromkeys(settings.preload, "waiting"))  # not ready until they are loaded
    app.state.store = the_store
    app.state.catalog = catalog
    app.state.scheduler = scheduler
    app.state.hardware = hw
    app.state.rpc = rpc_pool

    def budgets_json() -> dict[str, Any]:  # /api/info's: now (an RPC server may have joined since startup)
        b = current_budgets()
        return {
            "ram": b.ram,
            "vram": b.vram,
            "max_loaded_models": settings.max_loaded_models,
            "ram_source": b.ram_source,
            "vram_source": b.vram_source,
            "gpus": list(b.gpu_budgets),  # VRAM budget per GPU (GPU.index order)
            "unified_memory": b.shared,
        }

    app.state.budgets_json = budgets_json
    app.state.inference = Inference(
        catalog,
        scheduler,
        settings,
        vram_budget=local_budgets.vram,
        ram_budget=local_budgets.ram,
        physical_cores=hw.physical_cores,
        logical_cores=hw.logical_cores,
        default_num_ctx=default_num_ctx,
        gpu_budgets=the_budgets.gpu_budgets,
        rpc=rpc_pool,
        shared_memory=the_budgets.shared,
    )
    errors.install(app)
    for module in (meta, models, blobs, create, generate, embed, ps):
        app.include_router(module.router)
    app.include_router(registry_routes.router)
    app.include_router(openai_routes.router)
    app.include_router(responses_routes.router)
    app.include_router(anthropic_routes.router)
    app.include_router(transfer_routes.router)
    app.include_router(rerank_routes.router)
    app.include_router(slots_routes.router)
    app.include_router(lora_routes.router)
    app.include_router(ui_routes.router)  # the web page (issue 31)
    app.include_router(lifecycle_router)  # /health/ready
    metrics = Metrics(scheduler)
    metrics.registry.register(InstanceInfo(settings.instance))
    app.state.metrics = metrics

    @app.get("/metrics")
    def metrics_endpoint() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/health")
    def health() -> dict[str, str]:
        return {"status": "ok"}

    app.add_middleware(CancelOnDisconnect)
    if settings.api_key:
        app.add_middleware(APIKeyGate, key=settings.api_key)
    app.add_middleware(Observe, metrics=metrics)
    app.add_middleware(DoorGuard, loopback=settings.host.is_loopback, origins=settings.origins)
    app.add_middleware(errors.RefusalLog, log_prompts=settings.log_prompts)  # sees every 4xx
    app.add_middleware(LifecycleGate, lifecycle=lifecycle)  # outermost: X-Corral-Instance, drain refusals
    return app
