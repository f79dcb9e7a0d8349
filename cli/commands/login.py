"""``corral login REGISTRY`` and ``corral logout REGISTRY``: registry credentials for pull and push.

Credentials are checked against the registry (``GET /v2/`` through its auth challenge, as ``docker login`` does)
and saved in docker's ``config.json`` format to ``CORRAL_REGISTRY_AUTH`` or ``<user config dir>/corral/auth.json``
(mode 0600), where a daemon running as the same user reads them on every pull and push.
"""

from __future__ import annotations

import getpass
import os
import sys
from typing import Annotated

import typer

from cli import output
from cli.errors import LocalFileError
from errors import InvalidModelName
from registry.credentials import Credentials, login_file, registry_key, remove, save
from registry.names import ModelName


def _host(registry: str) -> str:
    """The registry's host[:port] from what the user typed (``https://`` and a path are allowed)."""
    host = registry_key(registry)
    try:
        ModelName.parse(f"{host}/corral/login")
    except InvalidModelName:
        raise InvalidModelName(registry, f"invalid registry name: {registry}") from None
    return host


def _password(password_stdin: bool) -> str:
    if password_stdin:
        value = sys.stdin.read().rstrip("\r\n")
    elif sys.stdin.isatty():
        value = getpass.getpass("Password: ")
    else:
        raise LocalFileError("no password: stdin is not a terminal; pass it with --password-stdin")
    if not value:
        raise LocalFileError("the password is empty")
    return value


def login(
    registry: Annotated[
        str, typer.Argument(metavar="REGISTRY", help="Registry host, e.g. registry.example.com or 127.0.0.1:5000.")
    ],
    username: Annotated[str | None, typer.Option("--username", "-u", help="User name (asked if not given).")] = None,
    password_stdin: Annotated[bool, typer.Option("--password-stdin", help="Read the password from stdin.")] = False,
    insecure: Annotated[bool, typer.Option("--insecure", help="The registry speaks plain HTTP.")] = False,
) -> None:
    """Log in to a registry: check the credentials there, then save them for pull and push."""
    from registry.remote import verify_login  # httpx and TLS setup only when logging in

    host = _host(registry)
    if not username:
        if not sys.stdin.isatty() or password_stdin:
            raise LocalFileError("no user name: pass it with --username")
        username = typer.prompt("Username")
    creds = Credentials(username, _password(password_stdin))
    verify_login(host, creds, insecure=insecure)
    path = login_file(os.environ)
    save(host, creds, path)
    output.out(f"Login Succeeded: {host} (credentials saved in {path})")


def logout(
    registry: Annotated[str, typer.Argument(metavar="REGISTRY", help="Registry host to forget.")],
) -> None:
    """Forget the saved credentials for a registry."""
    host = _host(registry)
    path = login_file(os.environ)
    if remove(host, path):
        output.out(f"Removed login credentials for {host}")
    else:
        output.out(f"Not logged in to {host}")
