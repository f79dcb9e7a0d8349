"""Ctrl-C in the ``corral run`` REPL, delivered at every stage of a turn (issue 25: "once, on a loaded machine,
Ctrl-C did not stop a long answer within 30 s").

A real SIGINT is raised in the REPL's thread at each distinct line of code (the CLI's, httpx's, httpcore's,
h11's, the threading and context-manager code they use) that runs in that thread from the moment a typed line is
returned until the turn is over, one stage per run, against a real HTTP server streaming a long answer. Wherever it
lands, the REPL must survive and stay usable (a second turn works), the turn must leave no half of itself in the
history, the answer must stop at once (no more than the chunk in hand printed after the interrupt) and the server
must see its connection closed.

What this found before the fix: an interrupt before the answer's ``try`` or after it ended the whole REPL (exit
130); one inside httpcore's pool lock (``ThreadLock.__enter__``/``__exit__``: acquired, then the exception before
the ``with`` took hold) left the lock held, so closing the stream, and every later request, waited for ever.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

import h11
import httpcore
import httpx
import pytest

from cli.client import DaemonClient
from cli.interactive import Repl, Session
from tests.registry_pull.fake_registry import ServerThread

pytestmark = pytest.mark.skipif(not hasattr(signal, "setitimer"), reason="needs POSIX signals")

CHUNKS = 60  # a long answer: 60 pieces, 2 ms apart
ROOTS = tuple(os.path.dirname(m.__file__ or "") + os.sep for m in (httpx, httpcore, h11)) + (
    os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "..", "cli"),
    threading.__file__,
    contextlib.__file__,
)
ROOTS = tuple(os.path.normpath(r) for r in ROOTS)


@dataclass
class Streamer:
    """An ASGI app streaming a long /api/chat answer; records, per request, how it ended."""

    started: int = 0
    ended: list[str] = field(default_factory=list)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        while (await receive()).get("more_body"):
            pass
        self.started += 1
        gone = asyncio.Event()

        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            gone.set()

        watcher = asyncio.ensure_future(watch())
        await send(
            {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/x-ndjson")]}
        )
        try:
            for i in range(CHUNKS):
                if gone.is_set():
                    self.ended.append("client left")
                    return
                line = {"model": "m", "message": {"role": "assistant", "content": f"w{i} "}, "done": False}
                await send(
                    {"type": "http.response.body", "body": (json.dumps(line) + "\n").encode(), "more_body": True}
                )
                await asyncio.sleep(0.002)
            last = {"model": "m", "message": {"role": "assistant", "content": ""}, "done": True}
            await send({"type": "http.response.body", "body": (json.dumps(last) + "\n").encode()})
            self.ended.append("complete")
        finally:
            watcher.cancel()


class Hung(Exception):
    pass


class Injector:
    """A tracer that raises SIGINT in this thread at the ``target``-th distinct line run under ``ROOTS``."""

    def __init__(self, target: int, out: io.StringIO) -> None:
        self.target, self.out = target, out
        self.seen: dict[tuple[str, int], int] = {}
        self.fired_at: tuple[str, int] | None = None
        self.printed_then = 0
        self.armed = False  # from the moment the typed line is handed back

    def trace(self, frame: FrameType, event: str, arg: Any) -> Any:
        if os.path.normpath(frame.f_code.co_filename).startswith(ROOTS):
            return self.local
        return None

    def local(self, frame: FrameType, event: str, arg: Any) -> Any:
        if event == "line" and self.armed and self.fired_at is None:
            key = (frame.f_code.co_filename, frame.f_lineno)
            if key not in self.seen:
                self.seen[key] = len(self.seen) + 1
                if self.seen[key] == self.target:
                    self.fired_at = key
                    self.printed_then = printed(self.out)
                    signal.raise_signal(signal.SIGINT)
        return self.local


def printed(out: io.StringIO) -> int:
    return out.getvalue().count(" w") + out.getvalue().startswith("w")


@contextlib.contextmanager
def hang_alarm(seconds: float) -> Iterator[None]:
    """A stage that never ends (a lock left held) fails the test instead of hanging it."""

    def hung(signum: int, frame: Any) -> None:
        raise Hung(f"no progress for {seconds} s")

    old = signal.signal(signal.SIGALRM, hung)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def one_turn(url: str, target: int) -> tuple[Injector, Repl, io.StringIO, BaseException | None]:
    """The REPL: a typed line, the answer, then a second line ("/bye") that must still be read. A client of its
    own, so a stage that breaks one (a lock left held) cannot take the next stages down with it."""
    out = io.StringIO()
    client = DaemonClient(url, timeout=30)
    lines = iter(["hello", "/bye"])
    injector = Injector(target, out)
    asked: list[str] = []

    def read(prompt: str) -> str:
        injector.armed = False
        line = next(lines)
        asked.append(line)
        injector.armed = line == "hello"
        return line

    repl = Repl(client, Session(model="m"), read=read, out=out)
    repl.preload = lambda: None  # type: ignore[method-assign]
    escaped: BaseException | None = None
    try:
        with hang_alarm(10):
            sys.settrace(injector.trace)
            try:
                repl.run()
            finally:
                sys.settrace(None)
    except BaseException as exc:  # noqa: BLE001 - what escaped is the finding
        escaped = exc
    try:
        with hang_alarm(5):
            client.close()
    except Hung as exc:
        escaped = escaped or Hung(f"closing the client: {exc}")
    if escaped is None and asked != ["hello", "/bye"]:
        escaped = AssertionError(f"the REPL stopped reading after {asked}")
    return injector, repl, out, escaped


def readers() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "corral-answer"]


@pytest.fixture(scope="module")
def streamer() -> Iterator[tuple[Streamer, ServerThread]]:
    app = Streamer()
    with ServerThread(app) as server:
        yield app, server


def test_ctrl_c_at_every_stage_of_a_turn(streamer: tuple[Streamer, ServerThread]) -> None:
    app, server = streamer
    # a turn with no interrupt: how many distinct stages the REPL's thread runs through
    reference, repl, out, escaped = one_turn(server.url, 0)
    assert escaped is None and printed(out) == CHUNKS
    assert [m["role"] for m in repl.session.messages] == ["user", "assistant"]
    stages = len(reference.seen)
    assert stages > 10
    failures = []
    for target in range(1, stages + 1):
        before, asked = len(app.ended), app.started
        injector, repl, out, escaped = one_turn(server.url, target)
        where = f"stage {target} {injector.fired_at}"
        deadline = time.monotonic() + 5  # every request the server got has ended, and every reader with it
        while (len(app.ended) < app.started or readers()) and time.monotonic() < deadline:
            time.sleep(0.01)
        if readers():
            failures.append(f"{where}: the answer's reader thread is still running")
        if injector.fired_at is None:
            continue  # this run took another path and ended before reaching that many stages
        if escaped is not None:
            failures.append(f"{where}: {type(escaped).__name__}: {escaped}")
            continue
        roles = [m["role"] for m in repl.session.messages]
        if roles not in ([], ["user", "assistant"]):
            failures.append(f"{where}: history left as {roles}")
        late = printed(out) - injector.printed_then
        if injector.printed_then < CHUNKS and late > 1:
            failures.append(f"{where}: {late} more pieces printed after the interrupt")
        ends = app.ended[before:]
        if app.started > asked and injector.printed_then < CHUNKS and (not ends or set(ends) != {"client left"}):
            failures.append(f"{where}: the server saw {app.ended[before:]}")
    assert not failures, f"{len(failures)} of {stages} stages:\n" + "\n".join(failures[:80])
