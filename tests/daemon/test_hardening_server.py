"""Slow and hostile clients (issue 17, points 7 and 11).

A daemon must stay reachable while a thousand idle or half-sent connections are held open against it, close the
ones that never finish a request head, survive running out of file descriptors without flooding its log, and
write one log line per request whatever control characters the request carries.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import logging
import re
import resource
import selectors
import socket
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from tests.conftest import Daemon, start_daemon, stop_daemon

HEADER_TIMEOUT = 10.0  # the daemon's: a connection that has not sent a complete request head by then is closed
HALF_SENT = b"POST /api/generate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Le"


# --- helpers --------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def nofile_soft(limit: int) -> Iterator[None]:
    """This process's soft open-file limit set to ``limit`` for a while (children started meanwhile inherit it)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(limit, hard), hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.fixture(autouse=True)
def enough_fds() -> Iterator[None]:
    """The flood needs ~1300 descriptors in this process: raise the soft limit if it is lower."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 4096 if hard == resource.RLIM_INFINITY else min(4096, hard)
    if soft != resource.RLIM_INFINITY and soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def address(d: Daemon) -> tuple[str, int]:
    host, port = d.host.rsplit(":", 1)
    return host, int(port)


def open_flood(addr: tuple[str, int], idle: int, half: int) -> list[socket.socket]:
    socks: list[socket.socket] = []
    try:
        for i in range(idle + half):
            s = socket.create_connection(addr, timeout=5)
            if i >= idle:
                s.sendall(HALF_SENT)
            socks.append(s)
    except BaseException:
        close_all(socks)
        raise
    return socks


def close_all(socks: list[socket.socket]) -> None:
    for s in socks:
        with contextlib.suppress(OSError):
            s.close()


def wait_closed_by_peer(socks: list[socket.socket], within: float) -> tuple[int, float]:
    """Wait until the daemon has closed every socket (EOF or reset); returns (how many are still open, seconds)."""
    started = time.monotonic()
    sel = selectors.DefaultSelector()
    for s in socks:
        s.setblocking(False)
        sel.register(s, selectors.EVENT_READ)
    open_ = len(socks)
    try:
        while open_ and time.monotonic() - started < within:
            for key, _ in sel.select(timeout=0.5):
                s = key.fileobj
                assert isinstance(s, socket.socket)
                try:
                    data = s.recv(65536)
                except BlockingIOError:
                    continue
                except OSError:
                    data = b""
                if not data:
                    sel.unregister(s)
                    open_ -= 1
    finally:
        sel.close()
    return open_, time.monotonic() - started


def still_open(socks: list[socket.socket]) -> int:
    """How many of ``socks`` the daemon has not closed yet (looked at without reading what it sent)."""
    left = 0
    for s in socks:
        s.setblocking(False)
        try:
            left += s.recv(1, socket.MSG_PEEK) != b""
        except BlockingIOError:
            left += 1  # nothing to read: open
        except OSError:
            pass
    return left


def version_within(d: Daemon, seconds: float) -> float:
    """GET /api/version on a fresh connection; returns how long it took, failing past ``seconds``."""
    started = time.monotonic()
    r = httpx.get(d.url + "/api/version", timeout=seconds)
    took = time.monotonic() - started
    assert r.status_code == 200 and "version" in r.json()
    assert took < seconds
    return took


def rss(pid: int) -> int:
    return int(psutil.Process(pid).memory_info().rss)


# --- slow clients against a real daemon ------------------------------------------------------------------------


@pytest.mark.slow
def test_idle_and_half_sent_connections_do_not_lock_out_other_clients(tmp_path: Path) -> None:
    # started with the common Linux default soft limit (1024): the daemon raises it to the hard limit itself
    with nofile_soft(1024):
        d = start_daemon(tmp_path / "models", tmp_path / "daemon.log")
    socks: list[socket.socket] = []
    try:
        before = rss(d.proc.pid)
        socks = open_flood(address(d), idle=1000, half=200)
        flood_opened = time.monotonic()
        took = version_within(d, HEADER_TIMEOUT)
        # answered while the flood was held (before the header timeout let it go), not after: an order, not a time
        held = still_open(socks)
        assert held > len(socks) // 2, f"only {held} of {len(socks)} slow connections open when version answered"
        grown = rss(d.proc.pid) - before
        assert grown < 200 * 1024 * 1024, f"resident memory grew by {grown / 2**20:.0f} MiB"
        left, waited = wait_closed_by_peer(socks, within=HEADER_TIMEOUT + 8 - (time.monotonic() - flood_opened))
        assert left == 0, f"{left} of {len(socks)} idle or half-sent connections still open after {waited:.1f}s"
        version_within(d, HEADER_TIMEOUT)
        size = d.log.stat().st_size
        assert size < 1024 * 1024, f"log grew to {size} bytes"
        print(
            f"version answered in {took:.3f}s with 1200 slow connections; rss +{grown / 2**20:.1f} MiB; "
            f"all closed after {time.monotonic() - flood_opened:.1f}s; log {size} bytes"
        )
        soft, hard = resource.prlimit(d.proc.pid, resource.RLIMIT_NOFILE)
        assert soft == hard or soft >= 10240, (soft, hard)  # it raised its soft limit from 1024 at start
    finally:
        close_all(socks)
        stop_daemon(d)


@pytest.mark.slow
def test_out_of_file_descriptors_keeps_the_log_small_and_the_daemon_reachable(tmp_path: Path) -> None:
    d = start_daemon(tmp_path / "models", tmp_path / "daemon.log")
    socks: list[socket.socket] = []
    try:
        _, hard = resource.prlimit(d.proc.pid, resource.RLIMIT_NOFILE)
        # far fewer descriptors than the daemon planned for at start: accept() runs into EMFILE
        resource.prlimit(d.proc.pid, resource.RLIMIT_NOFILE, (256, hard))
        socks = open_flood(address(d), idle=700, half=0)
        time.sleep(3)  # let the daemon hit EMFILE for a while (asyncio retries accept() once a second)
        took = version_within(d, 10.0)
        close_all(socks)
        stop_daemon(d)  # shutting down after EMFILE must not flood the log either
        size = d.log.stat().st_size
        assert size < 1024 * 1024, f"log grew to {size} bytes"
        log = d.log.read_text(errors="replace")
        print(f"version answered in {took:.3f}s while out of descriptors; log {size} bytes")
        assert log.count("\n") < 200, log[-3000:]
        assert d.proc.returncode == 0
    finally:
        close_all(socks)
        stop_daemon(d)


# --- one request, one log line ----------------------------------------------------------------------------------


def test_control_characters_in_a_request_cannot_forge_log_lines(daemon: Daemon) -> None:
    host, port = address(daemon)
    nasty = "/api/x%0aforged1%0d%0aforged2%1b[31mred%c2%85nel%e2%80%a8ls%00nul%09tab"
    with socket.create_connection((host, port), timeout=10) as s:
        s.sendall(f"GET {nasty} HTTP/1.1\r\nHost: {daemon.host}\r\nUser-Agent: a\r\nConnection: close\r\n\r\n".encode())
        got = b""
        while chunk := s.recv(65536):
            got += chunk
    assert got.startswith(b"HTTP/1.1 404"), got[:200]
    # raw control characters cannot get into the request head at all: the server refuses the request
    with socket.create_connection((host, port), timeout=10) as s:
        s.sendall(b"GET /api/raw\x1b[31mforged3 HTTP/1.1\r\nHost: " + daemon.host.encode() + b"\r\n\r\n")
        s.settimeout(10)
        with contextlib.suppress(OSError):
            s.recv(65536)
    # nor can a space forge a field
    assert httpx.get(daemon.url + "/api/y%20status=200%20model=fake", timeout=10).status_code == 404
    httpx.get(daemon.url + "/api/version", timeout=10)  # a later request: its line follows the others

    def logged() -> str:
        return daemon.log.read_bytes().decode("utf-8")

    deadline = time.monotonic() + 5
    while "path=/api/version" not in logged() and time.monotonic() < deadline:
        time.sleep(0.05)
    text = logged()
    lines = text.split("\n")
    assert len(text.splitlines()) == len(lines) - (1 if text.endswith("\n") else 0), "a Unicode line break got in"
    hits = [ln for ln in lines if "forged" in ln and "msg=request refused" not in ln]  # its 404's reason: 1 more
    assert len(hits) == 1, hits
    line = hits[0]
    assert line.startswith("time=") and "path=" in line and "status=404" in line, line
    for escaped in (r"\n", r"\r", r"\x1b[31mred", r"\x85", r"\u2028", r"\x00", r"\t"):
        assert escaped in line, (escaped, line)
    assert not re.search(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\u2028\u2029]", text), "a raw control character got in"
    assert all(ln.startswith(("time=", "    ")) or not ln for ln in lines), lines
    assert 'path="/api/y status=200 model=fake" status=404' in text


# --- the log formatter and the rate limit (units) ----------------------------------------------------------------


def record(msg: str, *args: Any, level: int = logging.WARNING, name: str = "t", exc: Any = None) -> logging.LogRecord:
    return logging.LogRecord(name, level, __file__, 1, msg, args, exc)


def test_formatter_escapes_controls_in_messages_and_tracebacks() -> None:
    from daemon import logs

    f = logs.Formatter()
    line = f.format(record("request path=%s", "/a\nb\r\x1b[2J\x85\u2028\u202e\udcff"))
    assert "\n" not in line and "\x1b" not in line and "\u2028" not in line
    assert r"/a\nb\r\x1b[2J\x85\u2028\u202e\udcff" in line
    try:
        raise ValueError("bad\ntime=2024 level=INFO msg=forged")
    except ValueError:
        out = f.format(record("failed: %s", "x", level=logging.ERROR, exc=sys.exc_info()))
    first, *rest = out.split("\n")
    assert first.startswith("time=") and "failed: x" in first and rest
    assert all(ln.startswith("    ") for ln in rest), rest  # no traceback line can pass for a record of its own
    assert "    ValueError: bad" in rest and "    time=2024 level=INFO msg=forged" in rest
    long = f.format(record("%s", "y" * 100_000))
    assert len(long) < 20_000 and "more characters" in long


def test_logfmt_quoting_of_request_values() -> None:
    from daemon import logs

    assert logs.quote("/api/generate") == "/api/generate"
    assert logs.quote("t:latest") == "t:latest"
    assert logs.quote("/a b status=200") == '"/a b status=200"'
    assert logs.quote('x"y') == '"x\\"y"'
    assert logs.quote("") == '""'
    assert logs.quote("a\nb") == '"a\\nb"'


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def limited(**kw: Any) -> tuple[logging.Logger, io.StringIO, Any, Clock]:
    from daemon import logs

    clock = Clock()
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(logs.Formatter())
    limiter = logs.RateLimit(handler.handle, clock=clock, **kw)
    handler.addFilter(limiter)
    logger = logging.Logger("corral-test-ratelimit")
    logger.addHandler(handler)
    logger.propagate = False
    return logger, out, limiter, clock


def test_rate_limit_suppresses_repeats_and_summarises() -> None:
    logger, out, limiter, clock = limited(burst=5, interval=60.0)
    for i in range(100):
        logger.error("socket.accept() out of system resource fd=%d", i)
    lines = out.getvalue().splitlines()
    assert len(lines) == 5, lines
    logger.warning("another message")  # a different message is not held back by the first one
    assert len(out.getvalue().splitlines()) == 6
    clock.now += 61
    logger.error("socket.accept() out of system resource fd=%d", 500)
    lines = out.getvalue().splitlines()
    assert any(
        "suppressed 95 similar messages" in ln and "socket.accept() out of system resource" in ln for ln in lines
    ), lines
    assert lines[-1].endswith("fd=500")  # the window restarted: the message is written again


def test_rate_limit_flushes_pending_summaries() -> None:
    logger, out, limiter, clock = limited(burst=2, interval=60.0)
    for _ in range(10):
        logger.warning("same")
    clock.now += 61
    logger.warning("something else")  # any later record writes the summaries of windows that have ended
    assert "suppressed 8 similar messages" in out.getvalue()
    for _ in range(5):
        logger.warning("again")
    limiter.flush()  # at shutdown
    assert "suppressed 3 similar messages" in out.getvalue()


def test_rate_limit_lets_distinct_info_lines_through_up_to_a_byte_budget() -> None:
    logger, out, limiter, clock = limited(burst=5, interval=60.0, max_bytes=40_000)
    logger.setLevel(logging.DEBUG)
    for i in range(200):  # request lines: one template, different text
        logger.info("request method=GET path=/api/version status=200 duration=%.3fs", i / 1000)
    assert len(out.getvalue().splitlines()) == 200
    for _ in range(10):
        logger.info("exactly the same line")
    assert out.getvalue().count("exactly the same line") == 5
    for i in range(1000):
        logger.info("request %d", i)
    assert len(out.getvalue()) <= 40_000
    clock.now += 61
    logger.info("after")
    text = out.getvalue()
    assert "suppressed 5 similar messages in the last 61s: exactly the same line" in text
    assert re.search(r"suppressed \d+ messages in the last 61s: more than 40000 bytes", text)
    assert text.rstrip().endswith("after")


def test_rate_limit_counts_messages_that_differ_only_in_numbers_as_the_same() -> None:
    logger, out, limiter, clock = limited(burst=3)
    for i in range(100):  # asyncio renders its messages itself, with timestamps and addresses in them
        logger.error(f"Exception in callback <TimerHandle when={1000 + i * 0.37} at 0x7f{i:04x}>")
    assert len(out.getvalue().splitlines()) == 3


def test_rate_limit_keeps_only_a_few_tracebacks() -> None:
    logger, out, limiter, clock = limited(burst=100, max_tracebacks=3)
    for i in range(10):
        try:
            raise ValueError(f"boom {i}")
        except ValueError:
            logger.exception("failed %d", i)
    text = out.getvalue()
    assert text.count("Traceback (most recent call last)") == 3
    assert text.count("(traceback left out: too many this minute)") == 7 and "failed 9 (traceback left out" in text
    clock.now += 61
    logger.info("later")
    assert "left out the tracebacks of 7 messages" in out.getvalue()


def test_rate_limit_bounds_the_bytes_of_a_flood() -> None:
    logger, out, limiter, clock = limited()
    for i in range(20_000):
        clock.now += 0.003  # a minute of a flood of errors, some with tracebacks, some with numbers in their text
        try:
            raise OSError(24, "Too many open files")
        except OSError:
            logger.error("socket.accept() out of system resource", exc_info=True)
            logger.error(
                f"Exception in callback BaseSelectorEventLoop._start_serving() when={clock.now}", exc_info=True
            )
        logger.warning("Invalid HTTP request received. %d", i)
        logger.info("request method=GET path=/api/x%d status=404", i)  # distinct lines: the byte budget holds them
    assert len(out.getvalue()) < 4 * 1024 * 1024 + 256 * 1024, len(out.getvalue())
    assert out.getvalue().count("Traceback") <= 20


def test_configure_installs_the_filter_and_formatter_on_the_root_handler() -> None:
    from daemon import logs

    root = logging.getLogger()
    saved = root.handlers[:], root.level
    try:
        logs.configure(0)
        (handler,) = root.handlers
        assert isinstance(handler.formatter, logs.Formatter)
        assert any(isinstance(f, logs.RateLimit) for f in handler.filters)
    finally:
        root.handlers[:], level = saved
        root.setLevel(level)


# --- header, body and keep-alive timeouts; the connection cap (units, in-process server) -------------------------


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            else:
                await send({"type": "lifespan.shutdown.complete"})
                return
    body = b""
    more = True
    while more:
        message = await receive()
        if message["type"] == "http.disconnect":
            return
        body += message.get("body", b"")
        more = message.get("more_body", False)
    if scope["path"] == "/hold":
        await asyncio.sleep(3)
    payload = str(len(body)).encode()
    await send(
        {"type": "http.response.start", "status": 200, "headers": [(b"content-length", str(len(payload)).encode())]}
    )
    await send({"type": "http.response.body", "body": payload})


@contextlib.contextmanager
def serving(**limits: Any) -> Iterator[tuple[str, int]]:
    from daemon.api import server as srv

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    s = srv.make_server(app, limits=srv.Limits(**limits))
    t = threading.Thread(target=s.run, kwargs={"sockets": [sock]}, daemon=True)
    t.start()
    deadline = time.monotonic() + 10
    while not s.started and time.monotonic() < deadline:
        time.sleep(0.01)
    try:
        yield sock.getsockname()[:2]
    finally:
        s.should_exit = True
        t.join(15)
        sock.close()


def closed_after(s: socket.socket, within: float) -> float | None:
    """Seconds until the peer closes ``s`` (reading and dropping what it sends), None if it stays open."""
    started = time.monotonic()
    s.settimeout(0.05)
    while time.monotonic() - started < within:
        try:
            if not s.recv(65536):
                return time.monotonic() - started
        except TimeoutError:
            continue
        except OSError:
            return time.monotonic() - started
    return None


def request(s: socket.socket, path: str = "/", body: bytes = b"") -> bytes:
    s.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
    s.settimeout(10)
    got = b""
    while not re.search(rb"\r\n\r\n\d+$", got):
        chunk = s.recv(65536)
        assert chunk, got
        got += chunk
    return got


# The timeouts below are times, so they are checked as times, but never tightly (issue 26): each is measured from
# before the daemon's own clock starts (so a loaded machine can only make it longer, never shorter than the
# timeout), and the upper bound is the timeout plus SLACK.
SLACK = 8.0


def test_header_timeout_closes_idle_and_half_sent_connections() -> None:
    timeout = 2.0
    with serving(header_timeout=timeout, keep_alive=30) as addr:
        started = time.monotonic()
        idle = socket.create_connection(addr)
        half = socket.create_connection(addr)
        half.sendall(HALF_SENT)
        trickle = socket.create_connection(addr)
        fine = socket.create_connection(addr)
        assert b" 200 " in request(fine)
        with contextlib.suppress(OSError):  # a byte every 50 ms, 4.4 s in all: never completes in time
            for ch in b"GET / HTTP/1.1\r\nHost: x\r\nX-Trickle: " + b"t" * 60:
                trickle.sendall(bytes([ch]))
                time.sleep(0.05)
        for s in (idle, half, trickle):
            assert closed_after(s, timeout + SLACK) is not None
            assert timeout <= time.monotonic() - started < timeout + SLACK
        # a kept-alive connection gets the same deadline for its next request head (keep-alive is 30 s here)
        sent = time.monotonic()
        fine.sendall(b"GET / HTTP/1.1\r\nHo")
        assert closed_after(fine, timeout + SLACK) is not None
        assert timeout <= time.monotonic() - sent < timeout + SLACK
        for s in (idle, half, trickle, fine):
            s.close()


def test_body_trickled_too_slowly_is_cut_and_a_fast_one_is_not() -> None:
    timeout = 2.0
    with serving(header_timeout=30, body_timeout=timeout, body_min_rate=1024, keep_alive=30) as addr:
        slow = socket.create_connection(addr)
        started = time.monotonic()
        slow.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\n")
        with contextlib.suppress(OSError):
            for _ in range(100):  # 20 bytes/s for up to 5 s
                slow.sendall(b"x")
                time.sleep(0.05)
        assert closed_after(slow, timeout + SLACK) is not None
        assert timeout <= time.monotonic() - started < timeout + SLACK
        # a body sent in pieces at a decent rate is read to the end, however long it takes in all
        fast = socket.create_connection(addr)
        fast.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 500000\r\n\r\n")
        for _ in range(25):
            fast.sendall(b"y" * 20000)
            time.sleep(0.1)  # 200 kB/s, 2.5 s in all: longer than body_timeout
        fast.settimeout(10)
        got = b""
        while not got.endswith(b"500000"):
            chunk = fast.recv(65536)
            assert chunk, got
            got += chunk
        assert b" 200 " in got
        slow.close()
        fast.close()


def test_keep_alive_timeout_closes_idle_kept_alive_connections() -> None:
    timeout = 2.0
    with serving(header_timeout=30, keep_alive=timeout) as addr:
        s = socket.create_connection(addr)
        started = time.monotonic()
        assert b" 200 " in request(s)
        assert closed_after(s, timeout + SLACK) is not None  # by the keep-alive timer: the header timeout is 30 s
        assert timeout <= time.monotonic() - started < timeout + SLACK
        s.close()


def test_connection_cap_evicts_the_longest_idle_connection_and_refuses_when_all_are_busy() -> None:
    with serving(max_connections=8, header_timeout=30, keep_alive=30) as addr:
        idle = [socket.create_connection(addr) for _ in range(8)]
        time.sleep(0.2)
        newcomer = socket.create_connection(addr)
        assert b" 200 " in request(newcomer)  # room was made for it
        assert closed_after(idle[0], 10.0) is not None  # the longest idle one went (before the newcomer was served)
        assert closed_after(idle[-1], 0.3) is None
        for s in [*idle, newcomer]:
            s.close()
        time.sleep(0.3)
        busy = [socket.create_connection(addr) for _ in range(8)]
        for s in busy:
            s.sendall(b"POST /hold HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n")
        time.sleep(0.3)
        refused = socket.create_connection(addr)
        assert closed_after(refused, 10.0) is not None  # nothing to evict: the newcomer is turned away at once
        for s in busy:  # and the busy ones were left alone
            s.settimeout(10)
            assert b" 200 " in s.recv(65536)
            s.close()
        refused.close()


def test_raise_open_file_limit() -> None:
    from daemon.api import server as srv

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
        got = srv.raise_open_file_limit()
        now, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        assert got == now and (now == hard or now >= 10240)
        assert srv.Limits.for_open_files(256).max_connections < 256
        assert srv.Limits.for_open_files(1_000_000).max_connections <= 4096
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
