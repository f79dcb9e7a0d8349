"""``GET /api/ps`` (loaded models) and ``GET /api/info`` (hardware and budgets)."""

from __future__ import annotations

import asyncio
from datetime import datetime
from typing import Any

from fastapi import APIRouter, Request

from registry.errors import CorralError

router = APIRouter()


def _rfc3339_wall(ts: float) -> str:
    ts = min(ts, 253402300799.0)  # datetime's limit (year 9999)
    dt = datetime.fromtimestamp(ts).astimezone()
    offset = dt.strftime("%z")
    zone = "Z" if offset in ("+0000", "-0000") else f"{offset[:3]}:{offset[3:]}"
    return dt.strftime("%Y-%m-%dT%H:%M:%S.") + f"{dt.microsecond:06d}000" + zone


async def _slots(runner: Any) -> list[dict[str, Any]] | None:
    ask = getattr(runner, "slots", None)
    if ask is None or not runner.alive():
        return None
    try:
        return list(await asyncio.wait_for(ask(), 2.0))
    except (asyncio.TimeoutError, CorralError):
        return None


@router.get("/api/ps")
async def ps(request: Request) -> dict[str, Any]:
    models = []
    for item in request.app.state.scheduler.loaded():
        e = item["entry"]
        slots = None if e.loading else await _slots(e.runner)
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
            **({"slots": slots} if slots is not None else {}),  # corral: busy, and cached tokens for reuse
        })
    return {"models": models}


@router.get("/api/info")
def info(request: Request) -> dict[str, Any]:
    state = request.app.state
    return {"hardware": state.hardware.to_json(), "budgets": state.budgets_json}
