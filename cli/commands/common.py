"""What every client command shares: the daemon client built from the environment."""

from __future__ import annotations

import os
from collections.abc import Mapping

from cli.client import DaemonClient
from daemon.settings import parse_host


def client_from_env(environ: Mapping[str, str] | None = None, timeout: float | None = 60.0) -> DaemonClient:
    """A client for ``CORRAL_HOST`` (default 127.0.0.1:11434), sending ``CORRAL_API_KEY`` if set.

    Only the variables the client needs are read, so a bad server-only variable cannot break ``corral list``.
    """
    env = os.environ if environ is None else environ
    host = parse_host(env.get("CORRAL_HOST"))
    return DaemonClient(host.url(), timeout, api_key=env.get("CORRAL_API_KEY", "").strip() or None)
