"""``corral cp SRC DST`` and ``corral rm NAME...``."""

from __future__ import annotations

from typing import Annotated

import typer

from cli import output
from cli.client import DaemonClient
from cli.commands.common import client_from_env
from cli.errors import DaemonUnreachable
from errors import CorralError, NotFound


def copy(
    source: Annotated[str, typer.Argument(metavar="SOURCE", help="Existing model.")],
    destination: Annotated[str, typer.Argument(metavar="DESTINATION", help="New name for it.")],
) -> None:
    """Copy a model to a new name (no data is duplicated)."""
    with client_from_env() as client:
        client.copy(source, destination)
    output.out(f"copied '{source}' to '{destination}'")


def stop_quietly(client: DaemonClient, name: str) -> None:
    """Unload ``name`` if it is running. Not-found (the model, or a daemon without the endpoint) is silent;
    other failures warn; an unreachable daemon is an error."""
    try:
        client.unload(name)
    except DaemonUnreachable:
        raise
    except NotFound:
        pass
    except CorralError as exc:
        if exc.status != 405:
            output.warn(f"unable to stop model '{name}'")


def remove(names: Annotated[list[str], typer.Argument(metavar="NAME", help="Models to delete.")]) -> None:
    """Delete models (their blobs go when no other model uses them)."""
    with client_from_env() as client:
        for name in names:
            stop_quietly(client, name)
            client.delete(name)
            output.out(f"deleted '{name}'")
