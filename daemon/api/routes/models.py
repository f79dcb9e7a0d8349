"""Model management: ``/api/tags``, ``/api/show``, ``/api/copy``, ``/api/delete``."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request, Response
from starlette.concurrency import run_in_threadpool

from daemon.api.bodies import read_model
from daemon.api.schemas import CopyRequest, DeleteRequest, ShowRequest
from daemon.logs import note
from daemon.models.catalog import Catalog
from errors import InvalidRequest

router = APIRouter()


def catalog(request: Request) -> Catalog:
    return request.app.state.catalog


@router.api_route("/api/tags", methods=["GET", "HEAD"])
async def tags(request: Request) -> dict[str, Any]:
    return {"models": await run_in_threadpool(catalog(request).tags)}


@router.post("/api/show")
async def show(request: Request) -> dict[str, Any]:
    req = await read_model(request, ShowRequest)
    note(model=req.model_name)
    if not req.model_name:
        raise InvalidRequest("model is required")
    return await run_in_threadpool(
        lambda: catalog(request).show(req.model_name, verbose=req.verbose, system=req.system, options=req.options)
    )


@router.post("/api/copy")
async def copy(request: Request) -> Response:
    req = await read_model(request, CopyRequest)
    note(model=req.source)
    await run_in_threadpool(catalog(request).copy, req.source, req.destination)
    return Response(status_code=200)


@router.delete("/api/delete")
async def delete(request: Request) -> Response:
    req = await read_model(request, DeleteRequest)
    note(model=req.model_name)
    removed = await run_in_threadpool(catalog(request).delete, req.model_name)
    # a LoRA adapter no model uses any more is freed on the runners that loaded it (issue 29); streams go on
    await request.app.state.inference.drop_adapters(removed)
    return Response(status_code=200)
