"""The installed corral version, and the Ollama version whose API corral implements."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

try:
    VERSION = version("corral")
except PackageNotFoundError:  # running from a source tree that was not installed
    VERSION = "0.0.0"

#: The Ollama release whose behaviour this corral implements. ``/api/version`` answers it as ``version`` (apps such
#: as VS Code's Copilot refuse an "Ollama" older than they need; corral's own version is ``corral_version``), and a
#: model whose REQUIRES names a newer version is refused (at create and at load) rather than run with features
#: corral does not have.
OLLAMA_COMPAT_VERSION = "0.33.0"
