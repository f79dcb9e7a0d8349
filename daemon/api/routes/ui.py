"""The web page: ``GET /ui`` and ``GET /ui/<asset>`` from the files in ``daemon/ui/``, under a strict
Content-Security-Policy (only this origin's scripts, styles and fetches; no inline script; images only from here,
``data:`` and ``blob:``), and ``POST /api/ui/modelfile``, which parses a Modelfile typed into the page with the
CLI's parser (the same ``file:line:column`` errors) and answers the parts of an ``/api/create`` body.

The page is open (like ``/``); the API it calls keeps the daemon's Host/Origin checks and API key. See docs/ui.md.
"""

from __future__ import annotations

import gzip
import hashlib
import threading
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request, Response
from pydantic import StrictStr

from daemon.api.bodies import read_model
from daemon.api.schemas import Wire
from errors import NotFound

router = APIRouter()

CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data: blob:; connect-src 'self'; "
    "font-src 'self'; object-src 'none'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
    ".png": "image/png",
    ".ico": "image/x-icon",
}
HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
    "Cross-Origin-Opener-Policy": "same-origin",
    "Cross-Origin-Resource-Policy": "same-origin",
}

_cache: dict[str, tuple[tuple[int, int], bytes, bytes, str]] = {}
_cache_lock = threading.Lock()

#: The page's files: daemon/ui/ (shipped in the wheel with the daemon package; not a Python package).
UI_DIR = Path(__file__).resolve().parents[2] / "ui"


def asset_names() -> list[str]:
    """The files the page is made of (daemon/ui's files with a known type)."""
    return sorted(p.name for p in UI_DIR.iterdir() if p.is_file() and p.suffix in TYPES)


def _asset(name: str) -> tuple[bytes, bytes, str]:
    """``name``'s bytes, gzipped bytes and ETag; read again only when the file changed (size or mtime)."""
    if name not in asset_names():  # only the page's own files: no path ever reaches the filesystem
        raise NotFound(f"no such file of the web page: {name!r}; the page is at /ui")
    path = UI_DIR / name
    st = path.stat()
    stamp = (st.st_mtime_ns, st.st_size)
    with _cache_lock:
        hit = _cache.get(name)
    if hit is not None and hit[0] == stamp:
        return hit[1], hit[2], hit[3]
    raw = path.read_bytes()
    packed = gzip.compress(raw, 9, mtime=0)
    etag = '"' + hashlib.sha256(raw).hexdigest()[:32] + '"'
    with _cache_lock:
        _cache[name] = (stamp, raw, packed, etag)
    return raw, packed, etag


def _serve(request: Request, name: str) -> Response:
    raw, packed, etag = _asset(name)
    headers = dict(HEADERS)
    headers["ETag"] = etag
    headers["Cache-Control"] = "no-cache"  # revalidated each time: a new daemon version serves its own page
    headers["Vary"] = "Accept-Encoding"
    if request.headers.get("if-none-match") == etag:
        return Response(status_code=304, headers=headers)
    media = TYPES["." + name.rsplit(".", 1)[-1]]
    if "gzip" in request.headers.get("accept-encoding", "").lower():
        headers["Content-Encoding"] = "gzip"
        return Response(packed, media_type=media, headers=headers)
    return Response(raw, media_type=media, headers=headers)


@router.api_route("/ui", methods=["GET", "HEAD"])
def page(request: Request) -> Response:
    return _serve(request, "index.html")


@router.api_route("/ui/", methods=["GET", "HEAD"])
def page_slash(request: Request) -> Response:
    return _serve(request, "index.html")


@router.api_route("/ui/{name}", methods=["GET", "HEAD"])
def asset(request: Request, name: str) -> Response:
    return _serve(request, name)


class ModelfileText(Wire):
    modelfile: StrictStr
    filename: StrictStr = "Modelfile"


@router.post("/api/ui/modelfile")
async def parse_modelfile(request: Request) -> dict[str, Any]:
    """Parse a Modelfile with corral's parser. The answer: ``froms`` and ``adapters`` as written (the page matches
    them with the files dropped beside the Modelfile; a FROM that names no dropped file is a model name), and the
    rest of the ``/api/create`` body. A bad Modelfile is a 400 whose error is ``Modelfile:line:column: ...``."""
    from modelfile import parse

    req = await read_model(request, ModelfileText)
    mf = parse(req.modelfile, filename=req.filename or "Modelfile")
    body = mf.create_fields()
    warnings = [f"parameter {p} is deprecated" for p in mf.deprecated_parameters]
    if mf.drafts:
        warnings.append(
            "DRAFT is not supported by corral and is ignored; name a draft model with PARAMETER draft_model"
        )
    return {"froms": list(mf.froms), "adapters": list(mf.adapters), "body": body, "warnings": warnings}
