"""``/`` and ``/api/version``."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse

from daemon.version import VERSION

router = APIRouter()


@router.api_route("/", methods=["GET", "HEAD"], response_class=PlainTextResponse)
def root() -> str:
    return "corral is running"


@router.api_route("/api/version", methods=["GET", "HEAD"])
def version() -> dict[str, str]:
    return {"version": VERSION}
