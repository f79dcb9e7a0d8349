"""Registry credentials in docker's ``config.json`` format.

    {"auths": {"registry.example.com": {"auth": "<base64 of user:password>"}}}

``corral login`` writes corral's own file (``CORRAL_REGISTRY_AUTH``, else ``<user config dir>/corral/auth.json``,
mode 0600). The daemon reads, in order, that file and then docker's (``$DOCKER_CONFIG/config.json``, else
``~/.docker/config.json``); when ``CORRAL_REGISTRY_AUTH`` is set, only that file. Files are read on every pull and
push, so a login takes effect without restarting the daemon. Credential helpers (``credsStore``,
``credHelpers``) are not run: corral never executes programs named in a config file.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import json
import logging
import os
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from errors import CredentialsError

log = logging.getLogger(__name__)

AUTH_ENV = "CORRAL_REGISTRY_AUTH"
MAX_FILE_BYTES = 1024 * 1024


@dataclass(frozen=True)
class Credentials:
    username: str
    password: str = field(repr=False)

    def basic(self) -> str:
        """The ``Authorization`` header value for HTTP Basic."""
        raw = f"{self.username}:{self.password}".encode()
        return "Basic " + base64.b64encode(raw).decode()


def default_login_file() -> Path:
    import platformdirs

    return Path(platformdirs.user_config_dir("corral", appauthor=False)) / "auth.json"


def login_file(environ: Mapping[str, str]) -> Path:
    """The file ``corral login`` writes."""
    explicit = environ.get(AUTH_ENV, "").strip()
    return Path(explicit).expanduser() if explicit else default_login_file()


def auth_files(explicit: str | None, environ: Mapping[str, str] | None = None) -> list[Path]:
    """The files searched for credentials, first match wins (see the module docstring)."""
    if explicit:
        return [Path(explicit).expanduser()]
    env = os.environ if environ is None else environ
    docker_dir = env.get("DOCKER_CONFIG", "").strip()
    docker = Path(docker_dir).expanduser() / "config.json" if docker_dir else Path.home() / ".docker" / "config.json"
    return [default_login_file(), docker]


def registry_key(host: str) -> str:
    """How a registry is named in ``auths``: the host[:port], lower-case, without scheme or path.

    Docker writes ``https://index.docker.io/v1/`` for Docker Hub and bare hosts for the rest; both reduce to a
    host here.
    """
    key = host.strip().lower()
    if "://" in key:
        key = key.split("://", 1)[1]
    return key.split("/", 1)[0]


def read_auths(path: Path) -> dict[str, Any]:
    """The ``auths`` object of one file ({} if the file does not exist)."""
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_FILE_BYTES + 1)
    except FileNotFoundError:
        return {}
    except OSError as exc:
        raise CredentialsError(f"cannot read the credentials file {path}: {exc.strerror or exc}") from exc
    if len(raw) > MAX_FILE_BYTES:
        raise CredentialsError(f"the credentials file {path} is larger than {MAX_FILE_BYTES} bytes")
    try:
        doc = json.loads(raw) if raw.strip() else {}
    except (ValueError, UnicodeDecodeError) as exc:
        raise CredentialsError(f"the credentials file {path} is not valid JSON: {exc}") from exc
    if not isinstance(doc, dict):
        raise CredentialsError(f"the credentials file {path} must hold a JSON object")
    auths = doc.get("auths", {})
    if not isinstance(auths, dict):
        raise CredentialsError(f'"auths" in the credentials file {path} must be an object')
    return auths


def _decode(entry: Any, path: Path, key: str) -> Credentials | None:
    if not isinstance(entry, dict):
        return None
    user, password = entry.get("username"), entry.get("password")
    if isinstance(user, str) and isinstance(password, str) and user:
        return Credentials(user, password)
    auth = entry.get("auth")
    if not isinstance(auth, str) or not auth:
        return None
    try:
        text = base64.b64decode(auth, validate=True).decode()
    except (binascii.Error, UnicodeDecodeError):
        raise CredentialsError(f'the "auth" value for {key} in {path} is not base64 of "user:password"') from None
    user, sep, password = text.partition(":")
    if not sep or not user:
        raise CredentialsError(f'the "auth" value for {key} in {path} is not base64 of "user:password"')
    return Credentials(user, password)


def lookup(host: str, files: list[Path]) -> Credentials | None:
    """Credentials for ``host`` from the first file that has an entry for it."""
    want = registry_key(host)
    for path in files:
        auths = read_auths(path)
        for key, entry in auths.items():
            if isinstance(key, str) and registry_key(key) == want:
                creds = _decode(entry, path, key)
                if creds is not None:
                    return creds
    return None


def _read_doc(path: Path) -> dict[str, Any]:
    read_auths(path)  # validates size and shape
    try:
        doc = json.loads(path.read_bytes() or b"{}")
    except FileNotFoundError:
        return {}
    return doc if isinstance(doc, dict) else {}


def _write_doc(path: Path, doc: dict[str, Any]) -> None:
    tmp = path.parent / f".{path.name}.tmp-{secrets.token_hex(8)}"
    try:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(doc, f, indent=2)
            f.write("\n")
        os.replace(tmp, path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise CredentialsError(f"cannot write the credentials file {path}: {exc.strerror or exc}") from exc


def save(host: str, creds: Credentials, path: Path) -> None:
    """Store ``creds`` for ``host`` in ``path`` (mode 0600), keeping every other entry and key."""
    doc = _read_doc(path)
    found = doc.get("auths")
    auths: dict[str, Any] = found if isinstance(found, dict) else {}
    key = registry_key(host)
    auths = {k: v for k, v in auths.items() if registry_key(k) != key}
    auths[key] = {"auth": base64.b64encode(f"{creds.username}:{creds.password}".encode()).decode()}
    doc["auths"] = auths
    _write_doc(path, doc)


def remove(host: str, path: Path) -> bool:
    """Forget ``host`` in ``path``; False if there was nothing to forget."""
    doc = _read_doc(path)
    found = doc.get("auths")
    auths: dict[str, Any] = found if isinstance(found, dict) else {}
    key = registry_key(host)
    kept = {k: v for k, v in auths.items() if registry_key(k) != key}
    if len(kept) == len(auths):
        return False
    doc["auths"] = kept
    _write_doc(path, doc)
    return True
