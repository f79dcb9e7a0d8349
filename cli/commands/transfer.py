"""``corral export NAME -o FILE`` and ``corral import FILE [--name NEW]``: a model as an OCI image layout tar, for
machines without a network (the daemon builds and reads the archive; see ``daemon/api/routes/transfer.py``)."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any, BinaryIO

import httpx
import typer

from cli import output
from cli.client import CHUNK, error_for
from cli.commands.common import client_from_env
from cli.commands.create import show_event
from cli.errors import DaemonConnectionError, LocalFileError
from errors import CorralError


def _error(response: httpx.Response) -> CorralError:
    response.read()
    text = response.text.strip()
    try:
        body = response.json() if text else None
    except ValueError:
        body = None
    message = (
        body["error"]
        if isinstance(body, dict) and isinstance(body.get("error"), str)
        else (text or f"{response.status_code} {response.reason_phrase}")
    )
    return error_for(response.status_code, message)


def export(
    name: Annotated[str, typer.Argument(metavar="NAME", help="Model to export.")],
    output_path: Annotated[
        str,
        typer.Option(
            "--output", "-o", metavar="FILE", help='Archive to write (an OCI image layout tar); "-" for stdout.'
        ),
    ],
) -> None:
    """Write a model to a tar file (an OCI image layout) that "corral import" reads on another machine."""
    to_stdout = output_path == "-"
    if to_stdout and sys.stdout.isatty():
        raise LocalFileError("refusing to write an archive to a terminal; redirect stdout or give -o FILE")
    target = Path(output_path)
    partial = target.with_name(f".{target.name}.partial")
    with (
        client_from_env(timeout=None) as client,
        client._translate(),
        client._http.stream("GET", "/api/export", params={"model": name}) as response,
    ):
        if response.status_code >= 400:
            raise _error(response)
        total = int(response.headers.get("Content-Length") or 0)
        sink: BinaryIO
        if to_stdout:
            sink = sys.stdout.buffer
        else:
            try:
                sink = open(partial, "wb")  # noqa: SIM115
            except OSError as exc:
                raise LocalFileError(f"cannot write {partial}: {exc.strerror or exc}") from None
        written = 0
        try:
            with output.reporter() as rep:
                bar = rep.bar("export", f"exporting {name}", total)
                for chunk in response.iter_bytes(CHUNK):
                    sink.write(chunk)
                    written += len(chunk)
                    bar.advance(len(chunk))
            if total and written != total:
                raise DaemonConnectionError(f"the archive ended after {written} of {total} bytes")
            sink.flush()
            if not to_stdout:
                os.fsync(sink.fileno())
                sink.close()
                os.replace(partial, target)
        except BaseException:
            if not to_stdout:
                sink.close()
                with contextlib.suppress(OSError):
                    partial.unlink()
            raise
    if not to_stdout:
        output.err(f"exported {name} to {target} ({output.format_size(written)})")


def import_(
    path: Annotated[
        str,
        typer.Argument(
            metavar="FILE",
            help='Archive written by "corral export" (or any OCI image '
            'layout tar holding one Ollama-style model); "-" for stdin.',
        ),
    ],
    name: Annotated[str | None, typer.Option("--name", help="Import under this name instead of the archive's.")] = None,
) -> None:
    """Add the model in an archive from "corral export" to the store (a model of the same name is replaced)."""
    if path == "-":
        source: BinaryIO = sys.stdin.buffer
        total = 0
        label = "stdin"
    else:
        p = Path(path)
        try:
            source = open(p, "rb")  # noqa: SIM115
            total = os.fstat(source.fileno()).st_size
        except OSError as exc:
            raise LocalFileError(f"cannot read {path}: {exc.strerror or exc}") from None
        label = p.name
    params: dict[str, str] = {"stream": "true"}
    if name:
        params["name"] = name
    try:
        with client_from_env(timeout=None) as client, output.reporter() as rep:
            bar = rep.bar("upload", f"sending {label}", total)

            def body() -> Iterator[bytes]:
                while chunk := source.read(CHUNK):
                    yield chunk
                    bar.advance(len(chunk))

            headers = {"Content-Type": "application/x-tar", "Accept": "application/x-ndjson"}
            if total:
                headers["Content-Length"] = str(total)
            last: dict[str, Any] | None = None
            with (
                client._translate(),
                client._http.stream("POST", "/api/import", params=params, content=body(), headers=headers) as response,
            ):
                if response.status_code >= 400:
                    raise _error(response)
                for line in response.iter_lines():
                    if not line.strip():
                        continue
                    event = _event(line)
                    if event.get("error"):
                        raise CorralError(str(event["error"]))
                    show_event(rep, event)
                    last = event
            if not last or last.get("status") != "success":
                raise DaemonConnectionError("the import ended without success; see the daemon's log")
    finally:
        if source is not sys.stdin.buffer:
            source.close()
    output.out(f"imported {label}" + (f" as {name}" if name else ""))


def _event(line: str) -> dict[str, Any]:
    import json

    try:
        obj = json.loads(line)
    except ValueError:
        raise DaemonConnectionError(f"corral sent an invalid line: {line[:200]!r}") from None
    return obj if isinstance(obj, dict) else {}
