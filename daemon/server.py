"""``corral serve``: take the store lock, bind the port, run the app with uvicorn."""

from __future__ import annotations

import contextlib
import errno
import logging
import socket
from collections.abc import Iterator

import uvicorn

from daemon import logs
from daemon.app import create_app
from daemon.settings import Settings
from registry.errors import CorralError
from registry.store import Store

log = logging.getLogger(__name__)


class ListenError(CorralError):
    pass


def bind(settings: Settings) -> socket.socket:
    host = settings.host.bind_host.strip("[]")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP named, not 0: asyncio turns Nagle off (TCP_NODELAY) only on sockets whose proto says TCP, and
    # accepted sockets inherit it. With Nagle on, a response's body waits ~40 ms behind its headers for the
    # client's delayed ACK, and streamed tokens arrive in bursts.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, settings.host.port))
    except OSError as exc:
        sock.close()
        hint = ""
        if exc.errno == errno.EADDRINUSE:
            hint = "; another corral (or ollama) is using that port: stop it or set CORRAL_HOST to another port"
        raise ListenError(f"could not listen on {settings.host}: {exc.strerror or exc}{hint}") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


class _Server(uvicorn.Server):
    """uvicorn re-raises SIGTERM/SIGINT after a graceful shutdown; a clean shutdown should exit 0 instead."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        with super().capture_signals():
            yield
            self._captured_signals.clear()


class InsecureBind(CorralError):
    pass


def serve(settings: Settings, *, insecure: bool = False) -> int:
    if not settings.host.is_loopback and not settings.api_key and not insecure:
        raise InsecureBind(
            f"refusing to listen on {settings.host} without an API key: anyone who can reach this address could "
            "use and change your models. Set CORRAL_API_KEY (or CORRAL_API_KEY_FILE), bind to 127.0.0.1, or pass "
            "--insecure if you really mean to serve without a key"
        )
    logs.configure(settings.debug)
    store = Store(settings.models)
    store.lock()
    try:
        sock = bind(settings)
        log.info("listening address=%s models=%s", settings.host, store.root)
        app = create_app(settings, store=store)
        config = uvicorn.Config(app, log_config=None, access_log=settings.debug > 0, timeout_graceful_shutdown=10)
        _Server(config).run(sockets=[sock])
    finally:
        store.unlock()
    return 0
