"""``HEAD/POST /api/blobs/:digest``: content-addressed uploads, verified before they become visible."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from starlette.concurrency import run_in_threadpool

from errors import BlobNotFound
from registry.digest import Digest
from registry.store import Store

router = APIRouter()


def store(request: Request) -> Store:
    return request.app.state.store


@router.head("/api/blobs/{digest}")
def head_blob(digest: str, request: Request) -> Response:
    d = Digest.parse_param(digest)
    if not store(request).has_blob(d):
        raise BlobNotFound(digest)
    return Response(status_code=200)


@router.post("/api/blobs/{digest}")
async def post_blob(digest: str, request: Request) -> Response:
    d = Digest.parse_param(digest)
    s = store(request)
    if s.has_blob(d):
        return Response(status_code=200)
    writer = await run_in_threadpool(s.writer)
    try:
        async for chunk in request.stream():
            if chunk:
                await run_in_threadpool(writer.write, chunk)
        await run_in_threadpool(writer.commit, d, expected_text=digest)
    except BaseException:
        writer.abort()
        raise
    return Response(status_code=201)
