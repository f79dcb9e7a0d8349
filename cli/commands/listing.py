"""``corral list`` / ``corral ls [PREFIX]``: the local models as a table."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from cli import output
from cli.commands.common import client_from_env

HEADER = ("NAME", "ID", "SIZE", "MODIFIED")


def rows(models: list[dict[str, Any]], prefix: str | None = None) -> list[tuple[str, str, str, str]]:
    """Table rows for ``/api/tags`` entries whose name starts with ``prefix`` (case-insensitively)."""
    out = []
    for m in models:
        name = str(m.get("name") or m.get("model") or "")
        if prefix and not name.lower().startswith(prefix.lower()):
            continue
        size = "-" if m.get("remote_host") else output.format_size(int(m.get("size") or 0))
        digest = str(m.get("digest") or "").removeprefix("sha256:")
        out.append((name, digest[:12], size, output.format_ago(str(m.get("modified_at") or ""))))
    return out


def list_models(
    prefix: Annotated[
        str | None, typer.Argument(metavar="PREFIX", help="Show only models whose name starts with this.")
    ] = None,
) -> None:
    """List the models you have."""
    with client_from_env() as client:
        models = client.tags()
    for line in output.table([HEADER, *rows(models, prefix)]):
        output.out(line)
