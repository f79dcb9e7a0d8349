"""``POST /api/embed`` and the legacy ``POST /api/embeddings``."""

from __future__ import annotations

import math
import time
from typing import Any

from fastapi import APIRouter, Request

from daemon.api.bodies import read_model
from daemon.api.schemas import EmbeddingsRequestBody, EmbedRequestBody
from daemon.api.state import inference
from daemon.generation.embed import run_embed
from daemon.generation.inference import keep_alive_value
from daemon.logs import note
from errors import InvalidRequest

router = APIRouter()


@router.post("/api/embed")
async def embed(request: Request) -> dict[str, Any]:
    started = time.monotonic()
    req = await read_model(request, EmbedRequestBody)
    return await run_embed(inference(request), req.call(), started)


@router.post("/api/embeddings")
async def embeddings(request: Request) -> dict[str, Any]:
    req = await read_model(request, EmbeddingsRequestBody)
    note(model=req.model_name)
    if not req.model_name:
        raise InvalidRequest("model is required")
    inf = inference(request)
    ctx = await inf.lookup(req.model_name)
    opts = inf.options(ctx, req.options)
    spec = inf.load_spec(ctx, opts, embedding=True)
    async with await inf.acquire(ctx, spec, keep_alive_value(req.keep_alive)) as lease:
        if not req.prompt:
            return {"embedding": []}
        result = await lease.call(lambda runner: runner.embed([req.prompt], truncate=True))
    vec = result.vectors[0]
    if any(math.isnan(x) or math.isinf(x) for x in vec):
        raise InvalidRequest("embedding contains NaN or Inf values")
    return {"embedding": vec}
