"""``corral ps`` (loaded models), ``corral stop MODEL`` (unload now) and ``corral info`` (hardware, budgets)."""

from __future__ import annotations

import json
from datetime import datetime, timezone
from typing import Annotated, Any

import typer

from cli import output
from cli.commands.common import client_from_env
from registry.errors import ModelNotFound, NotFound

HEADER = ("NAME", "ID", "SIZE", "PROCESSOR", "CONTEXT", "UNTIL")


def processor(size: int, size_vram: int) -> str:
    """``100% GPU``, ``100% CPU`` or ``48%/52% CPU/GPU``, as Ollama's ps."""
    if size_vram <= 0 or size <= 0:
        return "100% CPU"
    if size_vram >= size:
        return "100% GPU"
    gpu = round(size_vram / size * 100)
    return f"{100 - gpu}%/{gpu}% CPU/GPU"


def until(expires_at: str, now: datetime | None = None) -> str:
    when = output.parse_time(expires_at)
    now = now or datetime.now(timezone.utc)
    if when is None:
        return "Unknown"
    if when < now:
        return "Stopping..."
    return output.format_ago(when, now)


def rows(models: list[dict[str, Any]], prefix: str | None = None, now: datetime | None = None) -> list[tuple[str, ...]]:
    out = []
    for m in models:
        name = str(m.get("name") or m.get("model") or "")
        if prefix and not name.lower().startswith(prefix.lower()):
            continue
        size, vram = int(m.get("size") or 0), int(m.get("size_vram") or 0)
        digest = str(m.get("digest") or "").removeprefix("sha256:")
        out.append((name, digest[:12], output.format_size(size), processor(size, vram),
                    str(m.get("context_length") or ""), until(str(m.get("expires_at") or ""), now)))
    return out


def ps(
    prefix: Annotated[str | None, typer.Argument(metavar="PREFIX", help="Show only models whose name starts with this.")] = None,
) -> None:
    """List the models loaded now."""
    with client_from_env() as client:
        models = client.request("GET", "/api/ps").json().get("models") or []
    for line in output.table([HEADER, *rows(models, prefix)]):
        output.out(line)


def stop(model: Annotated[str, typer.Argument(metavar="MODEL", help="Model to unload.")]) -> None:
    """Unload a model now (its runner process ends and its memory comes back)."""
    with client_from_env() as client:
        try:
            client.unload(model)
        except (ModelNotFound, NotFound):
            raise ModelNotFound(model, f'couldn\'t find model "{model}" to stop') from None


def info(as_json: Annotated[bool, typer.Option("--json", help="Print the daemon's JSON as is.")] = False) -> None:
    """Show the hardware the daemon found and the memory budgets in force."""
    with client_from_env() as client:
        data = client.request("GET", "/api/info").json()
    if as_json:
        output.out(json.dumps(data, indent=2))
        return
    for line in info_lines(data):
        output.out(line)


def info_lines(data: dict[str, Any]) -> list[str]:
    hw, budgets = data.get("hardware") or {}, data.get("budgets") or {}
    rows: list[list[str]] = [
        ["CPU", f"{hw.get('physical_cores', '?')} physical cores, {hw.get('logical_cores', '?')} logical"],
        ["RAM", f"{output.format_size(int(hw.get('total_ram') or 0))} total, "
                f"{output.format_size(int(hw.get('available_ram') or 0))} available"],
    ]
    for g in hw.get("gpus") or []:
        rows.append([f"GPU {g.get('index')}", f"{g.get('name')} (compute {g.get('compute_capability') or '?'}), "
                     f"{output.format_size(int(g.get('total_vram') or 0))} total, "
                     f"{output.format_size(int(g.get('free_vram') or 0))} free, driver {g.get('driver')}"])
    offload = "yes" if hw.get("gpu_offload") else f"no ({hw.get('gpu_reason') or 'no GPU'})"
    rows.append(["GPU offload", offload])
    rows.append(["RAM budget", output.format_size(int(budgets.get("ram") or 0))])
    rows.append(["VRAM budget", output.format_size(int(budgets.get("vram") or 0))])
    max_loaded = budgets.get("max_loaded_models")
    rows.append(["Max loaded models", str(max_loaded) if max_loaded else "no limit (memory decides)"])
    return output.table(rows)
