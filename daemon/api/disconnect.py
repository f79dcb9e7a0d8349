"""Cancel a request's work when its client goes away, whatever kind of request it is (pure ASGI middleware).

A streamed response notices a disconnect when it next writes; a request that answers once, at the end (a
non-streaming generate or chat, an embedding), would otherwise go on generating for nobody, holding a runner slot
that a waiting client could use. Once the app has read the whole request body, this middleware keeps listening on
the connection; a disconnect cancels the handler, which closes its generation (the runner cancels the sequence at
its next step) and releases its lease.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from daemon.api.security import ASGIApp, Receive, Scope, Send

log = logging.getLogger(__name__)


class CancelOnDisconnect:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        inbox: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        body_read = asyncio.Event()  # from then on the connection is watched (before, the app reads it itself)
        gone = asyncio.Event()

        async def app_receive() -> dict[str, Any]:
            if not body_read.is_set():
                message = await receive()
                if message["type"] != "http.request" or not message.get("more_body", False):
                    body_read.set()
                return message
            return await inbox.get()

        async def watch() -> None:
            await body_read.wait()
            while True:
                message = await receive()
                await inbox.put(message)
                if message["type"] == "http.disconnect":
                    gone.set()
                    return

        app_task = asyncio.ensure_future(self.app(scope, app_receive, send))
        watcher = asyncio.ensure_future(watch())
        gone_wait = asyncio.ensure_future(gone.wait())
        try:
            await asyncio.wait({app_task, gone_wait}, return_when=asyncio.FIRST_COMPLETED)
            if not app_task.done():
                # the client left before the answer was complete: a streaming response sees the disconnect in its
                # inbox and ends by itself; anything else is cancelled now
                with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
                    await asyncio.wait_for(asyncio.shield(app_task), 0.05)
                if not app_task.done():
                    app_task.cancel()
                    log.info("client disconnected; request cancelled path=%s", scope.get("path", ""))
                try:
                    await app_task
                except asyncio.CancelledError:
                    pass
                except Exception as exc:  # noqa: BLE001 - nobody is left to answer
                    log.debug("request failed after its client left: %s", exc)
                return
            await app_task  # its result or its exception
        finally:
            for task in (watcher, gone_wait):
                task.cancel()
            if not app_task.done():  # this request itself was cancelled (shutdown)
                app_task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await app_task
