"""``corral run MODEL [PROMPT...]``: answer one prompt, or chat in a REPL when the terminal is interactive.

The mode follows Ollama: with prompt arguments, or with stdin that is not a terminal (its text goes before the
prompt), the answer streams from ``/api/generate`` and the command exits; with neither, and both stdin and
stdout terminals, the REPL in :mod:`cli.interactive` chats through ``/api/chat``. A model that is not here is
pulled first. Embedding models print the prompt's vector as a JSON array. With a vision model, the image files the
prompt names (``corral run model "describe ./photo.png"``) are attached to it, as Ollama's CLI does.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from cli import output
from cli.chat import Printer, extract_images, generate_stream
from cli.client import DaemonClient
from cli.commands.common import client_from_env
from cli.errors import DaemonUnreachable
from cli.progress import render_progress
from errors import CorralError, InvalidRequest, ModelNotFound, NotFound

THINK_LEVELS = ("true", "false", "high", "medium", "low", "max")


def think_value(raw: str | None) -> bool | str | None:
    """``--think`` (no value: true), ``--think=false``, or a level."""
    if raw is None:
        return None
    value = raw.strip().lower()
    if value not in THINK_LEVELS:
        raise InvalidRequest(f'invalid value for --think: "{raw}" (must be true, false, high, medium, low, or max)')
    return {"true": True, "false": False}.get(value, value)


def find_model(client: DaemonClient, name: str, *, insecure: bool = False) -> dict[str, Any]:
    """``/api/show`` for ``name``; a model that is not here is pulled (with ``corral pull``'s progress), then
    shown. A failed pull says which model was missing as well as why the pull failed."""
    try:
        return client.show(name)
    except ModelNotFound:
        pass
    try:
        render_progress(client.pull(name, insecure=insecure))
    except DaemonUnreachable:
        raise
    except NotFound as exc:
        raise ModelNotFound(name, f"model '{name}' is not here and the registry does not have it: {exc}") from None
    except CorralError as exc:
        raise CorralError(f"model '{name}' is not here, and pulling it failed: {exc}", status=exc.status) from None
    return client.show(name)


def parse_format(value: str | None) -> Any:
    """``--format``: "json", a JSON schema (as text), or ``@file`` holding one; what the API's ``format`` takes.
    None when unset."""
    if value is None or value.strip() == "":
        return None
    text = value.strip()
    if text == "json":
        return "json"
    shown = text if len(text) <= 60 else text[:57] + "..."
    where = f'invalid format "{shown}"'
    if text.startswith("@"):
        path = Path(text[1:]).expanduser()
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise InvalidRequest(
                f'{where}: cannot read the schema file "{path}": {getattr(exc, "strerror", None) or exc}'
            ) from None
    try:
        parsed = json.loads(text)
    except ValueError as exc:
        raise InvalidRequest(
            f'{where}: not "json" and not a JSON schema ({exc}); use "json", a JSON schema such '
            'as \'{"type":"object","properties":{...}}\', or @schema.json'
        ) from None
    if parsed == "json":
        return "json"
    if not isinstance(parsed, dict):
        raise InvalidRequest(f"{where}: a JSON schema must be an object, got {type(parsed).__name__}")
    return parsed


def run(
    model: Annotated[str, typer.Argument(metavar="MODEL", help="Model to run (pulled first if it is not here).")],
    prompt: Annotated[
        list[str] | None, typer.Argument(metavar="[PROMPT]...", help="Prompt; without one, chat interactively.")
    ] = None,
    format: Annotated[
        str | None,
        typer.Option("--format", help='Response format: "json", a JSON schema, or @FILE holding a JSON schema.'),
    ] = None,
    think: Annotated[
        str | None,
        typer.Option(
            "--think",
            is_flag=False,
            flag_value="true",
            metavar="[LEVEL]",
            help="Let a thinking model think (true, false, high, medium, low, max).",
        ),
    ] = None,
    hide_thinking: Annotated[bool, typer.Option("--hidethinking", help="Don't print the model's thinking.")] = False,
    keepalive: Annotated[
        str | None,
        typer.Option(
            "--keepalive", metavar="DURATION", help='How long the model stays loaded (e.g. "5m", "1h", "-1").'
        ),
    ] = None,
    verbose: Annotated[bool, typer.Option("--verbose", help="Print timings and token rates after the answer.")] = False,
    insecure: Annotated[bool, typer.Option("--insecure", help="Allow plain HTTP when pulling the model.")] = False,
    nowordwrap: Annotated[bool, typer.Option("--nowordwrap", help="Don't wrap words to the terminal width.")] = False,
    truncate: Annotated[
        bool | None, typer.Option("--truncate/--no-truncate", help="Embedding models: cut input that is too long.")
    ] = None,
    dimensions: Annotated[int | None, typer.Option("--dimensions", help="Embedding models: vector size.")] = None,
) -> None:
    """Run a model: answer a prompt, or chat with it."""
    fmt = parse_format(format)
    think_v = think_value(think)
    words = list(prompt or [])
    stdin_tty, stdout_tty = sys.stdin.isatty(), sys.stdout.isatty()
    wordwrap = not nowordwrap
    if not stdin_tty:
        piped = sys.stdin.read()
        words = [piped, *words] if piped else words
        wordwrap = False
    interactive = not words and stdin_tty and stdout_tty
    text = " ".join(words)

    with client_from_env(timeout=None) as client:
        client.heartbeat()
        info = find_model(client, model, insecure=insecure)
        capabilities = info.get("capabilities") or []
        if think_v is None and "thinking" in capabilities:
            think_v = True
        if "embedding" in capabilities and "completion" not in capabilities:
            embed(client, model, text, keepalive, truncate, dimensions)
            return
        printer = Printer(wordwrap=wordwrap, hide_thinking=hide_thinking, verbose=verbose)
        if interactive:
            from cli.interactive import Repl, Session

            session = Session(
                model=model,
                info=info,
                format=fmt,
                think=think_v,
                keep_alive=keepalive,
                wordwrap=wordwrap,
                verbose=verbose,
                hide_thinking=hide_thinking,
            )
            Repl(client, session).run()
            return
        body: dict[str, Any] = {"model": model, "prompt": text}
        if "vision" in capabilities:
            body["prompt"], images = extract_images(text)
            if images:
                body["images"] = images
        if fmt is not None:
            body["format"] = fmt
        if think_v is not None:
            body["think"] = think_v
        if keepalive is not None:
            body["keep_alive"] = keepalive
        answer = printer.stream(generate_stream(client, body), key="response")
        if answer.interrupted:
            raise typer.Exit(130)


def embed(
    client: DaemonClient, model: str, text: str, keepalive: str | None, truncate: bool | None, dimensions: int | None
) -> None:
    if not text:
        raise InvalidRequest(f'embedding models require input text. Usage: corral run {model} "your text here"')
    body: dict[str, Any] = {"model": model, "input": text}
    if keepalive is not None:
        body["keep_alive"] = keepalive
    if truncate is not None:
        body["truncate"] = truncate
    if dimensions is not None:
        body["dimensions"] = dimensions
    result = client.request("POST", "/api/embed", json_body=body).json()
    vectors = result.get("embeddings") or [[]]
    output.out(json.dumps(vectors[0]))
