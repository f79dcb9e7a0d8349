"""``corral --version``: the client's version (and the Ollama API version it implements), and a warning when
the daemon's differs or is unreachable."""

from __future__ import annotations

from cli import __version__, output
from cli.commands.common import client_from_env
from daemon.version import OLLAMA_COMPAT_VERSION
from errors import CorralError


def print_version() -> None:
    try:
        with client_from_env(timeout=5) as client:
            daemon_version: str | None = client.version()
    except CorralError:
        daemon_version = None
        output.warn("could not connect to a running corral daemon")
    output.out(f"corral version is {__version__} (Ollama API {OLLAMA_COMPAT_VERSION})")
    if daemon_version is not None and daemon_version != __version__:
        output.warn(f"daemon version is {daemon_version}")
