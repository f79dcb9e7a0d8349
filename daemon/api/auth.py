"""API keys: with ``CORRAL_API_KEY`` set, every endpoint but ``/``, ``/api/version``, ``/health``, ``/health/ready``
and the web page's files (``/ui``) needs
``Authorization: Bearer <key>`` or ``x-api-key: <key>``. Keys are compared in constant time and never logged.
A wrong or missing key gets 401 in the shape of the API that was called."""

from __future__ import annotations

import hmac
import json
from typing import Any

from daemon.api.security import ASGIApp, Receive, Scope, Send

OPEN_PATHS = frozenset({"/", "/api/version", "/health", "/health/ready"})  # liveness and readiness probes


def open_path(path: str) -> bool:
    """``/``, ``/api/version``, ``/health`` and the web page's own files (``/ui``, ``/ui/<asset>``: the page asks
    for the key and sends it with the API calls it makes)."""
    return path in OPEN_PATHS or path == "/ui" or path.startswith("/ui/")


def presented_key(headers: dict[str, str]) -> str | None:
    auth = headers.get("authorization", "")
    if auth[:7].lower() == "bearer ":
        return auth[7:].strip()
    key = headers.get("x-api-key")
    return key.strip() if key else None


def unauthorized_body(path: str, missing: bool) -> dict[str, Any]:
    message = (
        'an API key is required: send "Authorization: Bearer <key>" or "x-api-key: <key>"'
        if missing
        else "invalid API key"
    )
    if path.startswith("/v1/messages"):  # Anthropic's words for a wrong key, which clients match on
        message = message if missing else "invalid x-api-key: the key does not match the daemon's CORRAL_API_KEY"
        return {"type": "error", "error": {"type": "authentication_error", "message": message}}
    if path.startswith("/v1/"):
        return {
            "error": {"message": message, "type": "invalid_request_error", "param": None, "code": "invalid_api_key"}
        }
    return {"error": message}


class APIKeyGate:
    def __init__(self, app: ASGIApp, *, key: str) -> None:
        self.app = app
        self.key = key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or open_path(scope["path"]) or scope["method"] == "OPTIONS":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        given = presented_key(headers)
        if given is not None and hmac.compare_digest(given.encode(), self.key):
            await self.app(scope, receive, send)
            return
        body = json.dumps(unauthorized_body(scope["path"], given is None)).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 401,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"www-authenticate", b'Bearer realm="corral"'),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})
