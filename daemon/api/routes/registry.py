"""``POST /api/pull``, ``POST /api/push`` and corral's ``POST /api/prune``.

Pulls and pushes stream Ollama's progress objects (see ``registry/pull.py`` and ``registry/push.py``). The
daemon's table of downloads in flight lives on the app, so concurrent pulls of one blob share a download and a
prune never touches a blob a pull is using.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request, Response
from pydantic import StrictBool
from starlette.concurrency import run_in_threadpool

from daemon.api.bodies import read_model
from daemon.api.schemas import NamedRequest, Wire
from daemon.api.streaming import progress_response
from daemon.logs import note
from daemon.models.catalog import Catalog
from daemon.runners import kvstore
from daemon.runners.base import LoadSpec
from daemon.settings import Settings
from errors import CorralError, InvalidRequest, NotFound
from registry.credentials import auth_files
from registry.digest import Digest
from registry.download import Downloads
from registry.pull import Puller
from registry.pull_jobs import PullJobs
from registry.push import Pusher
from registry.store import TEMP_PREFIX, PrunePlan, Store, disk_bytes

router = APIRouter()

#: ``corral prune`` leaves blobs this young alone: an upload for a create may be about to use them.
EXPLICIT_PRUNE_GRACE = 300.0

#: ... and partial downloads written to this recently (a download that is starting right now).
PARTIAL_PRUNE_GRACE = 60.0

_downloads_lock = threading.Lock()


class PullRequest(NamedRequest):
    insecure: StrictBool = False
    stream: StrictBool = True
    # username and password are accepted and ignored, as by Ollama: credentials come from corral login


class PushRequest(PullRequest):
    pass


class PruneRequest(Wire):
    dry_run: StrictBool = False


def downloads(request: Request) -> Downloads:
    """The app's table of downloads in flight (made on first use)."""
    state = request.app.state
    with _downloads_lock:
        if not hasattr(state, "downloads"):
            state.downloads = Downloads(bandwidth=state.settings.pull_bandwidth)
    return state.downloads


def _auth_files(settings: Settings) -> list[Path]:
    return auth_files(settings.registry_auth or None)


@router.post("/api/pull")
async def pull(request: Request) -> Response:
    req = await read_model(request, PullRequest)
    note(model=req.model_name)
    if not req.model_name:
        raise InvalidRequest("model is required")
    puller = _puller(request)
    it = await run_in_threadpool(lambda: puller.run(req.model_name, insecure=req.insecure))
    return await progress_response(it, stream=req.stream)


def _puller(request: Request, **kw: Any) -> Puller:
    """A Puller into the daemon's store, with its downloads, lock, prune setting, registry auth and byte counter."""
    app = request.app.state
    catalog: Catalog = app.catalog
    metrics = getattr(app, "metrics", None)
    return Puller(
        catalog.store,
        downloads(request),
        catalog.lock,
        prune=not app.settings.noprune,
        auth_files=_auth_files(app.settings),
        on_bytes=metrics.pulled_bytes.inc if metrics is not None else None,
        **kw,
    )


def pull_jobs(request: Request) -> PullJobs:
    """The app's table of background pulls (made on first use)."""
    state = request.app.state
    with _downloads_lock:
        if not hasattr(state, "pull_jobs"):
            state.pull_jobs = PullJobs()
    return state.pull_jobs


class PullJobRequest(NamedRequest):
    insecure: StrictBool = False


@router.post("/api/pulls")
async def start_pull_job(request: Request) -> dict[str, Any]:
    """corral: start a pull that runs in the daemon whoever watches it (the web page's pulls survive a reload), or
    return the one already running under this name. Its progress: ``GET /api/pulls``."""
    req = await read_model(request, PullJobRequest)
    note(model=req.model_name)
    if not req.model_name:
        raise InvalidRequest("model is required")
    puller = _puller(request, interval=0.25)
    name = req.model_name
    table = pull_jobs(request)
    job = await run_in_threadpool(
        table.start, name, req.insecure, lambda stop: puller.run(name, insecure=req.insecure, stop=stop)
    )
    return job.to_json()


@router.get("/api/pulls")
def list_pull_jobs(request: Request) -> dict[str, Any]:
    """corral: the background pulls running, and those that ended in the last minutes (``done``, ``error``), each
    with its layers' bytes, speed and ETA."""
    return {"pulls": pull_jobs(request).list()}


@router.delete("/api/pulls")
async def cancel_pull_job(request: Request) -> dict[str, Any]:
    """corral: cancel a background pull by the name it was started with."""
    req = await read_model(request, PullJobRequest)
    job = pull_jobs(request).cancel(req.model_name)
    if job is None:
        raise NotFound(f"no background pull of {req.model_name!r}: GET /api/pulls lists them")
    return job.to_json()


@router.post("/api/push")
async def push(request: Request) -> Response:
    req = await read_model(request, PushRequest)
    note(model=req.model_name)
    if not req.model_name:
        raise InvalidRequest("model is required")
    app = request.app.state
    pusher = Pusher(app.catalog.store, auth_files=_auth_files(app.settings))
    it = await run_in_threadpool(lambda: pusher.run(req.model_name, insecure=req.insecure))
    return await progress_response(it, stream=req.stream)


def _kind(path: Path) -> str:
    if path.name.startswith(TEMP_PREFIX):
        return "temp"
    return "partial" if "-partial" in path.name else "blob"


def _describe(plan: PrunePlan, dry_run: bool) -> dict[str, Any]:
    files = []
    for path in (*plan.blobs, *plan.partials):
        try:
            size = disk_bytes(path.stat())
        except FileNotFoundError:
            continue
        files.append({"file": path.name, "kind": _kind(path), "size": size})
    out: dict[str, Any] = {"dry_run": dry_run, "files": files, "bytes_freed": plan.bytes_freed}
    if plan.skipped_reason:
        out["skipped_reason"] = plan.skipped_reason
    return out


def prune_kv_disk(store: Store, settings: Settings, loaded: list[LoadSpec]) -> int:
    """Remove the prompt caches on disk of models that are gone (``kvstore.prune``): a key directory stays while
    its model blob is referenced by a manifest or loaded now (``loaded``: the runners' specs). The bytes freed; 0
    without a cache directory, or when a manifest cannot be read (which models are gone is then unknown). The
    caller holds the catalog's lock."""
    root = settings.kv_disk_dir
    if root is None or not root.is_dir():
        return 0
    try:
        keep = {str(d) for d in store.referenced_blobs(strict=True)}
    except CorralError:
        return 0
    for spec in loaded:
        digest = Digest.from_filename(Path(spec.model_path).name)
        if digest is not None:
            keep.add(str(digest))
    return kvstore.prune(root, keep)


def loaded_specs(request: Request) -> list[LoadSpec]:
    return [item["entry"].spec for item in request.app.state.scheduler.loaded()]


@router.post("/api/prune")
async def prune(request: Request) -> dict[str, Any]:
    """Remove unreferenced blobs (older than 5 minutes), partial downloads not in progress (untouched for a
    minute) and the prompt caches on disk of models that are gone (``kv_disk_bytes_freed``; not on a dry run)."""
    req = await read_model(request, PruneRequest, allow_empty=True)
    catalog: Catalog = request.app.state.catalog
    table = downloads(request)
    settings: Settings = request.app.state.settings
    loaded = loaded_specs(request)

    def run() -> dict[str, Any]:
        with catalog.lock:
            plan = catalog.store.plan_prune(
                grace_seconds=EXPLICIT_PRUNE_GRACE, partial_grace_seconds=PARTIAL_PRUNE_GRACE, keep=table.busy()
            )
            out = _describe(plan, req.dry_run)
            if not req.dry_run and not plan.skipped_reason:
                out["bytes_freed"] = catalog.store.prune(plan)
                out["kv_disk_bytes_freed"] = prune_kv_disk(catalog.store, settings, loaded)
        return out

    return await run_in_threadpool(run)
