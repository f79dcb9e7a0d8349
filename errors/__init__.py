"""corral's one exception tree.

Every domain failure in corral is a :class:`CorralError`. The daemon maps these to HTTP in exactly one place
(``daemon/api/errors.py``: ``status_for``) and the CLI maps them to messages in exactly one place
(``cli/errors.py``: ``render_error``). The message (``str(exc)``) is what a client sees, so it follows Ollama's
wording where Ollama has one.

The HTTP status travels one way: ``status``, a class attribute of the type (``QueueFull.status = 503``) or the
constructor's ``status=`` (an error that comes back over the wire with its status), never set on an instance
afterwards. ``None`` (the default) lets ``daemon/api/errors.py``'s ``STATUS_TABLE`` decide by type.

Where each class lives (httpx's rule): an error raised or caught in more than one package lives here; an error one
package raises for its own reasons lives next to that code, in the module named in brackets, and is drawn here all
the same. This module imports nothing from the project, so every package (the pure ``modelfile`` too) may use it.

The number after each name is the HTTP status ``status_for`` gives it; ``tests/test_error_tree.py`` fails when a
subclass is missing from the drawing or drawn with another status. A ``CLI`` error is raised only in the ``corral``
process (or before the daemon serves), never answered over HTTP.

    CorralError                 500 the root; ``str(exc)`` is the user-facing message
    ├── InvalidRequest          400 the client sent something corral cannot accept
    │   ├── InvalidModelName    400 a name that is not [host/][namespace/]model[:tag]
    │   ├── InvalidDigest       400 a digest that is not sha256:<64 hex>
    │   ├── DigestMismatch      400 uploaded bytes that do not hash to the digest named for them
    │   ├── InvalidGGUF         400 not a GGUF file, or a header out of sane limits
    │   ├── InvalidManifest     400 a malformed manifest, from disk or from a registry
    │   ├── InsecureRegistry    400 a plain-HTTP registry named without --insecure
    │   ├── NotSupported        400 something corral does not do (yet); the message says what to do instead
    │   │   └── SlotsUnavailable  501 saving slots needs the prompt cache on disk, which is off [daemon.runners.base]
    │   ├── ModelfileError      400 a Modelfile that does not parse or render, file:line:col [modelfile.errors]
    │   ├── ParameterError      400 an unknown parameter, or a value of the wrong type [modelfile.errors]
    │   ├── InvalidArchive      400 an archive /api/import refuses [registry.oci]
    │   ├── BodyTooLarge        400 a body over MAX_JSON_BODY; 413 in Anthropic's shape [daemon.api.bodies]
    │   ├── BadParam            400 a parameter of the wrong type or value, named [daemon.api.compat]
    │   ├── TemplateError       400 a template that fails to parse or execute [daemon.templates.gotemplate]
    │   ├── RunnerRequestError  400 the runner refused a request: prompt too long, bad grammar [daemon.runners.process]
    │   └── SlotRefused         400 a bad slot id or filename, a saved slot it cannot restore [daemon.runners.base]
    ├── NotFound                404
    │   ├── ModelNotFound       404 no model of that name here
    │   ├── BlobNotFound        404 no blob of that digest in the store
    │   ├── RegistryNotFound    404 the registry has no such model or blob
    │   └── SlotNotFound        404 no saved slot of that name for this model [daemon.runners.base]
    ├── RegistryError           502 a remote registry failed, refused us or misbehaved
    │   ├── RegistryUnauthorized  502 no credentials, or the registry refused them
    │   ├── RegistryUnreachable   502 DNS, refused connection, TLS failure, timeouts
    │   ├── RegistryProtocolError 502 an answer that breaks the protocol or our limits
    │   └── BlobDigestMismatch    502 downloaded bytes that do not hash to their digest
    ├── RequestCanceled         499 the client went away before its answer (nobody reads it; the log does)
    ├── CredentialsError        500 a registry credentials file cannot be read or written
    ├── StoreLocked             503 another daemon owns the models directory
    ├── StoreError              500 the store could not be read or written
    │   ├── InsufficientSpace   507 not enough free disk space for a pull
    │   └── SlotNoRoom          507 a saved slot does not fit CORRAL_KV_DISK, or the disk is full [daemon.runners.base]
    ├── Cancelled               500 every pull waiting on a download went away [registry.download]
    ├── RunnerError             500 a runner failed; or the status the runner sent [daemon.runners.base]
    │   ├── LoadFailed          500 the model could not be loaded (signal, stage) [daemon.runners.base]
    │   ├── RunnerCrashed       500 the runner died while serving (signal, early) [daemon.runners.base]
    │   └── RunnerUnusable      500 crashed in every configuration: refused for a while [daemon.scheduling.fallback]
    ├── SlotBusy                409 the slot is serving a request [daemon.runners.base]
    ├── SchedulerError          500 the scheduler could not place a request [daemon.scheduling.scheduler]
    │   ├── QueueFull           503 too many requests wait for models; Retry-After [daemon.scheduling.scheduler]
    │   └── InsufficientMemory  500 the model does not fit the RAM/VRAM budget [daemon.scheduling.scheduler]
    ├── QuantizeFailed          500 the quantize worker failed or crashed [daemon.runners.quantize]
    ├── SettingsError           500 CLI: an environment variable corral cannot use [daemon.settings]
    ├── ListenError             500 CLI: `corral serve` cannot listen on its address [daemon.api.server]
    ├── InsecureBind            500 CLI: a non-loopback address without an API key [daemon.api.server]
    ├── DaemonUnreachable       500 CLI: nothing listens at the daemon's address [cli.errors]
    ├── DaemonConnectionError   500 CLI: the daemon was reached but the exchange failed [cli.errors]
    ├── LocalFileError          500 CLI: a Modelfile, FROM or ADAPTER path is missing or unusable [cli.errors]
    └── ServiceError            500 CLI: installing or controlling the service failed [cli.commands.service]
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


class NotSupported(InvalidRequest):
    """A request asks for something corral does not do (yet), with what to do instead."""


class RequestCanceled(CorralError):
    """The client went away (closed the connection, or stopped sending its body) before it was answered."""

    def __init__(self) -> None:
        super().__init__("request canceled")


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
