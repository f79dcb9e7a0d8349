"""``GET /slots`` and ``POST /slots/{id_slot}?action=save|restore|erase``: llama-server's API for apps that manage
their own sessions (save a conversation's KV state under a name, restore it later, even after the model was unloaded
or the daemon restarted), with what a daemon of many models needs on top: the model is named (``model`` in the body
or the query; when exactly one model is loaded it may be left out), and a restore loads the model when it is not
loaded (with the request's ``options``, or the model's own, as a chat request would: the restored slot then serves
the requests that follow instead of being thrown away by a reload).

The runner does the work (``SlotSaveOp``, ``SlotRestoreOp``, ``SlotEraseOp``): the files are in the model's
``slots/`` folder of the prompt cache on disk (``CORRAL_KV_DISK_DIR``), named by a plain filename that is checked
here and again by the runner. Answers are llama-server's (``id_slot``, ``filename``, ``n_saved``/``n_written``,
``n_restored``/``n_read``, ``n_erased``, ``timings``) with the ``model`` added; errors are in the OpenAI shape
llama-server uses (``{"error": {"message", "type", ...}}``), with the status of the error's class."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse

from daemon.api.bodies import read_body
from daemon.api.compat import BadParam, openai_error, shaped
from daemon.api.state import inference
from daemon.generation.inference import Inference, ModelContext, keep_alive_value
from daemon.logs import note
from daemon.runners import kvstore
from daemon.runners.base import LoadSpec, SlotNotFound, SlotResult, SlotsUnavailable, check_slot_name
from daemon.scheduling.scheduler import Entry, Lease
from daemon.settings import Settings
from errors import InvalidRequest

router = APIRouter()

ACTIONS = ("save", "restore", "erase")


def _loaded(request: Request) -> list[Entry]:
    """The runners loaded now (not loading, alive)."""
    return [
        item["entry"]
        for item in request.app.state.scheduler.loaded()
        if not item["entry"].loading and item["entry"].runner.alive()
    ]


def _model_name(request: Request, body: dict[str, Any]) -> str | None:
    """The model named by the body's ``model`` or the query's (they must agree), else None."""
    in_body = body.get("model")
    if in_body is not None and (not isinstance(in_body, str) or not in_body):
        raise BadParam("model", "'model' must be a model name (a non-empty string)")
    in_query = request.query_params.get("model") or None
    if in_body and in_query and in_body != in_query:
        raise BadParam("model", f"the body names model {in_body!r} and the query {in_query!r}: name one")
    return in_body or in_query


async def _model(request: Request, name: str | None) -> ModelContext:
    inf = inference(request)
    if name is None:
        loaded = _loaded(request)
        names = sorted({e.ref.name for e in loaded})
        if len(names) != 1:
            said = "no model is loaded" if not names else f"{len(names)} models are loaded ({', '.join(names)})"
            raise BadParam("model", f"'model' is required: {said}; name one in the body or as ?model=")
        name = names[0]
    note(model=name)
    ctx = await inf.lookup(name)
    if "completion" not in ctx.capabilities:
        raise InvalidRequest(f"model {name!r} does not generate text (an embedding model): it has no slots")
    return ctx


def _slot_id(raw: str) -> int:
    try:
        slot = int(raw)
    except ValueError:
        slot = -1
    if slot < 0 or not raw.strip().isdigit():
        raise BadParam("id_slot", f"invalid slot id {raw[:40]!r}: a slot id is an integer from 0")
    return slot


def _action(request: Request) -> str:
    action = request.query_params.get("action")
    if action not in ACTIONS:
        raise BadParam("action", f"invalid action {str(action)[:40]!r}: ?action= must be one of {', '.join(ACTIONS)}")
    return action


async def _lease(inf: Inference, ctx: ModelContext, spec: LoadSpec | None, keep_alive: float | None) -> Lease:
    return await inf.acquire(ctx, spec if spec is not None else inf.load_spec(ctx, inf.options(ctx, None)), keep_alive)


@router.get("/slots")
@shaped(openai_error)
async def list_slots(request: Request) -> Response:
    """Every slot of the named model's runner (of every loaded model when none is named): id, the context it
    holds, whether it serves a request and the tokens it holds (llama-server's ``n_ctx``, ``is_processing``;
    corral's ``model`` and ``cached_tokens``). A model that is not loaded has no slots."""
    name = request.query_params.get("model") or None
    entries = _loaded(request)
    if name is not None:
        ctx = await inference(request).lookup(name)
        entries = [e for e in entries if e.ref.key == ctx.ref.key]
    out: list[dict[str, Any]] = []
    for entry in entries:
        for s in await entry.runner.slots():
            out.append(
                {
                    "id": s.id,
                    "model": entry.ref.name,
                    "n_ctx": entry.loaded_spec.num_ctx,
                    "is_processing": s.busy,
                    "cached_tokens": s.cached_tokens,
                }
            )
    return JSONResponse(out)


@router.post("/slots/{id_slot}")
@shaped(openai_error)
async def slot_action(request: Request, id_slot: str) -> Response:
    slot = _slot_id(id_slot)
    action = _action(request)
    raw = await read_body(request, allow_empty=True)
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise InvalidRequest(f"request body must be a JSON object, got {type(raw).__name__}")
    body: dict[str, Any] = raw
    filename = body.get("filename")
    if action != "erase":
        reason = check_slot_name(filename)
        if reason is not None:
            raise BadParam("filename", reason)
    ctx = await _model(request, _model_name(request, body))
    inf = inference(request)
    options = body.get("options")
    keep_alive = keep_alive_value(body.get("keep_alive"))
    serving = request.app.state.scheduler.serving(ctx.ref.key)
    if action == "restore":
        # loaded as a request with these options would have it: the requests that follow then find the slot
        spec = inf.load_spec(ctx, inf.options(ctx, options)) if options is not None else serving
        lease = await _lease(inf, ctx, spec, keep_alive)
        try:
            done = await lease.runner.restore_slot(slot, str(filename))
        finally:
            lease.release()
        return JSONResponse(_answer(ctx, done, "restore"))
    if serving is None:
        if action == "erase":  # nothing is loaded, nothing is held
            return JSONResponse({"id_slot": slot, "model": ctx.name.short(), "n_erased": 0})
        raise InvalidRequest(
            f"model {ctx.name.short()!r} is not loaded: its slots hold nothing to save (run a request first)"
        )
    lease = await inf.acquire(ctx, serving, keep_alive)
    try:
        if action == "save":
            done = await lease.runner.save_slot(slot, str(filename))
        else:
            done = await lease.runner.erase_slot(slot)
    finally:
        lease.release()
    return JSONResponse(_answer(ctx, done, action))


# -- the saved files (corral's: llama-server leaves them to the file system) ----------------------------------------
def _saved_of(request: Request, ctx: ModelContext) -> tuple[str, dict[str, str]]:
    """The prompt cache's directory, and what the meta.json of each of ``ctx``'s cache keys says of the model (its
    model, adapter and projector digests, as the runner writes them)."""
    settings: Settings = request.app.state.settings
    if settings.kv_disk_dir is None or settings.kv_disk <= 0:
        raise SlotsUnavailable(
            "saved slots live in the prompt cache on disk, which is off (CORRAL_KV_DISK=0): set CORRAL_KV_DISK"
        )
    key = json.loads(inference(request).kv_key_for(ctx, "f16", "auto"))
    return str(settings.kv_disk_dir), {
        "model": key["model"],
        "adapters": json.dumps(key["adapters"]),
        "projector": key["projector"],
    }


@router.get("/slots/saved")
@shaped(openai_error)
async def list_saved(request: Request) -> Response:
    """The saved slots of a model (``?model=``; optional when exactly one model is loaded): filename, bytes and when
    each was written, newest first. A model's files saved under another llama.cpp build or KV cache type are listed
    too (its restore refuses them, and a delete removes them)."""
    from starlette.concurrency import run_in_threadpool

    ctx = await _model(request, _model_name(request, {}))
    root, model = _saved_of(request, ctx)
    found = await run_in_threadpool(kvstore.saved_slots, root, model)
    return JSONResponse(
        {
            "model": ctx.name.short(),
            "saved": [
                {
                    "filename": f.name,
                    "bytes": f.bytes,
                    "modified_at": datetime.fromtimestamp(f.modified, UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
                }
                for f in found
            ],
        }
    )


@router.delete("/slots/saved/{filename}")
@shaped(openai_error)
async def delete_saved(request: Request, filename: str) -> Response:
    """Remove a model's saved slot ``filename`` (``?model=``; optional when exactly one model is loaded): saved
    slots count against CORRAL_KV_DISK and nothing evicts them, so an app that saves sessions removes the ones it
    is done with here. 404 when the model has none of that name."""
    from starlette.concurrency import run_in_threadpool

    reason = check_slot_name(filename)
    if reason is not None:
        raise BadParam("filename", reason)
    ctx = await _model(request, _model_name(request, {}))
    root, model = _saved_of(request, ctx)
    freed = await run_in_threadpool(kvstore.remove_saved_slot, root, model, filename)
    if not freed:
        raise SlotNotFound(f"no saved slot named {filename!r} for model {ctx.name.short()!r}")
    return JSONResponse({"model": ctx.name.short(), "filename": filename, "bytes_freed": freed})


def _answer(ctx: ModelContext, done: SlotResult, action: str) -> dict[str, Any]:
    """llama-server's answer to the action, with the model."""
    model = ctx.name.short()
    if action == "save":
        return {
            "id_slot": done.slot,
            "model": model,
            "filename": done.filename,
            "n_saved": done.tokens,
            "n_written": done.bytes,
            "timings": {"save_ms": done.ms},
        }
    if action == "restore":
        return {
            "id_slot": done.slot,
            "model": model,
            "filename": done.filename,
            "n_restored": done.tokens,
            "n_read": done.bytes,
            "timings": {"restore_ms": done.ms},
        }
    return {"id_slot": done.slot, "model": model, "n_erased": done.tokens}
