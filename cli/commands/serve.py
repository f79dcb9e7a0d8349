"""``corral serve``: run the daemon in the foreground. The daemon package is imported only here, lazily."""

from __future__ import annotations

import os
from typing import Annotated

import typer

from daemon.settings import Settings, env_help

SUMMARY = "Start corral: the daemon that stores, loads and serves models."


def help_text() -> str:
    """The command's help, ending with the environment variables it reads."""
    return f"{SUMMARY}\n\n\b\n{env_help()}"


def serve(
    insecure: Annotated[
        bool, typer.Option("--insecure", help="Allow listening on a non-loopback address without CORRAL_API_KEY.")
    ] = False,
) -> int:
    """Start corral."""
    settings = Settings.from_env(os.environ)
    from daemon.api.server import serve as run_daemon

    return run_daemon(settings, insecure=insecure)
