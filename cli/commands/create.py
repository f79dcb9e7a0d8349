"""``corral create NAME [-f FILE]``: Modelfile -> local files hashed and uploaded -> ``POST /api/create``.

Every FROM that names a local path is uploaded (a vision model has two: the model GGUF and its projector GGUF; a
directory stands for all its ``.gguf`` files) and all of them go in one request's ``files``; the daemon tells the
projector from the model by its GGUF header.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from cli import output
from cli.client import DaemonClient
from cli.commands.common import client_from_env
from cli.errors import LocalFileError
from cli.modelfile_files import (
    ModelfileSource,
    adapter_files,
    check_model_file,
    files_map,
    hash_file,
    model_files,
    read_modelfile,
    resolve_from,
)
from errors import InvalidModelName
from registry.digest import Digest
from registry.names import ModelName

HASH_BAR_MIN = 64 * 1024 * 1024  # hash smaller files without a bar


def create(
    name: Annotated[str, typer.Argument(metavar="NAME", help="Name of the new model, e.g. mario or me/mario:v2.")],
    file: Annotated[str | None, typer.Option("--file", "-f", help='Modelfile to read (default "./Modelfile").')] = None,
    quantize: Annotated[
        str | None,
        typer.Option(
            "--quantize",
            "-q",
            help="Quantize the model to this level (q4_K_M, q4_K_S, q8_0; the source must be F16, BF16 or F32).",
        ),
    ] = None,
) -> None:
    """Create a model from a Modelfile."""
    try:
        ModelName.parse(name)
    except InvalidModelName:
        raise InvalidModelName(name, f"invalid model name: {name}") from None
    source = read_modelfile(file)
    with client_from_env() as client:
        client.heartbeat()
        payload = build_request(name, source, client)
        if quantize:
            payload["quantize"] = quantize
        with output.reporter() as rep:
            for event in client.create(payload):
                show_event(rep, event)


def build_request(name: str, source: ModelfileSource, client: DaemonClient) -> dict[str, Any]:
    """Parse the Modelfile, upload its local files, and return the ``/api/create`` body."""
    from modelfile import parse  # the parser is pure and light; loaded only when needed

    mf = parse(source.data, filename=source.filename)
    for param in mf.deprecated_parameters:
        output.err(f"warning: parameter {param} is deprecated")
    if getattr(mf, "drafts", ()):
        # Ollama's DRAFT uploads a draft model's own files into this model; corral's draft model is a model of its
        # own in the store, named by a parameter (and per request by options.draft_model)
        output.err(
            "warning: DRAFT (a draft model's files) is not supported by corral; ignored. Create the draft as a model "
            "of its own (corral create NAME -f ...) and name it with PARAMETER draft_model NAME"
        )

    payload: dict[str, Any] = {"model": name}
    model_paths: list[Path] = []
    for value in mf.froms:
        local = resolve_from(value, source.base_dir)
        if local is None:
            # one FROM may name a model (the others then add files, such as its projector); a second name would
            # silently replace the first
            if payload.get("from", value) != value:
                raise LocalFileError(
                    f'FROM names two models ("{payload["from"]}" and "{value}"); a Modelfile builds on one model '
                    "(a model GGUF plus its projector GGUF, or one model name plus a projector GGUF)"
                )
            payload["from"] = value
        else:
            try:
                model_paths += model_files(local)
            except LocalFileError:
                if not source.implicit:
                    raise
                raise LocalFileError(
                    f'no Modelfile or GGUF files found in "{local}"; name a Modelfile with -f'
                ) from None
    adapter_paths = [p for value in mf.adapters for p in adapter_files(value, source.base_dir)]
    # every file is checked before the first is hashed or uploaded: FROM /etc/passwd never leaves the machine
    for p in model_paths:
        check_model_file(p, "FROM")
    for p in adapter_paths:
        check_model_file(p, "ADAPTER")

    digests = upload(client, model_paths + adapter_paths)
    if model_paths:
        payload["files"] = files_map(model_paths, digests)
    if adapter_paths:
        payload["adapters"] = files_map(adapter_paths, digests)
    payload.update(mf.create_fields())
    return payload


def upload(client: DaemonClient, paths: list[Path]) -> dict[Path, Digest]:
    """Hash each file, then send the blobs the daemon lacks (``HEAD`` first, ``POST`` on 404)."""
    digests: dict[Path, Digest] = {}
    if not paths:
        return digests
    with output.reporter() as rep:
        rep.status("gathering model components")
        for p in dict.fromkeys(paths):
            size = p.stat().st_size
            if size >= HASH_BAR_MIN and rep.live:
                digests[p] = hash_file(p, rep.bar(("hash", p), f"hashing {p.name}", size).advance)
            else:
                digests[p] = hash_file(p)
        sent: set[Digest] = set()
        for p, d in digests.items():
            if d in sent or client.blob_exists(d):
                continue
            bar = rep.bar(("copy", d), f"copying file {d}", p.stat().st_size)
            client.upload_blob(d, p, bar.advance)
            bar.set(bar.total)
            sent.add(d)
    return digests


def show_event(rep: output.Reporter, event: dict[str, Any]) -> None:
    """One progress object from the daemon: a byte bar when it has a total, else a status line."""
    status = str(event.get("status", ""))
    total = event.get("total")
    if isinstance(total, int) and total > 0:
        key = event.get("digest") or status
        rep.bar(key, status, total).set(int(event.get("completed") or 0))
    elif status:
        rep.status(status)
