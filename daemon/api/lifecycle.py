"""A replica's life behind a load balancer (issue 30): readiness, draining on SIGTERM, the preloads (pulled from
their registry first with ``CORRAL_PRELOAD_PULL``) and the replica's name (``CORRAL_INSTANCE``).

* ``GET /health`` is liveness: 200 while the process serves. ``GET /health/ready`` is readiness: 200
  ``{"status": "ready"}`` once the ``CORRAL_PRELOAD`` models are pulled and loaded, else 503 with the reason
  (``preloading``: which model is being pulled or loaded; ``preload failed``: which and why; ``draining``). Both are
  open without an API key, and neither counts as a request in flight.
* **SIGTERM drains** (``daemon.api.server`` calls :meth:`Lifecycle.begin_drain`): readiness turns 503 at once; new
  requests are still served while a balancer may not have noticed (the *grace*: until two readiness probes have
  been answered 503, at most ``GRACE_MAX`` seconds, none when no probe came in the last ``PROBE_WINDOW`` seconds);
  then new requests get 503 with ``Retry-After`` and ``Connection: close`` (a balancer retries them elsewhere)
  while the requests in flight, streams included, finish. The process exits when none is left, or once
  ``CORRAL_DRAIN_TIMEOUT`` has passed. A second SIGTERM, or SIGINT, stops at once as before.
* Every answer carries ``X-Corral-Instance: <CORRAL_INSTANCE>``, so a client behind a balancer can tell which
  replica answered it.
* Preloads (:func:`run_preloads`): one after another, each looked up in the store; with ``CORRAL_PRELOAD_PULL`` a
  model the store lacks is pulled from its registry first (the pull code ``/api/pull`` runs; a name written with
  ``http://`` is pulled over plain HTTP, as ``corral pull --insecure`` would). A failed pull is logged and tried
  again with a growing pause (the registry may start after the replica, as in a compose file), the reason shown by
  readiness meanwhile; a model that cannot be loaded is logged and readiness says so until a restart.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
from starlette.concurrency import run_in_threadpool

from daemon.api.security import ASGIApp, Receive, Scope, Send
from errors import ModelNotFound

log = logging.getLogger(__name__)

READY_PATH = "/health/ready"
#: paths that never count as requests in flight and are answered while draining (probes and scrapes)
PROBE_PATHS = frozenset({"/health", READY_PATH, "/metrics"})
GRACE_MAX = 5.0  # seconds: the longest new requests are still served after SIGTERM
GRACE_PROBES = 2  # readiness probes answered 503 after which a balancer has surely taken the replica out
PROBE_WINDOW = 30.0  # seconds: a readiness probe this recent means a balancer (or orchestrator) is watching
PULL_RETRY_FIRST = 1.0  # seconds before a failed preload pull is tried again; doubled each time ...
PULL_RETRY_MAX = 60.0  # ... up to this


RETRY_AFTER = 1  # seconds: what a refused request is told to wait (a balancer retries elsewhere at once)


@dataclass
class Lifecycle:
    """The replica's state, shared by the app (readiness, the gate) and the server (SIGTERM)."""

    instance: str
    drain_timeout: float
    clock: Callable[[], float] = time.monotonic
    preloads: dict[str, str] = field(default_factory=dict)  # name -> waiting, pulling, loading, ready, failed
    errors: dict[str, str] = field(default_factory=dict)  # name -> why its pull or load failed (last time)
    in_flight: int = 0
    draining_since: float | None = None
    refusing: bool = False
    last_probe: float = float("-inf")
    probes_refused: int = 0  # readiness probes answered 503 since the drain began

    # -- readiness ---------------------------------------------------------------------------------------------
    def readiness(self) -> tuple[bool, dict[str, Any]]:
        body: dict[str, Any] = {"instance": self.instance}
        if self.preloads:
            body["preload"] = {
                name: ({"state": state, "error": self.errors[name]} if name in self.errors else {"state": state})
                for name, state in self.preloads.items()
            }
        if self.draining_since is not None:
            body["status"] = "draining"
            body["reason"] = "shutting down (SIGTERM): finishing the requests in flight"
            return False, body
        failed = [n for n, s in self.preloads.items() if s == "failed"]
        busy = [n for n, s in self.preloads.items() if s in ("waiting", "pulling", "loading")]
        if failed:
            body["status"] = "preload failed"
            body["reason"] = "; ".join(f"{n}: {self.errors.get(n, 'failed')}" for n in failed)
            return False, body
        if busy:
            body["status"] = "preloading"
            body["reason"] = ", ".join(f"{self.preloads[n]} {n}" for n in busy)
            return False, body
        body["status"] = "ready"
        return True, body

    def probe(self) -> tuple[bool, dict[str, Any]]:
        """A readiness probe: its answer, remembered (the drain's grace counts the 503s a balancer has seen)."""
        ready, body = self.readiness()
        self.last_probe = self.clock()
        if self.draining_since is not None:
            self.probes_refused += 1
        return ready, body

    # -- draining ----------------------------------------------------------------------------------------------
    @property
    def draining(self) -> bool:
        return self.draining_since is not None

    def begin_drain(self) -> None:
        now = self.clock()
        self.draining_since = now
        self.probes_refused = 0
        watched = now - self.last_probe <= PROBE_WINDOW
        log.info(
            "SIGTERM: draining instance=%s in_flight=%d timeout=%gs (readiness is 503 now%s)",
            self.instance,
            self.in_flight,
            self.drain_timeout,
            "; new requests are served until the balancer has seen it" if watched else "",
        )
        if not watched:
            self.refusing = True

    def drained(self) -> bool:
        """Called by the server every tick while draining: True once the process may stop."""
        if self.draining_since is None:
            return False
        elapsed = self.clock() - self.draining_since
        if elapsed >= self.drain_timeout:
            log.warning(
                "drain timeout (CORRAL_DRAIN_TIMEOUT=%gs) reached with %d requests in flight; stopping",
                self.drain_timeout,
                self.in_flight,
            )
            return True
        if not self.refusing and (self.probes_refused >= GRACE_PROBES or elapsed >= GRACE_MAX):
            self.refusing = True
            log.info("drain: refusing new requests with 503 now; %d in flight", self.in_flight)
        if self.refusing and self.in_flight == 0:
            log.info("drained: no request in flight after %.1fs; stopping", elapsed)
            return True
        return False


class LifecycleGate:
    """ASGI middleware (outermost): names the replica on every answer, counts the requests in flight, and refuses new
    ones with 503 once a drain has passed its grace."""

    def __init__(self, app: ASGIApp, *, lifecycle: Lifecycle) -> None:
        self.app = app
        self.lifecycle = lifecycle
        self.header = (b"x-corral-instance", lifecycle.instance.encode("latin-1"))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        life = self.lifecycle
        counted = scope["path"] not in PROBE_PATHS

        async def named(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), self.header]
            await send(message)

        if counted and life.refusing:
            response = refusal(scope["path"])
            await response(scope, receive, named)  # type: ignore[arg-type]  # starlette types send loosely
            return
        if not counted:
            await self.app(scope, receive, named)
            return
        life.in_flight += 1
        try:
            await self.app(scope, receive, named)
        finally:
            life.in_flight -= 1


def refusal(path: str) -> JSONResponse:
    """A draining replica's 503, in the shape of the API called (built here: compat's error shapes log every 5xx as a
    failure, and a refusal while draining is none), with Retry-After and Connection: close."""
    message = "this corral replica is shutting down; retry the request (a load balancer sends it to another replica)"
    body: dict[str, Any]
    headers = {"Retry-After": str(RETRY_AFTER), "Connection": "close"}
    if path.startswith("/v1/messages"):  # Anthropic's
        request_id = f"req_{secrets.token_hex(12)}"
        body = {"type": "error", "error": {"type": "overloaded_error", "message": message}, "request_id": request_id}
        headers["request-id"] = request_id
    elif path.startswith("/v1/"):  # OpenAI's
        body = {"error": {"message": message, "type": "server_error", "param": None, "code": None}}
    else:  # Ollama's
        body = {"error": message}
    return JSONResponse(body, status_code=503, headers=headers)


class InstanceInfo(Collector):
    """``corral_info{corral_instance="<CORRAL_INSTANCE>", version="..."} 1``: an info metric, as Prometheus
    exporters name their replica and build (``node_uname_info``, ``*_build_info``). The label is not ``instance``:
    Prometheus sets that one itself on every scrape (host:port), and would rename ours to ``exported_instance``.
    Join it onto any series with ``* on (instance) group_left (corral_instance) corral_info``."""

    def __init__(self, instance: str) -> None:
        self.instance = instance

    def collect(self) -> Any:
        from daemon.version import VERSION

        info = GaugeMetricFamily(
            "corral_info", "This corral replica: its CORRAL_INSTANCE and version", labels=["corral_instance", "version"]
        )
        info.add_metric([self.instance, VERSION], 1)
        yield info


router = APIRouter()


@router.get(READY_PATH)
def ready(request: Request) -> JSONResponse:
    """Readiness: 200 when this replica takes traffic, 503 with the reason while it starts, preloads or drains."""
    life: Lifecycle = request.app.state.lifecycle
    ok, body = life.probe()
    return JSONResponse(body, status_code=200 if ok else 503, headers=None if ok else {"Retry-After": "1"})


# -- preloads ----------------------------------------------------------------------------------------------------
async def run_preloads(state: Any, names: tuple[str, ...], *, pull: bool) -> None:
    """CORRAL_PRELOAD: each model in turn (pulled first if missing and ``pull``), loaded as ``/api/generate`` with an
    empty prompt does (default options and keep-alive). A model whose pull failed does not hold up the others: the
    failed ones are tried again after the others, after 1, 2, 4... seconds (at most ``PULL_RETRY_MAX``). Readiness
    follows ``state.lifecycle.preloads``."""
    life: Lifecycle = state.lifecycle
    for name in names:
        life.preloads.setdefault(name, "waiting")
    pending = list(dict.fromkeys(names))
    pause = PULL_RETRY_FIRST
    while True:
        again = [name for name in pending if await _preload_one(state, life, name, pull=pull)]
        if not again:
            return
        for name in again:
            log.warning(
                "CORRAL_PRELOAD: cannot pull model=%s: %s; trying again in %gs", name, life.errors.get(name), pause
            )
        await asyncio.sleep(pause)
        pause = min(pause * 2, PULL_RETRY_MAX)
        pending = again


async def _preload_one(state: Any, life: Lifecycle, name: str, *, pull: bool) -> bool:
    """Look the model up (pulling it if missing and ``pull``), then load it. True: its pull failed, try again."""
    inference = state.inference
    pulled = False
    while True:
        try:
            ctx = await inference.lookup(name)
            break
        except ModelNotFound as exc:
            if not pull:
                _failed(life, name, f"{exc} (set CORRAL_PRELOAD_PULL=1 to pull it from its registry)")
                return False
            if pulled:  # pulled, and still not found under that name
                _failed(life, name, f"{exc} after pulling it")
                return False
        except Exception as exc:  # noqa: BLE001 - a bad name never stops the daemon
            _failed(life, name, str(exc))
            return False
        life.preloads[name] = "pulling"
        try:
            await _pull(state, name)
        except Exception as exc:  # noqa: BLE001 - the registry may come up later: try again
            life.errors[name] = f"pull failed: {exc}"
            return True
        pulled = True
        life.errors.pop(name, None)
        log.info("CORRAL_PRELOAD: pulled model=%s from its registry", name)
    life.preloads[name] = "loading"
    try:
        embedding = "completion" not in ctx.capabilities and "embedding" in ctx.capabilities
        spec = inference.load_spec(ctx, inference.options(ctx, None), embedding=embedding)
        lease = await inference.acquire(ctx, spec, None)
        lease.release()
    except Exception as exc:  # noqa: BLE001 - a failed load never stops the daemon
        _failed(life, name, str(exc))
        return False
    life.preloads[name] = "ready"
    life.errors.pop(name, None)
    log.info("preloaded model=%s (CORRAL_PRELOAD)", ctx.name.short())
    return False


def _failed(life: Lifecycle, name: str, why: str) -> None:
    life.preloads[name] = "failed"
    life.errors[name] = why
    log.warning("CORRAL_PRELOAD: cannot preload model=%s: %s", name, why)


async def _pull(state: Any, name: str) -> None:
    from daemon.api.routes import registry as registry_routes
    from registry.credentials import auth_files
    from registry.download import Downloads
    from registry.pull import Puller

    with registry_routes._downloads_lock:  # the table /api/pull uses, made here if no pull came first
        if not hasattr(state, "downloads"):
            state.downloads = Downloads(bandwidth=state.settings.pull_bandwidth)
    metrics = getattr(state, "metrics", None)
    catalog = state.catalog
    puller = Puller(
        catalog.store,
        state.downloads,
        catalog.lock,
        prune=not state.settings.noprune,
        auth_files=auth_files(state.settings.registry_auth or None),
        on_bytes=metrics.pulled_bytes.inc if metrics is not None else None,
        interval=1.0,
    )
    insecure = name.lower().startswith("http://")

    def run() -> None:
        for _progress in puller.run(name, insecure=insecure):
            pass

    await run_in_threadpool(run)
