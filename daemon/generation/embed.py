"""Embeddings: a model's vectors for some texts, normalised (and cut to ``dimensions``), as Ollama's ``/api/embed``
gives them; ``/v1/embeddings`` shapes the same result."""

from __future__ import annotations

import time
from typing import Any

from daemon.generation.calls import EmbedCall
from daemon.generation.inference import Inference, keep_alive_value, normalise
from daemon.logs import note
from errors import InvalidRequest, ModelNotFound


async def run_embed(inf: Inference, req: EmbedCall, started: float) -> dict[str, Any]:
    """Ollama's ``/api/embed`` result for ``req`` (shared with ``/v1/embeddings``)."""
    note(model=req.model)
    if not req.model:
        raise ModelNotFound("")
    inputs: list[str]
    if req.input is None or req.input == "":
        inputs = []
    elif isinstance(req.input, str):
        inputs = [req.input]
    elif isinstance(req.input, list) and all(isinstance(x, str) for x in req.input):
        inputs = [x for x in req.input if isinstance(x, str)]
    else:
        raise InvalidRequest("invalid input type")
    if req.dimensions is not None and req.dimensions < 0:
        raise InvalidRequest(f"dimensions must not be negative, got {req.dimensions}")
    ctx = await inf.lookup(req.model)
    opts = inf.options(ctx, req.options)
    spec = inf.load_spec(ctx, opts, embedding=True)
    async with await inf.acquire(ctx, spec, keep_alive_value(req.keep_alive)) as lease:
        if not inputs:
            return {"model": req.model, "embeddings": []}
        result = await lease.call(lambda runner: runner.embed(inputs, truncate=req.truncate))
    vectors = []
    for vec in result.vectors:
        v = normalise(vec)
        if req.dimensions and 0 < req.dimensions < len(v):
            v = normalise(v[: req.dimensions])
        vectors.append(v)
    return {
        "model": req.model,
        "embeddings": vectors,
        "total_duration": int((time.monotonic() - started) * 1e9),
        "load_duration": int(lease.load_duration * 1e9),
        "prompt_eval_count": result.prompt_eval_count,
    }
