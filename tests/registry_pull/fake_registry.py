"""A small OCI registry as an ASGI app, with switches for the hostile behaviours the puller must survive.

It serves ``/v2/<ns>/<model>/manifests/<tag>``, ``/v2/<ns>/<model>/blobs/<digest>`` (with ``Range``) and the
upload endpoints, counts every request and byte it sends, and can: require a Bearer token (with any realm) or
Basic credentials, redirect blob GETs to another server, throttle, corrupt a blob, ignore ``Range``, fail the
first N blob requests, stall or crawl, and serve any raw manifest with any headers. :class:`ServerThread` runs an
app under uvicorn on an ephemeral 127.0.0.1 port in a thread.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import re
import socket
import threading
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import uvicorn

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]

MANIFEST_TYPE = "application/vnd.docker.distribution.manifest.v2+json"
CONFIG_TYPE = "application/vnd.docker.container.image.v1+json"
MODEL_TYPE = "application/vnd.ollama.image.model"

_PATH = re.compile(r"/v2/([^/]+/[^/]+)/(manifests|blobs)/(.+)")
_UPLOADS = re.compile(r"/v2/([^/]+/[^/]+)/blobs/uploads/(.*)")


def digest_of(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def manifest_for(config: bytes, layers: list[tuple[str, bytes]]) -> bytes:
    doc = {
        "schemaVersion": 2,
        "mediaType": MANIFEST_TYPE,
        "config": {"mediaType": CONFIG_TYPE, "digest": digest_of(config), "size": len(config)},
        "layers": [{"mediaType": media, "digest": digest_of(data), "size": len(data)} for media, data in layers],
    }
    return json.dumps(doc).encode()


@dataclass
class Seen:
    method: str
    path: str
    headers: dict[str, str]
    status: int = 0
    sent: int = 0


@dataclass
class FakeRegistry:
    """State and switches; every attribute may be changed by a test while the server runs."""

    blobs: dict[str, bytes] = field(default_factory=dict)
    manifests: dict[tuple[str, str], tuple[bytes, dict[str, str]]] = field(default_factory=dict)
    uploads: dict[str, bytearray] = field(default_factory=dict)
    seen: list[Seen] = field(default_factory=list)
    # switches
    bearer_token: str | None = None  # require "Authorization: Bearer <token>"
    realm: str | None = None  # the realm to announce (default: our own /token)
    basic: tuple[str, str] | None = None  # (user, password) the token endpoint / Basic auth wants
    token_body: bytes | None = None  # answer token requests with these bytes
    redirect_blobs: str | None = None  # base URL to redirect blob GETs to (…/<digest>)
    redirect_location: str | None = None  # a literal Location for blob GETs
    throttle: float | None = None  # bytes per second per response
    corrupt: set[str] = field(default_factory=set)  # digests whose bytes are served wrong
    ignore_range: bool = False
    fail_blob_gets: int = 0  # answer this many blob GETs with 500 first
    stall_blob_gets: int = 0  # this many blob GETs send half their bytes and then go silent
    stall_seconds: float = 5.0
    slow_blob_gets: int = 0  # this many GETs of slow_digest crawl at slow_rate bytes/s
    slow_digest: str = ""
    slow_rate: float = 20_000.0
    error_body: bytes | None = None  # serve this as the body of 500s
    fail_patches: int = 0  # answer this many upload PATCHes with 503 (dropping their bytes)
    # answer blob GETs with whatever this returns for (data, Range header): (status, headers, body); without a
    # content-length header the body goes out chunked, so its length can be anything; None: serve normally
    blob_reply: Callable[[bytes, str | None], tuple[int, dict[str, str], bytes] | None] | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)

    # -- helpers for tests -----------------------------------------------------------------------------------
    def add_model(
        self,
        repo: str,
        tag: str,
        layers: list[tuple[str, bytes]],
        config: bytes = b'{"model_format":"gguf"}',
        raw: bytes | None = None,
        headers: dict[str, str] | None = None,
    ) -> bytes:
        for _media, data in layers:
            self.blobs[digest_of(data)] = data
        self.blobs[digest_of(config)] = config
        manifest = raw if raw is not None else manifest_for(config, layers)
        self.manifests[(repo, tag)] = (manifest, {"content-type": MANIFEST_TYPE, **(headers or {})})
        return manifest

    def blob_bytes_sent(self) -> int:
        return sum(s.sent for s in self.seen if "/blobs/sha256:" in s.path and s.method == "GET")

    def requests(self, method: str | None = None, contains: str = "") -> list[Seen]:
        return [s for s in self.seen if (method is None or s.method == method) and contains in s.path]

    # -- ASGI --------------------------------------------------------------------------------------------------
    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        headers = {k.decode().lower(): v.decode() for k, v in scope["headers"]}
        path = scope["path"]
        query = scope.get("query_string", b"").decode()
        record = Seen(scope["method"], path + ("?" + query if query else ""), headers)
        with self.lock:
            self.seen.append(record)
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        await self.handle(record, scope["method"], path, query, headers, body, send)

    async def respond(
        self,
        record: Seen,
        send: Send,
        status: int,
        body: bytes = b"",
        headers: dict[str, str] | None = None,
        *,
        length: int | None = None,
    ) -> None:
        record.status = status
        h = {"content-length": str(len(body) if length is None else length), **(headers or {})}
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [(k.encode(), v.encode()) for k, v in h.items()],
            }
        )
        await send({"type": "http.response.body", "body": body})
        record.sent += len(body)

    def authorized(self, headers: dict[str, str]) -> bool:
        if self.bearer_token is None and self.basic is None:
            return True
        auth = headers.get("authorization", "")
        if self.bearer_token is not None:
            return auth == f"Bearer {self.bearer_token}"
        assert self.basic is not None
        expected = base64.b64encode(f"{self.basic[0]}:{self.basic[1]}".encode()).decode()
        return auth == f"Basic {expected}"

    async def handle(
        self, record: Seen, method: str, path: str, query: str, headers: dict[str, str], body: bytes, send: Send
    ) -> None:
        if path == "/token":
            return await self.token(record, headers, send)
        if not self.authorized(headers):
            host = headers.get("host", "")
            if self.bearer_token is not None:
                realm = self.realm or f"http://{host}/token"
                challenge = f'Bearer realm="{realm}",service="fake",scope="repository:x:pull"'
            else:
                challenge = 'Basic realm="fake"'
            return await self.respond(
                record, send, 401, b'{"errors":[{"code":"UNAUTHORIZED"}]}', {"www-authenticate": challenge}
            )
        if path == "/v2/":
            return await self.respond(record, send, 200, b"{}")
        if m := _UPLOADS.fullmatch(path):
            return await self.upload(record, method, m.group(2), query, body, send)
        m = _PATH.fullmatch(path)
        if not m:
            return await self.respond(record, send, 404)
        repo, kind, ref = m.groups()
        if kind == "manifests":
            return await self.manifest(record, method, repo, ref, headers, body, send)
        return await self.blob(record, method, ref, headers, send)

    async def token(self, record: Seen, headers: dict[str, str], send: Send) -> None:
        if self.basic is not None:
            expected = base64.b64encode(f"{self.basic[0]}:{self.basic[1]}".encode()).decode()
            if headers.get("authorization") != f"Basic {expected}":
                return await self.respond(record, send, 401, b"{}")
        body = self.token_body if self.token_body is not None else json.dumps({"token": self.bearer_token}).encode()
        await self.respond(record, send, 200, body, {"content-type": "application/json"})

    async def manifest(
        self, record: Seen, method: str, repo: str, tag: str, headers: dict[str, str], body: bytes, send: Send
    ) -> None:
        if method == "PUT":
            self.manifests[(repo, tag)] = (body, {"content-type": headers.get("content-type", MANIFEST_TYPE)})
            return await self.respond(record, send, 201, b"", {"docker-content-digest": digest_of(body)})
        entry = self.manifests.get((repo, tag))
        if entry is None:
            return await self.respond(record, send, 404, b'{"errors":[{"code":"MANIFEST_UNKNOWN"}]}')
        raw, extra = entry
        length = extra.get("content-length")
        await self.respond(
            record,
            send,
            200,
            raw if method == "GET" else b"",
            {k: v for k, v in extra.items() if k != "content-length"},
            length=int(length) if length else len(raw),
        )

    async def blob(self, record: Seen, method: str, digest: str, headers: dict[str, str], send: Send) -> None:
        data = self.blobs.get(digest)
        if data is None:
            return await self.respond(record, send, 404, b'{"errors":[{"code":"BLOB_UNKNOWN"}]}')
        if method == "HEAD":
            return await self.respond(record, send, 200, b"", length=len(data))
        if self.redirect_location is not None:
            return await self.respond(record, send, 307, b"", {"location": self.redirect_location})
        if self.redirect_blobs is not None:
            return await self.respond(record, send, 307, b"", {"location": f"{self.redirect_blobs}/{digest}"})
        with self.lock:
            fail = self.fail_blob_gets > 0
            if fail:
                self.fail_blob_gets -= 1
            stall = not fail and self.stall_blob_gets > 0
            if stall:
                self.stall_blob_gets -= 1
            slow = not fail and not stall and self.slow_blob_gets > 0 and digest == self.slow_digest
            if slow:
                self.slow_blob_gets -= 1
        if fail:
            return await self.respond(record, send, 500, self.error_body or b'{"errors":[{"code":"FLAKY"}]}')
        if digest in self.corrupt:
            data = bytes([data[0] ^ 0xFF]) + data[1:] if data else b"x"
        reply = self.blob_reply(data, headers.get("range")) if self.blob_reply is not None else None
        if reply is not None:
            return await send_raw(record, send, *reply)
        await serve_bytes(
            record,
            send,
            data,
            headers.get("range"),
            ignore_range=self.ignore_range,
            throttle=self.slow_rate if slow else self.throttle,
            stall=self.stall_seconds if stall else 0.0,
        )

    async def upload(self, record: Seen, method: str, upload_id: str, query: str, body: bytes, send: Send) -> None:
        if method == "POST":
            new = uuid.uuid4().hex
            self.uploads[new] = bytearray()
            return await self.respond(record, send, 202, b"", {"location": f"/v2/x/y/blobs/uploads/{new}"})
        buf = self.uploads.get(upload_id)
        if buf is None:
            return await self.respond(record, send, 404)
        if method == "GET":
            return await self.respond(record, send, 204, b"", {"range": f"0-{len(buf) - 1}"})
        if method == "PATCH":
            with self.lock:
                fail = self.fail_patches > 0
                if fail:
                    self.fail_patches -= 1
            if fail:
                return await self.respond(record, send, 503, b'{"errors":[{"code":"UNAVAILABLE"}]}')
            buf += body
            return await self.respond(
                record, send, 202, b"", {"location": f"/v2/x/y/blobs/uploads/{upload_id}", "range": f"0-{len(buf) - 1}"}
            )
        if method == "PUT":
            buf += body
            digest = dict(p.split("=", 1) for p in query.split("&") if "=" in p).get("digest", "")
            digest = digest.replace("%3A", ":")
            if digest != digest_of(bytes(buf)):
                return await self.respond(record, send, 400, b'{"errors":[{"code":"DIGEST_INVALID"}]}')
            self.blobs[digest] = bytes(buf)
            return await self.respond(record, send, 201)
        await self.respond(record, send, 405)


async def serve_bytes(
    record: Seen,
    send: Send,
    data: bytes,
    range_header: str | None,
    *,
    ignore_range: bool = False,
    throttle: float | None = None,
    stall: float = 0.0,
) -> None:
    """A blob body: the asked range (206) or the whole (200), throttled or stalling if asked."""
    start, end, status = 0, len(data) - 1, 200
    headers = {"content-type": "application/octet-stream", "accept-ranges": "bytes"}
    if range_header and not ignore_range:
        m = re.fullmatch(r"bytes=(\d+)-(\d*)", range_header.strip())
        if m:
            start = int(m.group(1))
            end = min(int(m.group(2)) if m.group(2) else len(data) - 1, len(data) - 1)
            status = 206
            headers["content-range"] = f"bytes {start}-{end}/{len(data)}"
    body = data[start : end + 1]
    headers["content-length"] = str(len(body))
    record.status = status
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(k.encode(), v.encode()) for k, v in headers.items()],
        }
    )
    step = 64 * 1024
    began = time.monotonic()
    for i in range(0, len(body), step):
        if stall and i >= len(body) // 2:
            await asyncio.sleep(stall)
            return  # never finishes: the client must give up on this response
        chunk = body[i : i + step]
        await send({"type": "http.response.body", "body": chunk, "more_body": True})
        record.sent += len(chunk)
        if throttle:
            ahead = record.sent / throttle - (time.monotonic() - began)
            if ahead > 0:
                await asyncio.sleep(ahead)
    await send({"type": "http.response.body", "body": b""})


async def send_raw(record: Seen, send: Send, status: int, headers: dict[str, str], body: bytes) -> None:
    """A response exactly as given (chunked when ``headers`` has no content-length)."""
    record.status = status
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(k.encode(), v.encode()) for k, v in headers.items()],
        }
    )
    await send({"type": "http.response.body", "body": body, "more_body": True})
    record.sent += len(body)
    await send({"type": "http.response.body", "body": b""})


@dataclass
class BlobHost:
    """A plain server for redirect targets: serves any blob it holds at ``/<digest>``, recording headers."""

    blobs: dict[str, bytes] = field(default_factory=dict)
    seen: list[Seen] = field(default_factory=list)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        headers = {k.decode().lower(): v.decode() for k, v in scope["headers"]}
        record = Seen(scope["method"], scope["path"], headers)
        self.seen.append(record)
        data = self.blobs.get(scope["path"].lstrip("/"))
        if data is None:
            record.status = 404
            await send({"type": "http.response.start", "status": 404, "headers": [(b"content-length", b"0")]})
            await send({"type": "http.response.body", "body": b""})
            return
        await serve_bytes(record, send, data, headers.get("range"))


class Holder:
    """An ASGI app that forwards to whichever app it holds now (one server, a fresh fake per test)."""

    def __init__(self, app: Any = None) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.app(scope, receive, send)


class ServerThread:
    """Run an ASGI app with uvicorn on an ephemeral 127.0.0.1 port, in a daemon thread."""

    def __init__(self, app: Any, *, certfile: str | None = None, keyfile: str | None = None) -> None:
        self.app = app
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.port = int(self.sock.getsockname()[1])
        self.host = f"127.0.0.1:{self.port}"
        self.url = f"{'https' if certfile else 'http'}://{self.host}"
        config = uvicorn.Config(
            app,
            log_level="critical",
            lifespan="off",
            access_log=False,
            timeout_graceful_shutdown=1,
            ssl_certfile=certfile,
            ssl_keyfile=keyfile,
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("the fake server did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.sock.close()
