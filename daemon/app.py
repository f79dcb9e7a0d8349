"""The FastAPI app factory. No module-level app: ``create_app(settings, store=...)`` builds one."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from daemon import errors
from daemon.catalog import Catalog
from daemon.routes import blobs, create, meta, models
from daemon.security import DoorGuard
from daemon.settings import Settings
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


def create_app(settings: Settings, *, store: Store | None = None) -> FastAPI:
    """Build the daemon's app. ``store`` lets the caller take the directory lock before serving."""
    the_store = store or Store(settings.models)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        startup_prune(the_store, settings)
        log.info("corral ready version=%s models=%s", VERSION, the_store.root)
        yield
        log.info("corral shutting down")

    app = FastAPI(title="corral", version=VERSION, lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.settings = settings
    app.state.store = the_store
    app.state.catalog = Catalog(the_store)
    errors.install(app)
    for module in (meta, models, blobs, create):
        app.include_router(module.router)
    app.add_middleware(DoorGuard, loopback=settings.host.is_loopback, origins=settings.origins)
    return app
