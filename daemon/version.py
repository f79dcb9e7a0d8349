"""The installed corral version."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

try:
    VERSION = version("corral")
except PackageNotFoundError:  # running from a source tree that was not installed
    VERSION = "0.0.0"
