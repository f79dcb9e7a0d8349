"""``POST /api/create``."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from starlette.concurrency import run_in_threadpool

from daemon.bodies import read_model
from daemon.create import Creator
from daemon.schemas import CreateRequest
from daemon.streaming import progress_response

router = APIRouter()


@router.post("/api/create")
async def create(request: Request) -> Response:
    req = await read_model(request, CreateRequest)
    creator = Creator(request.app.state.catalog, prune=not request.app.state.settings.noprune)
    it = await run_in_threadpool(creator.run, req)
    return await progress_response(it, stream=req.stream)
