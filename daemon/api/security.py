"""Security at the door: DNS-rebinding (Host) guard and the browser Origin allowlist, as pure ASGI middleware."""

from __future__ import annotations

import fnmatch
import ipaddress
import socket
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import psutil

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

DEFAULT_ORIGIN_HOSTS = ("localhost", "127.0.0.1", "0.0.0.0", "[::1]")
DEFAULT_ORIGIN_SCHEMES = ("app://*", "file://*", "tauri://*", "vscode-webview://*", "vscode-file://*")
ALLOWED_HEADERS = (
    "Authorization, Content-Type, User-Agent, Accept, X-Requested-With, OpenAI-Beta, x-api-key, "
    "anthropic-version, x-stainless-lang, x-stainless-package-version, x-stainless-os, x-stainless-arch, "
    "x-stainless-runtime, x-stainless-runtime-version, x-stainless-async, x-stainless-retry-count, "
    "x-stainless-timeout, x-stainless-helper-method, x-stainless-poll-helper, x-stainless-custom-poll-interval"
)
ALLOWED_METHODS = "GET, POST, PUT, PATCH, DELETE, HEAD, OPTIONS"


def default_origins() -> list[str]:
    out = []
    for host in DEFAULT_ORIGIN_HOSTS:
        for scheme in ("http", "https"):
            out += [f"{scheme}://{host}", f"{scheme}://{host}:*"]
    return out + list(DEFAULT_ORIGIN_SCHEMES)


def origin_allowed(origin: str, patterns: Iterable[str]) -> bool:
    return any(p == "*" or fnmatch.fnmatchcase(origin.lower(), p.lower()) for p in patterns)


def _local_addresses() -> set[str]:
    addrs = set()
    try:
        for entries in psutil.net_if_addrs().values():
            for e in entries:
                if e.family in (socket.AF_INET, socket.AF_INET6):
                    addrs.add(e.address.split("%")[0])
    except (OSError, RuntimeError):
        pass
    return addrs


def _strip_port(host: str) -> str:
    host = host.strip()
    if host.startswith("["):
        end = host.find("]")
        return host[1:end] if end > 0 else host
    if host.count(":") == 1:
        return host.split(":")[0]
    return host


class DoorGuard:
    """Reject requests whose Host is not local (when bound to loopback) or whose Origin is not allowed."""

    def __init__(self, app: ASGIApp, *, loopback: bool, origins: Iterable[str]) -> None:
        self.app = app
        self.loopback = loopback
        self.origins = default_origins() + list(origins)
        self.hostname = socket.gethostname().lower()
        self.local_addresses = _local_addresses()

    def host_allowed(self, host: str) -> bool:
        h = _strip_port(host).lower().rstrip(".")
        if h in ("", "localhost", self.hostname) or h.endswith((".localhost", ".local", ".internal")):
            return True
        try:
            ip = ipaddress.ip_address(h)
        except ValueError:
            return False
        return ip.is_loopback or ip.is_private or ip.is_unspecified or h in self.local_addresses

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        if self.loopback and not self.host_allowed(headers.get("host", "")):
            await _plain(send, 403, b"")
            return
        origin = headers.get("origin")
        if origin is not None and not origin_allowed(origin, self.origins):
            await _plain(send, 403, b"")
            return
        if origin is not None and scope["method"] == "OPTIONS":
            await _plain(send, 204, b"", _cors(origin))
            return
        if origin is None:
            await self.app(scope, receive, send)
            return

        async def send_with_cors(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                message = dict(message)
                message["headers"] = list(message.get("headers", [])) + _cors(origin)
            await send(message)

        await self.app(scope, receive, send_with_cors)


def _cors(origin: str) -> list[tuple[bytes, bytes]]:
    return [
        (b"access-control-allow-origin", origin.encode("latin-1")),
        (b"access-control-allow-methods", ALLOWED_METHODS.encode()),
        (b"access-control-allow-headers", ALLOWED_HEADERS.encode()),
        (b"vary", b"Origin"),
    ]


async def _plain(send: Send, status: int, body: bytes, extra: list[tuple[bytes, bytes]] | None = None) -> None:
    headers = [(b"content-type", b"text/plain; charset=utf-8"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers + (extra or [])})
    await send({"type": "http.response.body", "body": body})
