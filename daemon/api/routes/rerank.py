"""``POST /api/rerank`` and ``/v1/rerank`` (llama-server's and Jina/Cohere's shape), ``POST /api/tokenize`` and
``/api/detokenize`` (llama-server's shapes): the wire shapes only; :mod:`daemon.generation.tokens` does the work.
"""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse

from daemon.api.bodies import read_body
from daemon.api.compat import BadParam, get, openai_error, read_json, shaped
from daemon.api.state import inference
from daemon.generation import tokens as service
from daemon.generation.tokens import RerankCall
from errors import InvalidRequest

router = APIRouter()


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


def _options(body: dict[str, Any]) -> dict[str, Any]:
    return get(body, "options", "dict") or {}


async def run_rerank(request: Request, body: dict[str, Any], started: float) -> dict[str, Any]:
    call = RerankCall(
        model=get(body, "model", "str", required=True),
        query=get(body, "query", "str", required=True),
        documents=tuple(_documents(body)),
        top_n=get(body, "top_n", "int", lo=0),
        truncate=get(body, "truncate", "bool") is not False,
        options=_options(body),
        keep_alive=body.get("keep_alive"),
    )
    return_documents = bool(get(body, "return_documents", "bool") or False)
    ranked = await service.rerank(inference(request), call, started)
    results = []
    for i in ranked.order:
        item: dict[str, Any] = {"index": i, "relevance_score": ranked.scores[i]}
        if return_documents:
            item["document"] = {"text": call.documents[i]}
        results.append(item)
    return {
        "model": call.model,
        "object": "list",
        "results": results,
        "usage": {"prompt_tokens": ranked.prompt_tokens, "total_tokens": ranked.prompt_tokens},
        "total_duration": int(ranked.total_duration * 1e9),
        "load_duration": int(ranked.load_duration * 1e9),
    }


@router.post("/api/rerank")
async def rerank(request: Request) -> dict[str, Any]:
    started = time.monotonic()
    return await run_rerank(request, await _body(request), started)


@router.post("/v1/rerank")
@shaped(openai_error)
async def rerank_v1(request: Request) -> Response:
    started = time.monotonic()
    result = await run_rerank(request, await read_json(request), started)
    for key in ("total_duration", "load_duration"):
        result.pop(key)
    return JSONResponse(result)


# -- tokenize / detokenize -------------------------------------------------------------------------------------------
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
    ids, pieces = await service.tokenize(
        inference(request),
        model,
        content,
        add_special=add_special,
        with_pieces=with_pieces,
        options=_options(body),
        keep_alive=body.get("keep_alive"),
    )
    if pieces is None:
        return {"tokens": ids}
    return {"tokens": [{"id": t, "piece": p} for t, p in zip(ids, pieces, strict=True)]}


@router.post("/api/detokenize")
async def detokenize(request: Request) -> dict[str, Any]:
    body = await _body(request)
    model = get(body, "model", "str", required=True)
    tokens = body.get("tokens")
    if tokens is None:
        tokens = []
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise BadParam("tokens", '"tokens" must be an array of integer token ids')
    content = await service.detokenize(
        inference(request), model, tokens, options=_options(body), keep_alive=body.get("keep_alive")
    )
    return {"content": content}
