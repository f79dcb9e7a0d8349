"""The CLI's one error boundary: exceptions -> ``Error: <message>`` plus an optional next-step hint.

:func:`render_error` looks the exception's class (then its bases, most specific first) up in :data:`HINTS`.
Only :class:`CorralError` reaches it; anything else is a bug and propagates with its traceback.
"""

from __future__ import annotations

from collections.abc import Callable

from daemon.settings import SettingsError
from errors import CorralError, InvalidModelName, ModelNotFound


class DaemonUnreachable(CorralError):
    """Nothing listens at the daemon's address."""

    def __init__(self, address: str) -> None:
        super().__init__(f"could not connect to corral at {address}")
        self.address = address


class DaemonConnectionError(CorralError):
    """The daemon was reached but the exchange failed (timeout, dropped connection, bad reply)."""


class LocalFileError(CorralError):
    """A file the CLI must read (Modelfile, FROM or ADAPTER path) is missing or unusable."""


NAME_HINT = (
    'a model name looks like [host/][namespace/]model[:tag], each part letters, digits, "_", "-" or "." '
    '(e.g. "mario", "me/mario:v2")'
)


def _http_hint(exc: BaseException) -> str | None:
    status = exc.status if isinstance(exc, CorralError) else None
    if status in (401, 403):
        return "the daemon refused the request: check CORRAL_API_KEY and CORRAL_HOST"
    if isinstance(status, int) and status >= 500:
        return "see the daemon's log for details"
    return None


HintFn = Callable[[BaseException], "str | None"]

#: The one table. Lookup walks the exception's MRO, so the most specific entry wins.
HINTS: dict[type[BaseException], HintFn] = {
    DaemonUnreachable: lambda e: 'is "corral serve" running?',
    DaemonConnectionError: lambda e: "see the daemon's log for details",
    ModelNotFound: lambda e: 'run "corral list" to see the models you have',
    InvalidModelName: lambda e: NAME_HINT,
    SettingsError: lambda e: 'run "corral serve --help" for the environment variables and their formats',
    LocalFileError: lambda e: None,
    CorralError: _http_hint,
}


def render_error(exc: BaseException) -> tuple[str, str | None]:
    """The message and hint (or None) to print for ``exc``."""
    for cls in type(exc).__mro__:
        if cls in HINTS:
            return str(exc), HINTS[cls](exc)
    return str(exc), None
