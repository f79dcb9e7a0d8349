"""``corral pull NAME``, ``corral push NAME`` and ``corral prune [--dry-run]``: thin calls to the daemon."""

from __future__ import annotations

from typing import Annotated

import typer

from cli import output
from cli.commands.common import client_from_env
from cli.progress import render_progress

INSECURE_HELP = "Allow a plain-HTTP registry (for a local registry you trust)."


def pull(
    name: Annotated[
        str,
        typer.Argument(
            metavar="NAME", help="Model to pull, e.g. llama3.2, hf.co/user/repo:Q4_K_M or 127.0.0.1:5000/ns/model:tag."
        ),
    ],
    insecure: Annotated[bool, typer.Option("--insecure", help=INSECURE_HELP)] = False,
) -> None:
    """Pull a model from a registry (resumes an interrupted pull)."""
    with client_from_env(timeout=None) as client:
        render_progress(client.pull(name, insecure=insecure))


def push(
    name: Annotated[
        str,
        typer.Argument(
            metavar="NAME", help="Model to push; its name says where, e.g. registry.example.com/me/model:tag."
        ),
    ],
    insecure: Annotated[bool, typer.Option("--insecure", help=INSECURE_HELP)] = False,
) -> None:
    """Push a model to a registry (only the blobs it lacks are uploaded)."""
    with client_from_env(timeout=None) as client:
        render_progress(client.push(name, insecure=insecure))


def prune(
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Only show what would be removed.")] = False,
) -> None:
    """Remove blobs no model uses and partial downloads no pull is resuming, and print the bytes freed."""
    with client_from_env(timeout=None) as client:
        result = client.prune(dry_run=dry_run)
    if result.get("skipped_reason"):
        output.warn(f"nothing pruned: {result['skipped_reason']}")
        return
    files = [f for f in result.get("files") or [] if isinstance(f, dict)]
    verb = "would remove" if dry_run else "removed"
    for f in files:
        output.out(f"{verb} {f.get('file')} ({f.get('kind')}, {output.format_size(int(f.get('size') or 0))})")
    freed = output.format_size(int(result.get("bytes_freed") or 0))
    if dry_run:
        output.out(f"{len(files)} files, {freed} would be freed")
    else:
        output.out(f"{len(files)} files removed, {freed} freed")
        cache = int(result.get("kv_disk_bytes_freed") or 0)
        if cache:
            output.out(f"prompt caches of removed models: {output.format_size(cache)} freed")
