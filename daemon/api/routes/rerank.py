"""``POST /api/rerank`` and ``/v1/rerank`` (llama-server's and Jina/Cohere's shape), ``POST /api/tokenize`` and
``/api/detokenize`` (llama-server's shapes).

Rerank needs a reranker GGUF (``<arch>.pooling_type`` = 4, rank: a cross-encoder with a classifier head, or a
causal reranker such as Qwen3-Reranker); its runner is loaded for embeddings with pooling rank
(``LoadSpec.rerank``) and scores every query/document pair in as few ``llama_decode`` calls as fit the batch.
Scores are the model's raw output, as llama-server returns them, sorted best first.

Tokenize and detokenize run on whatever runner holds the model (a loaded one is used as it is; else the model's
ordinary runner is loaded: its generation runner, or its embedding/rerank runner for such models).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse

from daemon.api.bodies import read_body
from daemon.api.compat import BadParam, get, openai_error, read_json, shaped
from daemon.api.state import inference
from daemon.generation.inference import Inference, ModelContext, keep_alive_value
from daemon.runners.base import LoadSpec
from errors import InvalidRequest

router = APIRouter()

POOLING_RANK = 4  # LLAMA_POOLING_TYPE_RANK


def is_reranker(ctx: ModelContext) -> bool:
    meta = ctx.info.metadata
    value = meta.get(f"{meta.get('general.architecture', '')}.pooling_type")
    return isinstance(value, int) and not isinstance(value, bool) and value == POOLING_RANK


def _documents(body: dict[str, Any]) -> list[str]:
    """``documents`` (or TEI's ``texts``): strings, or Jina/Cohere's objects with a ``text``."""
    name = "documents" if "documents" in body or "texts" not in body else "texts"
    raw = body.get(name)
    if not isinstance(raw, list) or not raw:
        raise BadParam(name, f'"{name}" must be a non-empty string array')
    docs = []
    for i, doc in enumerate(raw):
        if isinstance(doc, dict) and isinstance(doc.get("text"), str):
            doc = doc["text"]
        if not isinstance(doc, str):
            raise BadParam(name, f'"{name}[{i}]" must be a string (or an object with a "text" string)')
        docs.append(doc)
    return docs


async def run_rerank(inf: Inference, body: dict[str, Any], started: float) -> dict[str, Any]:
    model = get(body, "model", "str", required=True)
    query = get(body, "query", "str", required=True)
    documents = _documents(body)
    top_n = get(body, "top_n", "int", lo=0)
    return_documents = bool(get(body, "return_documents", "bool") or False)
    truncate = get(body, "truncate", "bool")
    ctx = await inf.lookup(model)
    if not is_reranker(ctx):
        raise InvalidRequest(f'model "{model}" does not support reranking')
    opts = inf.options(ctx, get(body, "options", "dict"))
    spec = dataclasses.replace(inf.load_spec(ctx, opts, embedding=True), rerank=True)
    async with await inf.acquire(ctx, spec, keep_alive_value(body.get("keep_alive"))) as lease:
        scores, count = await lease.call(lambda runner: runner.rerank(query, documents, truncate=truncate is not False))
    order = sorted(range(len(documents)), key=lambda i: (-scores[i], i))
    if top_n is not None and top_n > 0:  # 0, as absent: every document (llama-server's default)
        order = order[:top_n]
    results = []
    for i in order:
        item: dict[str, Any] = {"index": i, "relevance_score": scores[i]}
        if return_documents:
            item["document"] = {"text": documents[i]}
        results.append(item)
    return {
        "model": model,
        "object": "list",
        "results": results,
        "usage": {"prompt_tokens": count, "total_tokens": count},
        "total_duration": int((time.monotonic() - started) * 1e9),
        "load_duration": int(lease.load_duration * 1e9),
    }


@router.post("/api/rerank")
async def rerank(request: Request) -> dict[str, Any]:
    started = time.monotonic()
    body = await read_body(request)
    if not isinstance(body, dict):
        raise InvalidRequest(f"request body must be a JSON object, got {type(body).__name__}")
    return await run_rerank(inference(request), body, started)


@router.post("/v1/rerank")
@shaped(openai_error)
async def rerank_v1(request: Request) -> Response:
    started = time.monotonic()
    result = await run_rerank(inference(request), await read_json(request), started)
    for key in ("total_duration", "load_duration"):
        result.pop(key)
    return JSONResponse(result)


# -- tokenize / detokenize -------------------------------------------------------------------------------------------
async def _spec_for(inf: Inference, ctx: ModelContext, body: dict[str, Any]) -> LoadSpec:
    """The spec of the runner that holds this model now, else of the model's ordinary runner."""
    entry = getattr(inf.scheduler, "_loaded", {}).get(ctx.ref.key)
    if entry is not None and entry.runner.alive() and not entry.unload_when_idle and not entry.loading:
        return entry.spec
    opts = inf.options(ctx, get(body, "options", "dict"))
    if is_reranker(ctx):
        return dataclasses.replace(inf.load_spec(ctx, opts, embedding=True), rerank=True)
    return inf.load_spec(ctx, opts, embedding="embedding" in ctx.capabilities and "completion" not in ctx.capabilities)


async def _body(request: Request) -> dict[str, Any]:
    body = await read_body(request)
    if not isinstance(body, dict):
        raise InvalidRequest(f"request body must be a JSON object, got {type(body).__name__}")
    return body


@router.post("/api/tokenize")
async def tokenize(request: Request) -> dict[str, Any]:
    body = await _body(request)
    model = get(body, "model", "str", required=True)
    content = get(body, "content", "str")
    if content is None:
        content = get(body, "prompt", "str") or ""  # Ollama's old /api/tokenize named it prompt
    add_special = bool(get(body, "add_special", "bool") or False)  # llama-server's default: false
    with_pieces = bool(get(body, "with_pieces", "bool") or False)
    inf = inference(request)
    ctx = await inf.lookup(model)
    spec = await _spec_for(inf, ctx, body)
    async with await inf.acquire(ctx, spec, keep_alive_value(body.get("keep_alive"))) as lease:
        tokens = await lease.call(lambda runner: runner.tokenize(content, add_special=add_special))
        if not with_pieces:
            return {"tokens": tokens}
        pieces = await lease.runner.token_pieces(tokens)
    return {"tokens": [{"id": t, "piece": p} for t, p in zip(tokens, pieces, strict=True)]}


@router.post("/api/detokenize")
async def detokenize(request: Request) -> dict[str, Any]:
    body = await _body(request)
    model = get(body, "model", "str", required=True)
    tokens = body.get("tokens")
    if tokens is None:
        tokens = []
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise BadParam("tokens", '"tokens" must be an array of integer token ids')
    inf = inference(request)
    ctx = await inf.lookup(model)
    spec = await _spec_for(inf, ctx, body)
    async with await inf.acquire(ctx, spec, keep_alive_value(body.get("keep_alive"))) as lease:
        n_vocab = lease.runner.info().get("n_vocab")
        if not isinstance(n_vocab, int) or n_vocab <= 0:
            raise InvalidRequest("this model's vocabulary size is unknown; cannot check the token ids")
        for i, t in enumerate(tokens):
            if not 0 <= t < n_vocab:
                raise InvalidRequest(
                    f"invalid token id {t} (tokens[{i}]): this model's vocabulary has ids 0 to {n_vocab - 1}"
                )
        content = await lease.call(lambda runner: runner.detokenize(list(tokens))) if tokens else ""
    return {"content": content}
