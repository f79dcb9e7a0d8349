"""``corral serve``: take the store lock, bind the port, run the app with uvicorn.

Slow and idle clients cannot take the daemon down (what Go's net/http and Apache's mod_reqtimeout do, for h11):

* **A cap on open connections.** At most :attr:`Limits.max_connections` sockets are kept (from the open-file limit,
  which the daemon raises from its soft to its hard value at start). A connection beyond the cap closes the one that
  has been idle longest (no request in progress: waiting for a request head, or kept alive between requests), so
  a flood of idle sockets cannot lock well-behaved clients out; when every connection is busy with a request, the
  newcomer is closed at once. Running out of descriptors anyway (``accept()`` fails with EMFILE, say because
  the limit was lowered under the daemon) closes idle connections and fits the cap to the limit then in force.
* **A header timeout.** A connection that has not sent a complete request head within
  :attr:`Limits.header_timeout` seconds of connecting (or of the first byte of its next request) is closed.
* **A body timeout.** A request body must keep coming: the deadline starts :attr:`Limits.body_timeout` seconds
  ahead and each byte received moves it by ``1 / body_min_rate`` seconds, up to ``body_timeout`` ahead, so a body
  trickled in slower than ``body_min_rate`` bytes a second is cut, while a large upload at any reasonable speed
  is not. Time the daemon itself holds the body back (flow control, ``Expect: 100-continue``) does not count.
* **A keep-alive timeout.** An idle kept-alive connection is closed after :attr:`Limits.keep_alive` seconds
  (uvicorn's own timer; Ollama's Go server sets none).
* **A write timeout.** A client that stops reading its answer (a stream, a model export) must not hold a runner
  slot and the daemon's buffers for ever. Once its socket has taken no bytes for :attr:`Limits.write_timeout`
  seconds the connection is aborted, so the request sees its client gone: a generation is cancelled and its
  runner slot freed (``daemon.api.disconnect``), and the buffers are dropped. Two clocks, whichever runs out first:
  on Linux the kernel's (``TCP_USER_TIMEOUT``: data left unacknowledged, or unsent behind the client's zero
  receive window, for that long), which works however large the kernel lets the send buffer grow (up to 4 MiB,
  minutes of a token stream); and everywhere the daemon's own, from the moment the socket and then the
  transport's buffer are full (asyncio's ``pause_writing``): the deadline starts ``write_timeout`` ahead and each
  byte the client takes moves it by ``1 / write_min_rate`` seconds, up to ``write_timeout`` ahead.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import signal
import socket
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from types import FrameType
from typing import Any, ClassVar

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from daemon import logs
from daemon.api.app import create_app
from daemon.api.lifecycle import Lifecycle
from daemon.settings import Settings
from errors import CorralError
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


MAX_CONNECTIONS = 1024
MIN_CONNECTIONS = 16


@dataclass(frozen=True)
class Limits:
    max_connections: int = MAX_CONNECTIONS
    header_timeout: float = 10.0
    body_timeout: float = 30.0
    body_min_rate: float = 1024.0  # bytes per second
    keep_alive: float = 5.0
    write_timeout: float = 60.0  # seconds a client may leave its answer unread (see the module docstring)
    write_min_rate: float = 1024.0  # bytes per second it must take meanwhile

    @classmethod
    def for_open_files(cls, nofile: int) -> Limits:
        """Limits for a process allowed ``nofile`` open files: a quarter of them (at least 64) stay free for model
        files, runner pipes, uploads and logs."""
        if nofile <= 0:  # unknown or unlimited
            return cls()
        reserve = max(64, nofile // 4)
        return cls(max_connections=max(MIN_CONNECTIONS, min(MAX_CONNECTIONS, nofile - reserve)))


def raise_open_file_limit() -> int:
    """Raise this process's soft open-file limit to its hard limit, as Go programs (Ollama) do at start; returns
    the soft limit now in force (0 where there is none to read)."""
    from daemon.runners.process import remember_starting_limits

    remember_starting_limits()  # runners get the limit the daemon started with
    try:
        import resource
    except ImportError:  # Windows
        return 0
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    infinite = resource.RLIM_INFINITY
    if soft == infinite:
        return 0
    # macOS reports an unlimited hard limit but refuses a soft limit above OPEN_MAX (10240)
    for want in ([hard] if hard != infinite else []) + [1 << 20, 65536, 10240]:
        if want <= soft or (hard != infinite and want > hard):
            continue
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            break
        except (ValueError, OSError):
            continue
    return _soft_open_file_limit()


def _soft_open_file_limit() -> int:
    """The soft open-file limit in force, 0 if there is none (or no way to read it)."""
    try:
        import resource
    except ImportError:  # Windows
        return 0
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return 0 if soft == resource.RLIM_INFINITY else int(soft)


class _Gate:
    """The connections open now, and which of them are idle (no request in progress), longest idle first."""

    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self.cap = limits.max_connections
        self.open: set[_Protocol] = set()
        self.idle: dict[_Protocol, None] = {}
        self.last_shed = float("-inf")

    def admit(self, proto: _Protocol) -> bool:
        self.open.add(proto)
        evicted = 0
        while len(self.open) > self.cap:
            victim = next(iter(self.idle), None)
            if victim is None:
                self.open.discard(proto)
                log.warning(
                    "connection limit reached: %d connections open and all busy; refusing new connections",
                    len(self.open),
                )
                return False
            self._evict(victim)
            evicted += 1
        if evicted:
            log.warning("connection limit reached: %d connections open; closing the longest idle ones", self.cap)
        return True

    def _evict(self, proto: _Protocol) -> None:
        self.forget(proto)
        proto.transport.close()

    def mark(self, proto: _Protocol, idle: bool) -> None:
        self.idle.pop(proto, None)
        if idle and proto in self.open:
            self.idle[proto] = None

    def forget(self, proto: _Protocol) -> None:
        self.open.discard(proto)
        self.idle.pop(proto, None)

    def out_of_descriptors(self, now: float, nofile: int) -> tuple[int, int] | None:
        """accept() failed for want of file descriptors (``nofile`` is the soft limit now): fit the cap to that
        limit (someone may have lowered it) and close half the idle connections (at least 16) to make room for the
        ones asyncio has accepted meanwhile and is about to hand over. At most once a second: asyncio calls this
        for every failed accept, thousands of times a second. Returns (connections closed, cap)."""
        if now - self.last_shed < 1.0:
            return None
        self.last_shed = now
        if nofile > 0:
            self.cap = min(self.cap, Limits.for_open_files(nofile).max_connections)
        target = max(len(self.idle) // 2, min(MIN_CONNECTIONS, len(self.idle)), len(self.open) - self.cap)
        closed = 0
        while closed < target and self.idle:
            self._evict(next(iter(self.idle)))
            closed += 1
        return closed, self.cap


class _Protocol(H11Protocol):
    """uvicorn's h11 protocol with the connection cap, the header timeout and the body timeout."""

    gate: ClassVar[_Gate]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._phase = ""  # head (waiting for a request head), body, busy (request in hand), idle (kept alive)
        self._deadline = 0.0
        self._watchdog: asyncio.TimerHandle | None = None
        self._watchdog_at = 0.0
        self._write_watchdog: asyncio.TimerHandle | None = None
        self._write_deadline = 0.0
        self._write_buffered = 0  # bytes in the transport's buffer at the last write check

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if not self.gate.admit(self):
            transport.close()
            return
        user_timeout = getattr(socket, "TCP_USER_TIMEOUT", None)  # Linux
        sock = transport.get_extra_info("socket")
        if user_timeout is not None and sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, user_timeout, int(self.gate.limits.write_timeout * 1000))
        self._update()

    def connection_lost(self, exc: Exception | None) -> None:
        if isinstance(exc, TimeoutError) and self._phase == "busy":  # the kernel's write timeout (TCP_USER_TIMEOUT)
            self._log_cut()
        self.gate.forget(self)
        self._disarm()
        self._disarm_write()
        super().connection_lost(exc)

    def _log_cut(self) -> None:
        log.info(
            "closing a connection whose client stopped reading its answer (no bytes taken for %gs)",
            self.gate.limits.write_timeout,
        )

    def pause_writing(self) -> None:
        """The transport's buffer is full: the client is not taking bytes as fast as they come. Start the clock."""
        super().pause_writing()
        if self.transport is None or self.transport.is_closing() or self._write_watchdog is not None:
            return
        limits = self.gate.limits
        self._write_deadline = self.loop.time() + limits.write_timeout
        self._write_buffered = self.transport.get_write_buffer_size()
        self._write_watchdog = self.loop.call_at(self._write_deadline, self._check_write)

    def resume_writing(self) -> None:
        super().resume_writing()
        self._disarm_write()

    def _disarm_write(self) -> None:
        if self._write_watchdog is not None:
            self._write_watchdog.cancel()
            self._write_watchdog = None

    def _check_write(self) -> None:
        self._write_watchdog = None
        if self.transport is None or self.transport.is_closing() or not self.flow.write_paused:
            return
        now = self.loop.time()
        limits = self.gate.limits
        buffered = self.transport.get_write_buffer_size()
        taken = max(0, self._write_buffered - buffered)  # while paused nothing is added, so this is what it read
        self._write_buffered = buffered
        self._write_deadline = min(self._write_deadline + taken / limits.write_min_rate, now + limits.write_timeout)
        if now < self._write_deadline:
            self._write_watchdog = self.loop.call_at(self._write_deadline, self._check_write)
            return
        self._log_cut()
        self.gate.forget(self)
        sock = self.transport.get_extra_info("socket")
        if sock is not None:  # a reset, not a FIN queued behind the bytes the client will never read
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.transport.abort()  # close() would wait to send the buffer first

    def data_received(self, data: bytes) -> None:
        before = self._phase
        super().data_received(data)
        self._update()
        if self._phase == "body" and before == "body":
            limits = self.gate.limits
            self._deadline = min(
                self._deadline + len(data) / limits.body_min_rate, self.loop.time() + limits.body_timeout
            )

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._update()

    def _update(self) -> None:
        if self.transport is None or self.transport.is_closing():
            return
        state = self.conn.their_state
        if state is h11.IDLE:
            phase = "idle" if self.timeout_keep_alive_task is not None else "head"
        elif state is h11.SEND_BODY:
            phase = "body"
        else:
            phase = "busy"
        if phase == self._phase:
            return
        self._phase = phase
        self.gate.mark(self, idle=phase in ("head", "idle"))
        limits = self.gate.limits
        if phase == "head":
            self._arm(self.loop.time() + limits.header_timeout)
        elif phase == "body":
            self._arm(self.loop.time() + limits.body_timeout)
        else:  # busy: the app has the request; idle: uvicorn's keep-alive timer runs
            self._disarm()

    def _arm(self, deadline: float) -> None:
        self._deadline = deadline
        if self._watchdog is not None and self._watchdog_at <= deadline:
            return  # it fires earlier, sees the new deadline and waits on
        self._disarm()
        self._watchdog_at = deadline
        self._watchdog = self.loop.call_at(deadline, self._check)

    def _disarm(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None

    def _check(self) -> None:
        self._watchdog = None
        if self.transport is None or self.transport.is_closing() or self._phase not in ("head", "body"):
            return
        now = self.loop.time()
        limits = self.gate.limits
        if self._phase == "body":
            cycle = self.cycle
            if (
                cycle is not None
                and not cycle.response_complete
                and (self.flow.read_paused or cycle.waiting_for_100_continue)
            ):
                # the daemon is holding the body back, not the client
                self._deadline = max(self._deadline, now + limits.body_timeout)
        if now < self._deadline:
            self._watchdog_at = self._deadline
            self._watchdog = self.loop.call_at(self._deadline, self._check)
            return
        if self._phase == "head":
            log.debug("closing a connection that sent no complete request head within %gs", limits.header_timeout)
        else:
            log.debug("closing a connection whose request body came slower than %g bytes/s", limits.body_min_rate)
        self.gate.forget(self)
        self.transport.close()


class _Server(uvicorn.Server):
    """uvicorn re-raises SIGTERM/SIGINT after a graceful shutdown; a clean shutdown should exit 0 instead.

    SIGTERM drains when the app has a :class:`~daemon.api.lifecycle.Lifecycle` with a drain timeout: readiness goes
    503 at once, requests in flight finish (new ones are served during the grace, then refused with 503), and only
    then does uvicorn's shutdown start. A second SIGTERM, or SIGINT, shuts down at once as before."""

    gate: _Gate
    lifecycle: Lifecycle | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        life = self.lifecycle
        if sig == signal.SIGTERM and life is not None and life.drain_timeout > 0 and not self.should_exit:
            if not life.draining:
                life.begin_drain()  # the main loop's tick (every 0.1 s) ends the drain
                return
            log.info("second SIGTERM while draining: stopping now")
        super().handle_exit(sig, frame)

    async def on_tick(self, counter: int) -> bool:
        life = self.lifecycle
        if life is not None and life.draining and not self.should_exit and life.drained():
            self.should_exit = True
            if life.in_flight:  # the drain timed out: what is left gets a short grace from uvicorn, not another 10 s
                self.config.timeout_graceful_shutdown = 1
        return await super().on_tick(counter)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        with super().capture_signals():
            yield
            self._captured_signals.clear()

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        asyncio.get_running_loop().set_exception_handler(self._loop_exception)
        await super().startup(sockets=sockets)

    def _loop_exception(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        exc = context.get("exception")
        if isinstance(exc, OSError) and exc.errno in (errno.EMFILE, errno.ENFILE) and "socket" in context:
            shed = self.gate.out_of_descriptors(loop.time(), _soft_open_file_limit())
            if shed is not None:
                log.error(
                    "out of file descriptors accepting connections (%s); closed %d idle connections, keeping at "
                    "most %d from now on",
                    exc.strerror,
                    shed[0],
                    shed[1],
                )
            return
        # After each failed accept asyncio schedules a retry of the listener (one per connection it tried that
        # round: thousands); those still pending at shutdown find the listening socket closed and fail. Noise.
        callback = getattr(context.get("handle"), "_callback", None)
        if self.should_exit and getattr(callback, "__name__", "") == "_start_serving":
            return
        loop.default_exception_handler(context)


def make_server(app: Any, *, limits: Limits, debug: int = 0, lifecycle: Lifecycle | None = None) -> _Server:
    gate = _Gate(limits)
    protocol = type("CorralH11Protocol", (_Protocol,), {"gate": gate})
    # ws="none": the API has no WebSocket routes, and an upgraded connection would leave the gate's count
    keep_alive: Any = limits.keep_alive  # uvicorn types it as int; a float works (tests use fractions)
    config = uvicorn.Config(
        app,
        http=protocol,
        ws="none",
        log_config=None,
        access_log=debug > 0,
        timeout_graceful_shutdown=10,
        timeout_keep_alive=keep_alive,
    )
    server = _Server(config)
    server.gate = gate
    server.lifecycle = lifecycle
    return server


class InsecureBind(CorralError):
    pass


def serve(settings: Settings, *, insecure: bool = False) -> int:
    if not settings.host.is_loopback and not settings.api_key and not insecure:
        raise InsecureBind(
            f"refusing to listen on {settings.host} without an API key: anyone who can reach this address could "
            "use and change your models. Set CORRAL_API_KEY (or CORRAL_API_KEY_FILE), bind to 127.0.0.1, or pass "
            "--insecure if you really mean to serve without a key"
        )
    logs.configure(settings.debug, settings.instance)
    limits = Limits.for_open_files(raise_open_file_limit())
    store = Store(settings.models)
    store.lock()
    try:
        sock = bind(settings)
        log.info("listening address=%s models=%s max_connections=%d", settings.host, store.root, limits.max_connections)
        app = create_app(settings, store=store)
        make_server(app, limits=limits, debug=settings.debug, lifecycle=app.state.lifecycle).run(sockets=[sock])
    finally:
        store.unlock()
        logs.flush()
    return 0
