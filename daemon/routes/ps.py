"""``GET /api/ps`` (loaded models) and ``GET /api/info`` (hardware and budgets)."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from fastapi import APIRouter, Request

router = APIRouter()


def _rfc3339_wall(ts: float) -> str:
    ts = min(ts, 253402300799.0)  # datetime's limit (year 9999)
    dt = datetime.fromtimestamp(ts).astimezone()
    offset = dt.strftime("%z")
    zone = "Z" if offset in ("+0000", "-0000") else f"{offset[:3]}:{offset[3:]}"
    return dt.strftime("%Y-%m-%dT%H:%M:%S.") + f"{dt.microsecond:06d}000" + zone


@router.get("/api/ps")
def ps(request: Request) -> dict[str, Any]:
    models = []
    for item in request.app.state.scheduler.loaded():
        e = item["entry"]
        models.append({
            "name": e.ref.name,
            "model": e.ref.name,
            "size": e.memory.total,
            "digest": e.ref.digest,
            "details": e.ref.details,
            "expires_at": _rfc3339_wall(item["expires_at_wall"]),
            "size_vram": e.memory.vram,
            "context_length": e.spec.num_ctx,
            "num_parallel": e.spec.num_parallel,  # corral: sequence slots batched together in this runner
        })
    return {"models": models}


@router.get("/api/info")
def info(request: Request) -> dict[str, Any]:
    state = request.app.state
    return {"hardware": state.hardware.to_json(), "budgets": state.budgets_json}
