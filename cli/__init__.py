"""corral's command-line client: a thin typer app over the daemon's HTTP API (see ``cli.main``)."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version


def _version() -> str:
    try:
        return version("corral")
    except PackageNotFoundError:  # a source tree that was not installed
        return "0.0.0"


__version__ = _version()
