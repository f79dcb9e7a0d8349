"""corral's one exception tree.

Every domain failure in corral is a :class:`CorralError`. The daemon maps these to HTTP in exactly one place
(``daemon/api/errors.py``) and the CLI maps them to messages in exactly one place (``cli/errors.py``). The message
(``str(exc)``) is what a client sees, so it follows Ollama's wording where Ollama has one.

The HTTP status travels one way: ``status``, a class attribute of the type (``QueueFull.status = 503``) or the
constructor's ``status=`` (an error that comes back over the wire with its status), never set on an instance
afterwards. ``None`` (the default) lets ``daemon/api/errors.py``'s ``STATUS_TABLE`` decide by type.

This module imports nothing from the project, so every package (including the pure ``modelfile``) may use it.

    CorralError
    ├── InvalidRequest           bad input from a client (400)
    │   ├── InvalidModelName
    │   ├── InvalidDigest
    │   ├── DigestMismatch
    │   ├── InvalidGGUF
    │   ├── InvalidManifest
    │   ├── InsecureRegistry     a plain-HTTP registry named without --insecure
    │   └── ModelfileError       (modelfile.errors; has line and column)
    ├── NotFound                 (404)
    │   ├── ModelNotFound
    │   ├── BlobNotFound
    │   └── RegistryNotFound     the registry has no such model or blob
    ├── RegistryError            a remote registry failed, refused us or misbehaved (502)
    │   ├── RegistryUnauthorized no credentials, or the registry refused them
    │   ├── RegistryUnreachable  DNS, refused connection, TLS failure, timeouts
    │   ├── RegistryProtocolError  an answer that breaks the protocol or our limits
    │   └── BlobDigestMismatch   downloaded bytes that do not hash to their digest
    ├── CredentialsError         a registry credentials file cannot be read or written
    ├── StoreLocked              another daemon owns the models directory
    └── StoreError               the store could not be read or written (500)
        └── InsufficientSpace    not enough free disk space for a pull
"""

from __future__ import annotations


class CorralError(Exception):
    """Root of every corral error. ``str(exc)`` is the user-facing message."""

    status: int | None = None  # the HTTP status, when the type or the constructor fixes one (see above)

    def __init__(self, message: str, *, status: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        if status is not None:
            self.status = status

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
    def __init__(self, name: str, message: str | None = None, *, status: int | None = None) -> None:
        super().__init__(message or f"model '{name}' not found", status=status)
        self.name = name


class BlobNotFound(NotFound):
    def __init__(self, digest: str) -> None:
        super().__init__(f'blob "{digest}" not found')
        self.digest = digest


class StoreLocked(CorralError):
    """Another corral daemon already serves this models directory."""


class StoreError(CorralError):
    """The store could not be read or written (disk full, permissions...)."""


class InsufficientSpace(StoreError):
    """A pull needs more disk space than the models directory's filesystem has free."""


class RegistryNotFound(NotFound):
    """The registry answered 404 for a manifest or blob."""


class InsecureRegistry(InvalidRequest):
    """A plain-HTTP registry was named without ``insecure``."""


class RegistryError(CorralError):
    """A remote registry failed, refused us or misbehaved. The message names the registry."""


class RegistryUnauthorized(RegistryError):
    """The registry answered 401/403 even with the credentials we have (or we have none)."""


class RegistryUnreachable(RegistryError):
    """The registry could not be reached: DNS, refused connection, TLS failure, timeouts."""


class RegistryProtocolError(RegistryError):
    """An answer that breaks the protocol or our limits: a bad manifest, an oversized body, a bad redirect."""


class BlobDigestMismatch(RegistryError):
    """Downloaded bytes that do not hash to the digest the manifest promised; they are discarded."""

    def __init__(self, expected: str, actual: str) -> None:
        super().__init__(f"digest mismatch, file must be downloaded again: want {expected}, got {actual}")
        self.expected = expected
        self.actual = actual


class CredentialsError(CorralError):
    """A registry credentials file (docker-style ``config.json``) cannot be read or written."""
