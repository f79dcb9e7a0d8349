"""``POST /api/create``."""

from __future__ import annotations

import threading
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

from fastapi import APIRouter, Request, Response
from starlette.concurrency import run_in_threadpool

from daemon.api.bodies import read_model
from daemon.api.schemas import CreateRequest
from daemon.api.streaming import progress_response
from daemon.logs import note
from daemon.models.create import Creator

router = APIRouter()


@router.post("/api/create")
async def create(request: Request) -> Response:
    req = await read_model(request, CreateRequest)
    note(model=req.model_name)
    inference = request.app.state.inference
    replaced = await run_in_threadpool(inference.adapter_blobs, req.model_name)  # a model replaced: its adapters
    creator = Creator(request.app.state.catalog, prune=not request.app.state.settings.noprune)
    it = _Closing(await run_in_threadpool(creator.run, req), creator)
    done = _CloseAfter(await progress_response(it, stream=req.stream), it)
    if replaced:  # once written, the adapters the new model does not use (nor any other) are freed (issue 29)
        done.after = lambda: inference.drop_adapters(replaced)
    return done


class _Closing:
    """The create's progress iterator, closed once its response is over, even when the client left mid-way (the
    stream then stops pulling it): closing kills a running quantize worker and removes its temp file."""

    def __init__(self, it: Iterator[dict[str, Any]], creator: Creator) -> None:
        self._it = it
        self._creator = creator
        self._lock = threading.Lock()
        self._closed = False

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return self

    def __next__(self) -> dict[str, Any]:
        with self._lock:
            if self._closed:
                raise StopIteration
            return next(self._it)

    def close(self) -> None:
        self._creator.cancel()  # an in-flight next() then ends at once
        with self._lock:
            self._closed = True
            close = getattr(self._it, "close", None)
            if close is not None:
                close()


class _CloseAfter(Response):
    """Serves ``inner``, then closes ``it`` in a thread (also when the request is cancelled)."""

    def __init__(self, inner: Response, it: _Closing) -> None:  # a wrapper: no super().__init__()
        self.inner = inner
        self.it = it
        self.status_code = inner.status_code
        self.after: Callable[[], Awaitable[Any]] | None = None  # run once the response is over

    @property
    def headers(self) -> Any:
        return self.inner.headers

    @property
    def background(self) -> Any:
        return self.inner.background

    @background.setter
    def background(self, value: Any) -> None:
        self.inner.background = value

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await self.inner(scope, receive, send)
        finally:
            threading.Thread(target=self.it.close, name="create-close", daemon=True).start()
            if self.after is not None:
                await self.after()
