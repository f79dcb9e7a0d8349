"""``GET /lora-adapters?model=NAME``: llama-server's list of LoRA adapters (issue 29), for one model of the store.

llama-server serves one model and answers ``[{"id", "path", "scale"}]`` for the adapters it was started with. A
daemon of many models answers it for the model named in the query (or the body's ``model``): its ADAPTERs in
ADAPTER order (``id`` is what a request's ``lora: [{"id": N, "scale": S}]`` names) with their default scales
(``PARAMETER lora_scale``, 1.0 otherwise). ``path`` is the adapter's blob digest (``sha256:<hex>``), never a path
on this machine. ``POST /lora-adapters`` (llama-server: change the scales every later request gets) is refused
with what to do instead: in corral a model's scales are part of the model (``corral create``) and a request
chooses its own (``lora``). Errors are in the OpenAI shape llama-server uses."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse

from daemon.api.bodies import read_body
from daemon.api.compat import BadParam, openai_error
from daemon.api.state import inference
from daemon.generation import lora
from daemon.logs import note
from errors import CorralError, NotSupported
from modelfile.params import validate_options
from registry.manifest import MEDIA_ADAPTER

router = APIRouter()


@router.get("/lora-adapters")
async def list_adapters(request: Request) -> Response:
    try:
        raw = request.query_params.get("model") or ""
        if not raw:
            raise BadParam(
                "model",
                "name the model whose adapters to list: /lora-adapters?model=NAME (`corral list` shows the models)",
            )
        note(model=raw)
        ctx = await inference(request).lookup(raw)
        layers = ctx.stored.manifest.layers_of(MEDIA_ADAPTER)
        params = validate_options(ctx.params, ignore_unknown=True)
        scales = lora.default_scales([str(layer.digest) for layer in layers], params, model=raw)
        out: list[dict[str, Any]] = [
            {"id": i, "path": digest, "scale": scale} for i, (digest, scale) in enumerate(scales)
        ]
        return JSONResponse(out)
    except CorralError as exc:
        return openai_error(exc)


@router.post("/lora-adapters")
async def set_adapters(request: Request) -> Response:
    try:
        await read_body(request)  # read (and bounded) like any body, though what it asks is refused
        raise NotSupported(
            "corral does not change a model's adapter scales for every client: give a request its own scales with "
            '"lora": [{"id": N, "scale": S}] (options.lora in /api/generate and /api/chat), or make a model with '
            "other default scales (PARAMETER lora_scale, one per ADAPTER, then `corral create`)"
        )
    except CorralError as exc:
        return openai_error(exc)
