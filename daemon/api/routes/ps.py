"""``GET /api/ps`` (loaded models) and ``GET /api/info`` (hardware and budgets)."""

from __future__ import annotations

import asyncio
from datetime import datetime
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request

from daemon.runners import kvstore
from daemon.runners.base import KVDiskInfo, Runner
from daemon.scheduling.scheduler import HeldAdapter
from daemon.settings import Settings
from errors import CorralError

router = APIRouter()


def _rfc3339_wall(ts: float) -> str:
    ts = min(ts, 253402300799.0)  # datetime's limit (year 9999)
    dt = datetime.fromtimestamp(ts).astimezone()
    offset = dt.strftime("%z")
    zone = "Z" if offset in ("+0000", "-0000") else f"{offset[:3]}:{offset[3:]}"
    return dt.strftime("%Y-%m-%dT%H:%M:%S.") + f"{dt.microsecond:06d}000" + zone


async def _slots(runner: Runner) -> list[dict[str, Any]] | None:
    if not runner.alive():
        return None
    try:
        slots = await asyncio.wait_for(runner.slots(), 2.0)
    except (TimeoutError, CorralError):
        return None
    return [{"id": s.id, "busy": s.busy, "cached_tokens": s.cached_tokens} for s in slots]


def adapters_json(adapters: dict[str, HeldAdapter]) -> list[dict[str, Any]]:
    """A runner's loaded LoRA adapters for /api/ps, in the order they were loaded: each one's blob digest, bytes
    counted, and the models that applied it (``model``: the last one; ``models``: all, last used first)."""
    out = []
    for held in adapters.values():
        models = sorted(held.models, key=lambda n: -held.models[n])
        out.append(
            {
                "model": models[0] if models else "",
                "models": models,
                "digest": held.adapter.digest,
                "size": held.adapter.memory.total,
                "size_vram": held.adapter.memory.vram,
            }
        )
    return out


def kv_disk_json(kv: KVDiskInfo | None) -> dict[str, Any] | None:
    """A runner's prompt cache on disk for /api/ps: its blocks and bytes of this model, how many lookups found a
    stored prefix (``hit_rate`` of ``hits + misses``) and the tokens restored instead of evaluated; or why this
    model keeps none. None when the daemon gave the runner no cache (CORRAL_KV_DISK=0, an embedding model)."""
    if kv is None or (not kv.enabled and not kv.reason):
        return None
    if not kv.enabled:
        return {"enabled": False, "reason": kv.reason}
    lookups = kv.hits + kv.misses
    return {
        "enabled": True,
        "entries": kv.entries,
        "bytes": kv.bytes,
        "hits": kv.hits,
        "misses": kv.misses,
        "hit_rate": round(kv.hits / lookups, 4) if lookups else 0.0,
        "restored_tokens": kv.restored_tokens,
    }


@router.get("/api/ps")
async def ps(request: Request) -> dict[str, Any]:
    models = []
    for item in request.app.state.scheduler.loaded():
        e = item["entry"]
        slots = None if e.loading else await _slots(e.runner)
        kv_disk = None if slots is None else kv_disk_json(e.runner.kv_disk)
        models.append(
            {
                "name": e.ref.name,
                "model": e.ref.name,
                "size": e.memory.total,
                "digest": e.ref.digest,
                "details": e.ref.details,
                "expires_at": _rfc3339_wall(item["expires_at_wall"]),
                "size_vram": e.memory.vram,
                "context_length": e.spec.num_ctx,
                "kv_cache_type": e.spec.kv_cache_type,
                "flash_attention": e.spec.flash_attn,  # corral: as loaded
                "num_parallel": e.spec.num_parallel,  # corral: sequence slots batched together in this runner
                "names": sorted(e.names, key=lambda n: -e.names[n]),  # corral: every name this runner serves
                # corral: the LoRA adapters this runner has loaded (issue 29; their memory is in size/size_vram)
                **({"adapters": adapters_json(e.adapters)} if e.adapters else {}),
                # corral: the draft model loaded beside it (speculative decoding; its memory is in size/size_vram)
                **({"draft_model": e.ref.draft or Path(e.spec.draft_path).name} if e.spec.draft_path else {}),
                **({"fallback": e.fallback} if e.fallback else {}),  # corral: the safer configuration in force, and why
                **({"slots": slots} if slots is not None else {}),  # corral: busy, and cached tokens for reuse
                **({"kv_disk": kv_disk} if kv_disk is not None else {}),  # corral: the prompt cache on disk
                # corral: the llama.cpp RPC servers this load offloads to, the bytes each holds, those left out
                **({"rpc": rpc.to_json()} if (rpc := getattr(e.runner, "rpc", None)) is not None else {}),
            }
        )
    return {"models": models}


def kv_disk_info(settings: Settings) -> dict[str, Any]:
    """The prompt cache on disk: where (``CORRAL_KV_DISK_DIR``), its bound (``CORRAL_KV_DISK``) and the bytes it
    holds now, every model's."""
    root = getattr(settings, "kv_disk_dir", None)
    limit = int(getattr(settings, "kv_disk", 0) or 0)
    return {
        "enabled": root is not None and limit > 0,
        "dir": None if root is None else str(root),
        "limit_bytes": limit,
        "bytes": 0 if root is None else kvstore.usage(root),
    }


@router.get("/api/info")
def info(request: Request) -> dict[str, Any]:
    """The hardware (llama.cpp's backends and devices, the CPU's instruction sets, the GPUs it can offload to),
    the budgets, and the CORRAL_* settings in force that shape loading."""
    state = request.app.state
    fallbacks = state.scheduler.fallbacks

    def plain(value: Any) -> Any:
        if isinstance(value, float) and value in (float("inf"), float("-inf")):
            return -1  # keep_alive "forever", as Ollama's negative durations
        return value if value is None or isinstance(value, (str, int, float, bool)) else str(value)

    # getattr: fields Settings may or may not have in this version
    names = (
        "ram_budget",
        "vram_budget",
        "num_parallel",
        "max_loaded_models",
        "keep_alive",
        "context_length",
        "flash_attention",
        "kv_cache_type",
        "kv_disk",
        "kv_disk_dir",
    )
    in_force = {n: plain(getattr(state.settings, n)) for n in names if hasattr(state.settings, n)}
    if getattr(state.inference, "default_num_ctx", None) is not None:
        in_force["default_num_ctx"] = state.inference.default_num_ctx  # what context_length 0 (automatic) chose
    return {
        "instance": state.settings.instance,  # CORRAL_INSTANCE: which replica answered (issue 30)
        "hardware": state.hardware.to_json(),
        "budgets": state.budgets_json(),
        "settings": in_force,
        "kv_disk": kv_disk_info(state.settings),
        # corral: the safer runner configurations chosen after native crashes on this machine
        # (daemon/scheduling/fallback.py)
        "runner_fallbacks": fallbacks.remembered() if fallbacks is not None else [],
        # corral: llama.cpp RPC servers (CORRAL_RPC_SERVERS) as they answered at startup, and their budget
        **({"rpc": state.rpc.to_json()} if getattr(state, "rpc", None) is not None and state.rpc.endpoints else {}),
    }
