"""corral's one exception tree.

Every domain failure in corral is a :class:`CorralError`. The daemon maps these to HTTP in exactly one place
(``daemon/errors.py``) and the CLI maps them to messages in exactly one place (``cli/errors.py``). The message
(``str(exc)``) is what a client sees, so it follows Ollama's wording where Ollama has one.

This module imports nothing from the project, so every package (including the pure ``modelfile``) may use it.

    CorralError
    ├── InvalidRequest           bad input from a client (400)
    │   ├── InvalidModelName
    │   ├── InvalidDigest
    │   ├── DigestMismatch
    │   ├── InvalidGGUF
    │   ├── InvalidManifest
    │   └── ModelfileError       (modelfile.errors; has line and column)
    ├── NotFound                 (404)
    │   ├── ModelNotFound
    │   └── BlobNotFound
    ├── StoreLocked              another daemon owns the models directory
    └── StoreError               the store could not be read or written (500)
"""

from __future__ import annotations


class CorralError(Exception):
    """Root of every corral error. ``str(exc)`` is the user-facing message."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return self.message


class InvalidRequest(CorralError):
    """The client sent something corral cannot accept."""


class InvalidModelName(InvalidRequest):
    def __init__(self, name: str, message: str | None = None) -> None:
        super().__init__(message or "invalid model name")
        self.name = name


class InvalidDigest(InvalidRequest):
    def __init__(self, digest: str, message: str | None = None) -> None:
        super().__init__(message or "invalid digest format")
        self.digest = digest


class DigestMismatch(InvalidRequest):
    def __init__(self, expected: str, actual: str, message: str | None = None) -> None:
        super().__init__(message or f'digest mismatch, expected "{expected}", got "{actual}"')
        self.expected = expected
        self.actual = actual


class InvalidGGUF(InvalidRequest):
    """A blob that should be a GGUF file is not one, or its header is out of sane limits."""


class InvalidManifest(InvalidRequest):
    """A manifest (from disk or from a registry) is malformed."""


class NotFound(CorralError):
    pass


class ModelNotFound(NotFound):
    def __init__(self, name: str, message: str | None = None) -> None:
        super().__init__(message or f"model '{name}' not found")
        self.name = name


class BlobNotFound(NotFound):
    def __init__(self, digest: str) -> None:
        super().__init__(f'blob "{digest}" not found')
        self.digest = digest


class StoreLocked(CorralError):
    """Another corral daemon already serves this models directory."""


class StoreError(CorralError):
    """The store could not be read or written (disk full, permissions...)."""
