"""``/`` and ``/api/version``."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse

from daemon.version import OLLAMA_COMPAT_VERSION, VERSION

router = APIRouter()


@router.api_route("/", methods=["GET", "HEAD"], response_class=PlainTextResponse)
def root() -> str:
    return "corral is running"


@router.api_route("/api/version", methods=["GET", "HEAD"])
def version() -> dict[str, str]:
    """``version`` is the Ollama release whose API corral implements: apps that check the server (VS Code's
    Copilot wants Ollama 0.6.4 or newer) compare it with what they need. corral's own version is
    ``corral_version``."""
    return {"version": OLLAMA_COMPAT_VERSION, "corral_version": VERSION}
