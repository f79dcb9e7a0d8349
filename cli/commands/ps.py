"""``corral ps`` (loaded models), ``corral stop MODEL`` (unload now) and ``corral info`` (hardware, budgets)."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any

import typer

from cli import output
from cli.commands.common import client_from_env
from errors import ModelNotFound, NotFound

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
    now = now or datetime.now(UTC)
    if when is None:
        return "Unknown"
    if when < now:
        return "Stopping..."
    return output.format_ago(when, now)


def context(m: dict[str, Any]) -> str:
    """The CONTEXT column: tokens per slot, then the KV cache type when the daemon reports it ("8192 q8_0"), since
    a quantized cache changes both the memory and the output."""
    text = str(m.get("context_length") or "")
    kv = m.get("kv_cache_type")
    return f"{text} {kv}" if text and kv else text


def rows(models: list[dict[str, Any]], prefix: str | None = None, now: datetime | None = None) -> list[tuple[str, ...]]:
    out: list[tuple[str, ...]] = []
    for m in models:
        name = str(m.get("name") or m.get("model") or "")
        if prefix and not name.lower().startswith(prefix.lower()):
            continue
        size, vram = int(m.get("size") or 0), int(m.get("size_vram") or 0)
        digest = str(m.get("digest") or "").removeprefix("sha256:")
        out.append(
            (
                name,
                digest[:12],
                output.format_size(size),
                processor(size, vram),
                context(m),
                until(str(m.get("expires_at") or ""), now),
            )
        )
    return out


def ps(
    prefix: Annotated[
        str | None, typer.Argument(metavar="PREFIX", help="Show only models whose name starts with this.")
    ] = None,
) -> None:
    """List the models loaded now."""
    with client_from_env() as client:
        models = client.request("GET", "/api/ps").json().get("models") or []
    for line in output.table([HEADER, *rows(models, prefix)]):
        output.out(line)
    for line in notes(models, prefix):
        output.out(line)


def notes(models: list[dict[str, Any]], prefix: str | None = None) -> list[str]:
    """Below the table: the names sharing a runner, the LoRA adapters it has loaded, the draft model loaded with a
    model, and a safer configuration corral chose after a crash."""
    out = []
    for m in models:
        name = str(m.get("name") or m.get("model") or "")
        if prefix and not name.lower().startswith(prefix.lower()):
            continue
        others = [n for n in m.get("names") or [] if n != name]
        if others:
            out.append(f"{name} also serves {', '.join(others)} (the same weights, one runner)")
        adapters = [a for a in m.get("adapters") or [] if isinstance(a, dict)]
        if adapters:
            out.append(
                f"{name} has {len(adapters)} LoRA adapter{'s' if len(adapters) != 1 else ''} loaded: "
                f"{adapters_note(adapters)} (one runner of the base; their memory is in SIZE)"
            )
        if m.get("draft_model"):
            out.append(f"{name} drafts with {m['draft_model']} (speculative decoding; its memory is in SIZE)")
        if m.get("fallback"):
            out.append(f"{name} runs with {m['fallback']}")
        rpc = m.get("rpc")
        if isinstance(rpc, dict) and (rpc.get("servers") or rpc.get("skipped")):
            out.append(f"{name} {rpc_note(rpc)}")
        kv = m.get("kv_disk")
        if isinstance(kv, dict) and (not kv.get("enabled") or kv.get("entries") or kv.get("hits") or kv.get("misses")):
            out.append(f"{name} {kv_disk_note(kv)}")  # an empty cache nothing has asked yet says nothing
    return [""] + out if out else []


def rpc_note(rpc: dict[str, Any]) -> str:
    """Where a model's layers went on llama.cpp RPC servers (CORRAL_RPC_SERVERS), and the servers left out."""
    held = rpc.get("bytes") or {}
    used = [f"{e} ({output.format_size(int(held.get(e) or 0))})" for e in rpc.get("servers") or []]
    text = (
        f"has layers on RPC server{'s' if len(used) != 1 else ''} {', '.join(used)} (counted as GPU above)"
        if used
        else ""
    )
    skipped = rpc.get("skipped") or {}
    if skipped:
        left = "; ".join(f"{e}: {why}" for e, why in skipped.items())
        text += ("; " if text else "") + f"left out (its layers stay here): {left}"
    return text


def adapters_note(adapters: list[dict[str, Any]]) -> str:
    """Each loaded adapter by its digest's first 12 characters, with the models that use it."""
    parts = []
    for a in adapters:
        digest = str(a.get("digest") or "").removeprefix("sha256:")[:12] or "?"
        models = [str(n) for n in a.get("models") or [a.get("model")] if n]
        parts.append(f"{digest} for {', '.join(models)}" if models else digest)
    return "; ".join(parts)


def kv_disk_note(kv: dict[str, Any]) -> str:
    """The model's prompt cache on disk: its blocks, bytes and the share of lookups that found a stored prefix."""
    if not kv.get("enabled"):
        return f"keeps no prompt cache on disk ({kv.get('reason') or 'off'})"
    entries, hits, misses = int(kv.get("entries") or 0), int(kv.get("hits") or 0), int(kv.get("misses") or 0)
    rate = f"{hits / (hits + misses):.0%} of {hits + misses} lookups" if hits + misses else "no lookups yet"
    restored = int(kv.get("restored_tokens") or 0)
    return (
        f"prompt cache on disk: {entries} block{'s' if entries != 1 else ''}, "
        f"{output.format_size(int(kv.get('bytes') or 0))}, hits {rate}, {restored} tokens restored"
    )


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


def gib(n: Any) -> str:
    return f"{int(n or 0) / (1 << 30):.1f} GiB"


SETTING_ENV = {
    "ram_budget": "CORRAL_RAM_BUDGET",
    "vram_budget": "CORRAL_VRAM_BUDGET",
    "num_parallel": "CORRAL_NUM_PARALLEL",
    "keep_alive": "CORRAL_KEEP_ALIVE",
    "context_length": "CORRAL_CONTEXT_LENGTH",
    "flash_attention": "CORRAL_FLASH_ATTENTION",
    "kv_cache_type": "CORRAL_KV_CACHE_TYPE",
    "kv_disk": "CORRAL_KV_DISK",
    "kv_disk_dir": "CORRAL_KV_DISK_DIR",
}


def setting_rows(settings: dict[str, Any]) -> list[list[str]]:
    """The CORRAL_* settings that shape loading, as the daemon reads them (an unset budget or 0 is automatic)."""
    rows = []
    for name, value in settings.items():
        if name in ("max_loaded_models", "default_num_ctx"):
            continue  # a row of its own / shown with context_length
        env = SETTING_ENV.get(name, "CORRAL_" + name.upper())
        if name in ("ram_budget", "vram_budget"):
            text = output.format_size(int(value)) if value is not None else "unset (free memory less a reserve)"
        elif name == "num_parallel":
            text = str(value) if value else "0 (automatic)"
        elif name == "keep_alive":
            text = "forever" if value == -1 else f"{value:g}s" if isinstance(value, (int, float)) else str(value)
        elif name == "kv_disk":
            text = output.format_size(int(value)) if value else "0 (off)"
        elif name == "context_length" and not value:
            chosen = settings.get("default_num_ctx")
            text = f"0 (automatic: {chosen})" if chosen else "0 (automatic)"
        else:
            text = str(value)
        rows.append([env, text])
    return rows


def info_lines(data: dict[str, Any]) -> list[str]:
    """``corral info``: the CPU and its instruction sets, RAM, llama.cpp's backends and devices, the GPUs it can
    offload to, the budgets, and the settings in force."""
    hw, budgets = data.get("hardware") or {}, data.get("budgets") or {}
    rows: list[list[str]] = [["Instance", str(data["instance"])]] if data.get("instance") else []  # CORRAL_INSTANCE
    rows += [
        ["CPU", f"{hw.get('physical_cores', '?')} physical cores, {hw.get('logical_cores', '?')} logical"],
        ["CPU features", " ".join(hw.get("cpu_features") or []) or "unknown (llama.cpp was not asked)"],
        [
            "RAM",
            f"{output.format_size(int(hw.get('total_ram') or 0))} total, "
            f"{output.format_size(int(hw.get('available_ram') or 0))} available",
        ],
    ]
    rows += [["Limits", str(line)] for line in hw.get("limits") or []]  # a container's cgroup, the CPU affinity
    source = f" (llama.cpp probe {hw['probe']})" if hw.get("probe") else ""
    rows.append(["Backends", (", ".join(hw.get("backends") or []) or "none") + source])
    for d in hw.get("devices") or []:
        desc = f"{d.get('description')}, " if d.get("description") and d.get("description") != d.get("name") else ""
        rows.append(
            [
                f"Device {d.get('index')}",
                f"{d.get('name')} ({d.get('type')}, {d.get('backend')}): {desc}"
                f"{gib(d.get('memory_total'))} total, {gib(d.get('memory_free'))} free",
            ]
        )
    for g in hw.get("gpus") or []:
        extra = [str(g.get("backend") or "")]
        if g.get("compute_capability"):
            extra.append(f"compute {g['compute_capability']}")
        if g.get("driver"):
            extra.append(f"driver {g['driver']}")
        rows.append(
            [
                f"GPU {g.get('index')}",
                f"{g.get('name')} ({', '.join(e for e in extra if e)}), "
                f"{gib(g.get('total_vram'))} total, {gib(g.get('free_vram'))} free",
            ]
        )
    offload = "yes" if hw.get("gpu_offload") else f"no ({hw.get('gpu_reason') or 'no GPU'})"
    rows.append(["GPU offload", offload])
    visible = hw.get("visible_devices") or {}
    if visible:
        rows.append(["Visible devices", " ".join(f'{k}="{v}"' for k, v in visible.items())])
    rows.append(
        [
            "RAM budget",
            output.format_size(int(budgets.get("ram") or 0))
            + (f" ({budgets['ram_source']})" if budgets.get("ram_source") else ""),
        ]
    )
    per_gpu = budgets.get("gpus") or []
    rows.append(
        [
            "VRAM budget",
            output.format_size(int(budgets.get("vram") or 0))
            + (f" ({budgets['vram_source']})" if budgets.get("vram_source") else "")
            + (f"; per GPU: {', '.join(output.format_size(int(x)) for x in per_gpu)}" if len(per_gpu) > 1 else ""),
        ]
    )
    for server in (data.get("rpc") or {}).get("servers") or []:  # CORRAL_RPC_SERVERS (llama.cpp rpc-servers)
        rows.append(
            [
                f"RPC server {server.get('endpoint')}",
                f"protocol {server.get('version')}, {len(server.get('devices') or [])} device(s), "
                f"{gib(server.get('memory_total'))} total, {gib(server.get('memory_free'))} free"
                if server.get("ok")
                else f"not used: {server.get('error')}",
            ]
        )
    max_loaded = budgets.get("max_loaded_models")
    rows.append(["Max loaded models", str(max_loaded) if max_loaded else "no limit (memory decides)"])
    rows.extend(setting_rows(data.get("settings") or {}))
    kv = data.get("kv_disk")
    if isinstance(kv, dict):
        used = output.format_size(int(kv.get("bytes") or 0))
        if kv.get("enabled"):
            text = f"{used} of {output.format_size(int(kv.get('limit_bytes') or 0))} used, in {kv.get('dir')}"
        else:
            text = "off" + (f" ({used} left in {kv.get('dir')})" if kv.get("bytes") else "")
        rows.append(["Prompt cache on disk", text])
    for f in data.get("runner_fallbacks") or []:  # safer configurations remembered after runner crashes
        what = [f"extra buffer types {'on' if f.get('extra_buffer_types', True) else 'off'}"]
        if f.get("max_gpu_layers") is not None:
            what.append(f"at most {f['max_gpu_layers']} GPU layers")
        why = f" ({f['reason']})" if f.get("reason") else ""
        rows.append(["Runner fallback", f"{Path(str(f.get('model_file') or '?')).name}: {', '.join(what)}{why}"])
    return output.table(rows)
